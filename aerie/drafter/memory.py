"""Peak memory of one drafter training process, per GPU, from the settings alone (torch-free: the dry run's fit
plan calls it while Snakemake parses the workflow).

Every figure comes from the training code's structure (``loop.py``, ``ttt.py``, ``layers.py``): what each part
holds, in which dtype, for how long. The drafter's shape comes from ``DrafterConfig.from_target`` exactly as
``loop.build_drafter`` makes it. Under torchrun each process holds a whole replica (DDP: parameters, gradients
and AdamW state are not sharded) and trains its own batch, so the per-GPU figure does not shrink with more GPUs.

Parts (bytes per GPU):
- trainable parameters, their gradients (fp32 master copies) and AdamW's two moments (fp32);
- the frozen target embeddings the drafter holds (fp32 [V, H]) and, for ``full`` hidden shards, the target's
  lm_head (fp32 [V, H] for the greedy token plus its draft-vocab rows [Vd, H] for the soft targets);
- bf16 copies of the weights that autocast keeps while a forward runs (GPU only);
- the batch tensors of the largest batch the settings allow (``max_batch_tokens``, else ``batch_size`` windows
  of ``max_seq_len`` rows);
- activations of that batch: what the TTT unroll keeps per token (each step's hidden state and attention keys/
  values; everything else is recomputed: activation checkpointing per step), their gradients during backward,
  the transient activations of the one step being recomputed, and the chunked attention/loss working sets.

``tests/test_drafter_memory.py`` checks the estimate against the peak measured on CPU at small dims;
``bench/drafter_memory.py`` against the peak at Kimi K2.5's drafter dims (bench/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from aerie.drafter.config import TrainConfig
from aerie.drafter.shape import DrafterConfig

GIB = 1024**3
FP32 = 4
# Working-set caps of the chunked kernels (ttt.py, layers.py): the attention processes query rows in chunks
# whose fp32 score block stays under ATTENTION_CHUNK_ELEMENTS per batch; the vocab loss takes LOSS_CHUNK_ROWS
# rows of logits at a time.
ATTENTION_CHUNK_ELEMENTS = 2**26
LOSS_CHUNK_ROWS = 4096


@dataclass
class TrainingMemory:
    """Estimated peak bytes of one training process, by part (bytes per GPU)."""

    parts: dict[str, int]
    batch_tokens: int  # padded tokens of the largest batch the settings allow
    window: int  # rows of the longest window
    activation_bytes: int  # 2 (bf16 autocast on a GPU) or 4 (fp32 on the CPU)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = ", ".join(f"{name} {size / GIB:.1f}" for name, size in self.parts.items() if size >= GIB / 20)
        dtype = "bf16" if self.activation_bytes == 2 else "fp32"
        return (
            f"drafter training: {self.total / GIB:.1f} GiB per GPU at {self.batch_tokens} tokens per batch "
            f"(windows of {self.window}, {dtype} activations; GiB: {parts})"
        )


def drafter_shape(train: TrainConfig, text_config: dict, draft_vocab_size: int, num_aux_layers: int) -> DrafterConfig:
    """The drafter training builds for this target (``loop.build_drafter``'s call, torch-free)."""
    tc = text_config.get("text_config") or text_config  # a multimodal wrapper's config.json: its text part
    shape = {k: v for k, v in train.drafter_shape().items() if v not in (None, False, "auto")}
    aux = list(range(1, num_aux_layers + 1))  # the ids do not change any size, only their count does
    return DrafterConfig.from_target(SimpleNamespace(**tc), draft_vocab_size, aux, **shape)


def trainable_parameters(d: DrafterConfig) -> int:
    """Parameters the optimizer updates: everything but the frozen embeddings (as Eagle3Drafter builds them)."""
    H, A = d.hidden_size, d.num_aux_layers
    fc = A * H * H + (A * H if d.fc_norm else 0)
    norms = 4 * H  # input_layernorm, hidden_norm, post_attention_layernorm, final norm
    mlp = 3 * H * d.intermediate_size
    head = d.draft_vocab_size * H
    if d.attention == "mla":
        h, n, r, v = d.num_attention_heads, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim
        attn = (
            2 * H * d.q_lora_rank
            + d.q_lora_rank  # q_a_layernorm
            + d.q_lora_rank * h * (n + r)
            + 2 * H * (d.kv_lora_rank + r)
            + d.kv_lora_rank  # kv_a_layernorm
            + d.kv_lora_rank * h * (n + v)
            + h * v * H
        )
    else:
        h, kvh, hd = d.num_attention_heads, d.num_key_value_heads, d.head_dim
        attn = 2 * H * (h + 2 * kvh) * hd + h * hd * H
    return fc + norms + mlp + head + attn


def _attention_dims(d: DrafterConfig) -> tuple[int, int, int, int]:
    """(query heads, key/value heads as cached, query/key head size, value head size) of the TTT cache."""
    if d.attention == "mla":  # keys and values expanded per head from the latent (mla_layer.py)
        h = d.num_attention_heads
        return h, h, d.qk_nope_head_dim + d.qk_rope_head_dim, d.v_head_dim
    return d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.head_dim


def step_activation_bytes_per_token(d: DrafterConfig, a: int) -> int:
    """Bytes per token one TTT step's recomputed forward keeps for its backward (activation dtype ``a`` bytes;
    norms compute in fp32). Counted tensor by tensor from model.py / llama_layer.py / mla_layer.py."""
    H, inter = d.hidden_size, d.intermediate_size
    h, kvh, dq, dv = _attention_dims(d)
    rms = FP32 * H + a * H  # RMSNorm keeps its fp32 input and the normalised value it scales
    layer_in = FP32 * H + a * H + 2 * rms + FP32 * 2 * H  # embeds (fp32 lookup, cast), two norms, the 2H concat
    if d.attention == "mla":
        Lq, Lkv, r = d.q_lora_rank, d.kv_lora_rank, d.qk_rope_head_dim
        casts = 2 * a * 2 * H  # autocast casts the 2H input once per down-projection
        attn = (
            casts
            + a * Lq
            + FP32 * Lq
            + a * h * dq  # q_b_proj output
            + a * (Lkv + r)
            + FP32 * Lkv
            + a * h * (dq - r + dv)  # kv_b_proj output
            + 2 * FP32 * h * r  # rope of q in fp32
            + 3 * a * h * dq  # q = cat(nope, rope) * multiplier; k = cat(nope, rope)
        )
    else:
        casts = 3 * a * 2 * H  # q, k, v projections each cast the 2H input
        attn = casts + a * (h + 2 * kvh) * dq + 2 * FP32 * (h + kvh) * dq + a * (h + kvh) * dq
    attn += a * h * dv + FP32 * h + a * h * dv  # attention output, its log-sum-exp, o_proj's input layout
    mlp = a * H + rms + 4 * a * inter + a * H  # residual, post-attention norm, gate/up/silu/product, down
    out = rms + a * H  # final norm, the hidden state handed on
    return layer_in + attn + mlp + out


def estimate_training_memory(
    train: TrainConfig,
    text_config: dict,
    draft_vocab_size: int,
    gpus: int,
    *,
    num_aux_layers: int = 3,
    hidden_layout: str = "full",
    target_topk: int = 32,
) -> TrainingMemory:
    """Peak bytes per GPU (or of the one CPU process when ``gpus`` is 0 or ``train.device`` is cpu) of training
    a drafter for the target whose text config.json is ``text_config``.

    ``num_aux_layers``: len(hidden.aux_layer_ids) (3 by default); ``hidden_layout``: the hidden shards' layout
    (``compact`` holds no lm_head on the GPU; ``full`` is the larger, the default); ``target_topk``: compact
    shards' top-k.
    """
    if hidden_layout not in ("full", "compact"):
        raise ValueError(f"hidden_layout must be 'full' or 'compact', not {hidden_layout!r}")
    tc = text_config.get("text_config") or text_config
    d = drafter_shape(train, text_config, draft_vocab_size, num_aux_layers)
    on_gpu = gpus >= 1 and train.device != "cpu"
    a = 2 if on_gpu else FP32
    H, V, Vd, A, K = d.hidden_size, int(tc["vocab_size"]), d.draft_vocab_size, num_aux_layers, train.ttt_steps
    T = train.max_seq_len
    N = train.batch_size * T
    if train.max_batch_tokens:
        N = min(N, max(train.max_batch_tokens, T))
    B = max(1, N // T)
    W = N + B * (K + 2)  # token rows a batch reads (each window reads ttt_steps + 2 past its rows)
    P = trainable_parameters(d)
    h, kvh, dq, dv = _attention_dims(d)
    kv_token = a * kvh * (dq + dv)

    parts = {
        "parameters": FP32 * P,
        "gradients": FP32 * P,
        "optimizer state": 2 * FP32 * P,
        "frozen embeddings": FP32 * V * H,
    }
    if hidden_layout == "full":
        parts["target lm_head"] = FP32 * (V + Vd) * H
    if on_gpu:
        parts["bf16 weight copies"] = 2 * P
    per_row = 8 + 1 + 1 + (8 * target_topk + FP32 * target_topk if hidden_layout == "compact" else FP32 * H)
    parts["batch"] = N * (FP32 * A * H + 8 + 1) + W * per_row
    persistent = (K + 1) * a * H + K * kv_token  # each step's hidden state and its cached keys/values
    backward = (K - 1) * kv_token + 2 * a * H  # gradients of the cached keys/values, of the hidden chain
    step = 2 * step_activation_bytes_per_token(d, a)  # one step recomputed, and its gradients
    chunk_rows = max(1, min(T, ATTENTION_CHUNK_ELEMENTS // max(1, h * T)))
    attention = 4 * FP32 * B * h * chunk_rows * (T + K)  # scores, probabilities, their gradients: one chunk
    loss = 3 * FP32 * min(LOSS_CHUNK_ROWS, N) * Vd  # logits, probabilities, their gradient: one chunk
    parts["activations"] = N * (persistent + backward + step) + attention + loss
    return TrainingMemory(parts=parts, batch_tokens=N, window=T, activation_bytes=a)
