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
- bf16 copies of the weights that autocast keeps while a step runs (GPU only);
- the batch tensors of the largest batch the settings allow (``max_batch_tokens``, else ``batch_size`` windows
  of ``max_seq_len`` rows);
- activations of that batch at the peak of backward (``activation_bytes``): what the TTT unroll keeps per token
  (each step's hidden state and attention key/value; the rest is recomputed: activation checkpointing per step),
  the key/value gradients waiting to be summed, the re-run step's saved tensors and the larger of the chunked
  loss's and attention's working sets; plus one weight gradient being summed. AdamW's step comes after backward
  freed them: its fp32 temporaries count only where they exceed the activations (short windows).

``tests/test_drafter_memory.py`` checks the estimate against the peak measured on CPU at small dims;
``bench/drafter_memory.py`` against the peak at Kimi K2.5's drafter dims (bench/RESULTS.md).
"""

from __future__ import annotations

from types import SimpleNamespace

from aerie.drafter_kinds.eagle3.shape import DrafterConfig
from aerie.drafter_kinds.kind import HostMemory, TrainingMemory, TrainingSettings

FP32 = 4
# The chunk sizes of the training kernels (read here, not imported: parse time must not import torch):
# aerie.drafter_kinds.eagle3.layers.ATTENTION_CHUNK_ROWS (query rows per attention chunk) and
# aerie.drafter_kinds.eagle3.ttt.LOSS_CHUNK_ROWS
# (rows of logits per loss chunk). tests/test_drafter_memory.py keeps these equal to them.
ATTENTION_CHUNK_ROWS = 64
LOSS_CHUNK_ROWS = 256


def drafter_shape(
    train: TrainingSettings, text_config: dict, draft_vocab_size: int, num_aux_layers: int
) -> DrafterConfig:
    """The drafter training builds for this target (``loop.build_drafter``'s call, torch-free)."""
    tc = text_config.get("text_config") or text_config  # a multimodal wrapper's config.json: its text part
    shape = {k: v for k, v in train.kind_settings.drafter_shape().items() if v not in (None, False, "auto")}
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


def attention_cost_rows(d: DrafterConfig) -> float:
    """The window length at which a row's causal attention costs as much compute as the rest of its TTT step:
    a token's matmuls do ~2 FLOPs per trainable parameter, its attention 2 * heads * (qk + v head size) per key it
    reads (half the window on average). aerie.drafter.data.batch_cost weighs batches with it (rank balance)."""
    h, _, dq, dv = _attention_dims(d)
    return trainable_parameters(d) / (h * (dq + dv))


def train_flops_per_token(d: DrafterConfig, ttt_steps: int, window: int) -> float:
    """Training FLOPs (forward + backward, 3x the forward) per token of a window of ``window`` rows: each of the
    ``ttt_steps`` steps runs every row through the layer and lm_head (2 FLOPs per trainable parameter, fc only at
    step 0) and attends to the step-0 keys before it (window / 2 on average) and its own earlier steps."""
    h, _, dq, dv = _attention_dims(d)
    fc = d.num_aux_layers * d.hidden_size * d.hidden_size
    matmuls = 2 * (trainable_parameters(d) - fc) * ttt_steps + 2 * fc
    attention = sum(2 * h * (dq + dv) * (window / 2 + k) for k in range(ttt_steps))
    return 3.0 * (matmuls + attention)


def _attention_dims(d: DrafterConfig) -> tuple[int, int, int, int]:
    """(query heads, key/value heads as cached, query/key head size, value head size) of the TTT cache."""
    if d.attention == "mla":  # keys and values expanded per head from the latent (mla_layer.py)
        h = d.num_attention_heads
        return h, h, d.qk_nope_head_dim + d.qk_rope_head_dim, d.v_head_dim
    return d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.head_dim


def _rms_norm(width: int, a: int, input_is_fp32: bool) -> int:
    """What RMSNorm (layers.py) keeps for backward per token: its fp32 input (a new tensor unless the input is
    already fp32) and the normalised value in the input's dtype that the weight scales."""
    return (0 if input_is_fp32 else FP32 * width) + a * width


def step_saved_bytes_per_token(d: DrafterConfig, a: int) -> tuple[int, int]:
    """Bytes per token one TTT step's re-run keeps for its backward, tensor by tensor from model.py,
    llama_layer.py and mla_layer.py: (up to the attention, after it). ``a``: bytes of the activation dtype
    (RMSNorm outputs are fp32; under autocast every linear layer keeps its own bf16 cast of an fp32 input).
    Backward frees the second part before it reaches the attention."""
    H, inter = d.hidden_size, d.intermediate_size
    h, kvh, dq, dv = _attention_dims(d)
    cast = 0 if a == FP32 else a  # an autocast copy of an fp32 tensor, per reader
    before = _rms_norm(H, a, False) + _rms_norm(H, a, a == FP32)  # input_layernorm(embeds), hidden_norm(hidden)
    before += FP32 * 2 * H  # x = [both norms] (fp32: the norms' outputs are)
    if d.attention == "mla":
        Lq, Lkv = d.q_lora_rank, d.kv_lora_rank
        before += 2 * cast * 2 * H  # q_a_proj and kv_a_proj_with_mqa cast x
        before += (a * Lq if a == FP32 else 0) + _rms_norm(Lq, a, False) + cast * Lq  # q_a, its norm, q_b's input
        before += _rms_norm(Lkv, a, False) + cast * Lkv  # the compressed kv's norm, kv_b's input
        before += a * (Lkv + d.qk_rope_head_dim) if a == FP32 else 0  # the latent (the fp32 norm reads a view)
    else:
        before += 3 * cast * 2 * H  # q/k/v projections cast x
    before += a * h * dq + a * kvh * (dq + dv)  # the query the attention keeps; the key/value made again
    after = a * h * dv  # o_proj's [B, T, h*dv] input
    after += a * H + _rms_norm(H, a, a == FP32) + 2 * cast * H  # residual, post_attention_layernorm, gate/up casts
    after += 4 * a * inter  # gate, silu(gate), up, their product
    after += a * H + _rms_norm(H, a, False) + FP32 * H  # hidden_out (made again), final norm, its fp32 output
    return before, after


def attention_block_bytes(batch: int, heads: int, keys: int, a: int) -> int:
    """TTTAttention backward's working set for one chunk of query rows: the fp32 probabilities, their gradient
    and three fp32 temporaries of the softmax backward, and three copies in the activation dtype."""
    return batch * heads * ATTENTION_CHUNK_ROWS * keys * (5 * FP32 + 3 * a)


def loss_chunk_bytes(rows: int, vocab: int, hidden: int, a: int) -> int:
    """SoftCrossEntropy backward's working set: one chunk's logits (activation dtype), their fp32 softmax, the
    soft targets and two fp32 temporaries, the logits' gradient, and the fp32 sum of lm_head's gradient (the
    buffer of a gradient block's logit gradients is added by ``activation_bytes``)."""
    return rows * vocab * (2 * a + 4 * FP32) + FP32 * vocab * hidden


def activation_bytes(d: DrafterConfig, K: int, a: int, batch: int, window: int) -> int:
    """Peak activation bytes of one batch of ``batch`` windows of ``window`` rows in the checkpointed unroll
    (ttt.ttt_forward). Forward keeps, per step, the hidden state it hands on, its cached key/value and the input
    of the vocabulary loss in the logits' dtype (activation checkpointing drops the rest). The peak is in
    backward, around step K-2: every step's key/value is still held and the gradients step K-1 sent back to
    keys/values 0..K-2 wait to be summed; then the largest of three moments: the loss's backward (one chunk of
    logits, the fp32 gradient of its input), the start of the re-run step's backward (everything it saved), or
    its attention (the query, key/value and diagonal gradients, fp32 sums of the step-0 key/value gradient, one
    chunk of scores)."""
    H = d.hidden_size
    h, kvh, dq, dv = _attention_dims(d)
    kv = kvh * (dq + dv)
    N = batch * window
    # per step: the hidden state handed on, the cached key/value, the loss's input; positions, draft ids, row weights
    persistent = a * H + K * (a * H + a * kv + a * H) + K * (8 + 8 + FP32)
    pending = max(K - 1, 0) * a * kv
    before, after = step_saved_bytes_per_token(d, a)
    grad_in = FP32 * H + a * H  # gradients arriving at the step: its loss input's (fp32) and its hidden's
    loss_rows = batch * max(1, LOSS_CHUNK_ROWS // batch)
    loss = loss_chunk_bytes(loss_rows, d.draft_vocab_size, H, a)
    # the logit gradients of one lm_head-gradient block (ttt.grad_block_rows: ~4H / a rows in all)
    loss += a * d.draft_vocab_size * min(N, batch * min(window, max(loss_rows // batch, (FP32 * H // a) // batch)))
    attention_grads = a * h * dq + a * h * dv + max(K - 2, 0) * a * kv + FP32 * kv  # dq, d(out), diagonal, step 0
    at_attention = N * attention_grads + attention_block_bytes(batch, h, window + K, a)
    return N * (persistent + pending + before + grad_in) + max(loss, N * after, at_attention)


def estimate_training_memory(
    train: TrainingSettings,
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
    H, V, Vd, A, K = (
        d.hidden_size,
        int(tc["vocab_size"]),
        d.draft_vocab_size,
        num_aux_layers,
        train.kind_settings.ttt_steps,
    )
    T = train.max_seq_len
    N = train.largest_batch_tokens  # activations grow with the padded tokens, however they split into windows
    B = max(1, N // T)
    W = N + B * (K + 2)  # token rows a batch reads (each window reads ttt_steps + 2 past its rows)
    P = trainable_parameters(d)
    h, kvh, dq, dv = _attention_dims(d)

    parts = {
        "parameters": FP32 * P,
        "gradients": FP32 * P,
        "optimizer state": 2 * FP32 * P,
        "frozen embeddings": FP32 * V * H,
    }
    if hidden_layout == "full":
        parts["target lm_head"] = FP32 * (V + Vd) * H
    if on_gpu:
        # autocast's bf16 copies of the weights a (re-run) step uses; fc's only exist while step 0 runs
        parts["bf16 weight copies"] = 2 * (P - A * H * H)
    per_row = 8 + 1 + 1 + (8 * target_topk + FP32 * target_topk if hidden_layout == "compact" else FP32 * H)
    parts["batch"] = N * (FP32 * A * H + 8 + 1) + W * per_row
    # Backward sums each weight's gradients over the steps (one more copy of the largest at a time); the AdamW
    # step that follows, when activations are gone, makes one fp32 temporary per parameter (foreach, on GPUs) or
    # of the largest (CPU: one tensor at a time). The larger of the two moments counts.
    largest = max(d.draft_vocab_size, d.intermediate_size, A * H) * H
    parts["activations"] = activation_bytes(d, K, a, B, T) + FP32 * largest
    optimizer_step = FP32 * (P if on_gpu else largest)
    if optimizer_step > parts["activations"]:  # short windows: the AdamW step is the peak
        parts["AdamW step temporaries beyond the activations"] = optimizer_step - parts["activations"]
    return TrainingMemory(parts=parts, batch_tokens=N, window=T, activation_bytes=a)


def host_batch_bytes(train: TrainingSettings, hidden: int, num_aux_layers: int, hidden_layout: str, topk: int) -> int:
    """Host bytes of the largest batch as data.host_batch reads it (stored dtypes: compact aux in float8 with fp32
    scales per layer, top-k ids as int64 and log-probs fp32; full aux and final states bf16), pinned on a GPU host."""
    N = train.largest_batch_tokens
    B = max(1, N // train.max_seq_len)
    W = N + B * (train.kind_settings.ttt_steps + 2)
    A = num_aux_layers
    if hidden_layout == "compact":
        per_row, per_pos = A * hidden + FP32 * A, 8 * topk + FP32 * topk
    else:
        per_row, per_pos = 2 * A * hidden, 2 * hidden
    # rows: aux, positions, valid, sequence start, row limit; positions of the window: ids, have, gen, targets
    return N * (per_row + 8 + 1 + 8 + 8) + W * (8 + 1 + 1 + per_pos)


def estimate_host_memory(
    train: TrainingSettings,
    text_config: dict,
    draft_vocab_size: int,
    ranks: int,
    *,
    num_aux_layers: int = 3,
    hidden_layout: str = "full",
    target_topk: int = 32,
    head_dtype_bytes: int = 2,
) -> HostMemory:
    """The drafter job's host RAM: every rank first builds its drafter on the host (fp32 parameters and frozen
    embeddings) from the target's heads read in their stored dtype (``head_dtype_bytes``; embed, plus lm_head when
    the shards are ``full`` or the head starts from the target's), then moves it to its GPU; while training each rank
    holds two batches on the host (the one being copied and the one the loader thread reads: data.prefetched).
    The larger of the two moments counts, times the ranks."""
    tc = text_config.get("text_config") or text_config
    d = drafter_shape(train, text_config, draft_vocab_size, num_aux_layers)
    V, H = int(tc["vocab_size"]), d.hidden_size
    heads = 1 + (1 if hidden_layout == "full" or train.kind_settings.init_head_from_target else 0)
    start = FP32 * (trainable_parameters(d) + V * H) + head_dtype_bytes * heads * V * H
    batches = 2 * host_batch_bytes(train, H, num_aux_layers, hidden_layout, target_topk)
    if start >= batches:
        return HostMemory({"drafters built on the host (start)": ranks * start}, ranks)
    return HostMemory({"batches in flight (2 per rank)": ranks * batches}, ranks)
