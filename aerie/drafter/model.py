"""The EAGLE-3 drafter: one Llama decoder layer that reads the target's aux hidden states.

Architecture and names follow SGLang's ``LlamaForCausalLMEagle3``
(sgl-project/sglang ``python/sglang/srt/models/llama_eagle3.py``, read at commit 03d5a777):

    embeds  = embed_tokens(input_ids)                       # target vocab, frozen copy of the target's
    h       = fc(concat(aux layers))                        # first step only: [A*H] -> [H]
    x       = concat(input_layernorm(embeds), hidden_norm(h))   # embeds FIRST, then the hidden: [2H]
    r       = h + self_attn(x)                              # q/k/v read 2H, o_proj writes H; residual is h, un-normed
    out     = r + mlp(post_attention_layernorm(r))          # hidden_out: fed back to the next draft step
    logits  = lm_head(norm(out))                            # draft vocab

Token/position pairing (what the benchmark and training rely on), checked against SGLang's EAGLE worker:

* Draft extend (prefill, and after each verify): SGLang's ``EagleDraftInput.prepare_for_extend`` shifts
  ``input_ids`` left by one and appends the target's newly sampled token, while the forward keeps the
  target's own positions. So row ``t`` pairs the target feature at position ``t`` with token ``t+1`` at
  position id ``t`` and predicts token ``t+2``.
* Draft decode: the hidden state is the previous step's ``hidden_out`` (SGLang returns the pre-norm residual
  sum as ``hidden_states_to_aux``), the token is the previous draft, and the position advances by one per step:
  step ``k`` after row ``t`` uses position ``t+k``. This matches SGLang's overlap worker
  (``eagle_info_v2.prepare_for_v2_draft`` sets positions to ``seq_lens`` = last extend position + 1, and
  ``eagle_worker_v2.draft_forward`` increments after each forward) and the EAGLE reference (``len_posi`` =
  length of the shifted ids). Note: the non-overlap ``eagle_worker.draft_forward`` (commit 00559eac)
  increments *before* each draft forward, i.e. uses ``t+k+1``; RoPE makes that a one-position shift of
  the new query/key relative to the cached keys.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

FORMAT = "aerie.drafter/1"
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
# SGLang's fc is Linear(3 * target_hidden, hidden): a drafter with another number of aux layers trains and
# runs here but will not load there.
SGLANG_NUM_AUX_LAYERS = 3

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocab
    draft_vocab_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        if not self.aux_layer_ids:
            raise ValueError("aux_layer_ids is empty: the drafter needs at least one target layer")
        # SGLang concatenates captured layers in execution order, so the ids must be ascending to line up.
        if any(b <= a for a, b in zip(self.aux_layer_ids, self.aux_layer_ids[1:])):
            raise ValueError(f"aux_layer_ids {self.aux_layer_ids} must be strictly ascending (SGLang's capture order)")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r}: SGLang's LlamaMLP supports only 'silu'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..vocab_size ({self.vocab_size})")

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_layer_ids)

    @classmethod
    def from_target(cls, target_config: Any, draft_vocab_size: int, aux_layer_ids: list[int]) -> "DrafterConfig":
        """Size the drafter like one decoder layer of the target (hidden size must match: embeddings are shared)."""
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        heads = int(tc.num_attention_heads)
        # MLA targets (DeepSeek-V3 / Kimi: kv_lora_rank set) have no plain head_dim; use hidden/heads.
        head_dim = getattr(tc, "head_dim", None)
        if getattr(tc, "kv_lora_rank", None) is not None or not head_dim:
            head_dim = tc.hidden_size // heads
        # transformers 5 keeps rope_theta in rope_parameters; 4.x has it top-level.
        rope_theta = getattr(tc, "rope_theta", None)
        if rope_theta is None:
            rope_theta = (getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(
            hidden_size=int(tc.hidden_size),
            intermediate_size=int(tc.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            vocab_size=int(tc.vocab_size),
            draft_vocab_size=int(draft_vocab_size),
            aux_layer_ids=list(aux_layer_ids),
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", 4096)),
            hidden_act="silu",
        )

    def to_hf_config(self, torch_dtype: str, aerie: dict) -> dict:
        """config.json as SGLang reads it (a LlamaConfig plus draft_vocab_size and eagle_config)."""
        return {
            "architectures": [SGLANG_ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings: SGLang's llama.py reads config.rope_theta, transformers 5 reads rope_parameters.
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            # SGLang ties lm_head to embed_tokens when this is true - wrong for a draft-vocab head.
            "tie_word_embeddings": False,
            "attention_bias": False,
            "torch_dtype": torch_dtype,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids), "use_aux_hidden_state": True},
            "aerie": {"format": FORMAT, **aerie},
        }

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "DrafterConfig":
        aerie = cfg.get("aerie") or {}
        if aerie.get("format") != FORMAT:
            raise ValueError(f"drafter config format {aerie.get('format')!r} is not {FORMAT!r}")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError("only single-layer EAGLE-3 drafters are supported")
        rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"],
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg["draft_vocab_size"],
            aux_layer_ids=cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg["max_position_embeddings"],
            hidden_act=cfg["hidden_act"],
        )


# ----------------------------------------------------------------------------------------------------------
# building blocks


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 (bf16 squares lose too much), scale in the input dtype - as SGLang's RMSNorm.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotary_cos_sin(position_ids: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [B, 1, T, head_dim] for neox-style (rotate-half) RoPE, computed in fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, d]
    return emb.cos(), emb.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """[B, kvh, S, d] -> [B, kvh * n_rep, S, d] (grouped-query attention)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class DrafterKVCache:
    """Inference-time cache of the drafter's single attention layer: roped keys and values, [B, kvh, S, d]."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (drop rejected drafts)."""
        if self.keys is not None:
            self.keys = self.keys[:, :, :length]
            self.values = self.values[:, :, :length]

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Append the new keys; new queries see every cached position and, causally, each other."""
        past = len(self)
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        n_rep = q.shape[1] // k.shape[1]
        new, total = q.shape[2], self.keys.shape[2]
        # query i (absolute past + i) may read key j iff j <= past + i
        mask = torch.arange(total, device=q.device)[None, :] <= (past + torch.arange(new, device=q.device))[:, None]
        return F.scaled_dot_product_attention(q, repeat_kv(self.keys, n_rep), repeat_kv(self.values, n_rep), attn_mask=mask)


class TTTCache:
    """Keys/values of one training-time-test unroll over whole sequences.

    Step 0 runs over all rows with causal attention. Step k >= 1 at row t is the k-th chained draft after a
    prefix ending at row t, so at inference it sees the step-0 keys of rows <= t plus its *own row's* keys
    from steps 1..k (the earlier drafts in its chain) - never other rows' later-step keys. Scores against
    those diagonal keys are one dot product per row, concatenated to the causal block before the softmax.
    """

    def __init__(self) -> None:
        self.keys: list[Tensor] = []  # per step [B, kvh, T, d]
        self.values: list[Tensor] = []

    def __len__(self) -> int:
        return len(self.keys)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.keys.append(k)
        self.values.append(v)
        n_rep = q.shape[1] // k.shape[1]
        T = q.shape[2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        k0, v0 = repeat_kv(self.keys[0], n_rep), repeat_kv(self.values[0], n_rep)
        scores = (q @ k0.transpose(-1, -2)) * scale  # [B, h, T, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        diag_v = [repeat_kv(vj, n_rep) for vj in self.values[1:]]
        diag_s = [(q * repeat_kv(kj, n_rep)).sum(-1, keepdim=True) * scale for kj in self.keys[1:]]  # [B,h,T,1]
        probs = torch.softmax(torch.cat([scores, *diag_s], dim=-1).float(), dim=-1).to(q.dtype)  # [B,h,T,T+k]
        out = probs[..., :T] @ v0
        for j, vj in enumerate(diag_v):
            out = out + probs[..., T + j : T + j + 1] * vj
        return out


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h, kvh, d, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        # q/k/v read [input_layernorm(embeds), hidden_norm(hidden)]: 2H wide (SGLang overrides qkv_proj so).
        self.q_proj = nn.Linear(2 * H, h * d, bias=False)
        self.k_proj = nn.Linear(2 * H, kvh * d, bias=False)
        self.v_proj = nn.Linear(2 * H, kvh * d, bias=False)
        self.o_proj = nn.Linear(h * d, H, bias=False)

    def forward(self, x: Tensor, position_ids: Tensor, cache: DrafterKVCache | TTTCache | None) -> Tensor:
        B, T, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)  # [B, h, T, d]
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)  # [B, kvh, T, d]
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = rotary_cos_sin(position_ids, c.head_dim, c.rope_theta)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:
            n_rep = c.num_attention_heads // c.num_key_value_heads
            out = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)
        else:
            out = cache.attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """SGLang's eagle3 ``LlamaDecoderLayer``: the hidden state is the residual, embeds+hidden feed attention."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # applied to the token embeddings
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # applied to the incoming hidden state
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, hidden: Tensor, embeds: Tensor, position_ids: Tensor, cache) -> Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        residual = hidden + self.self_attn(x, position_ids, cache)
        return residual + self.mlp(self.post_attention_layernorm(residual))  # pre-norm output


# ----------------------------------------------------------------------------------------------------------
# the drafter


def _publish_mode() -> int:
    """0666 minus the process umask (read without changing it); safetensors itself creates files 0600."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    return 0o644


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Write via a temporary file in the same folder, then os.replace (readers never see a partial file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(str(tmp))
        os.chmod(tmp, _publish_mode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_vocab_maps(d2t: Tensor, t2d: Tensor, draft_vocab_size: int, vocab_size: int) -> None:
    """d2t/t2d must describe the same ascending id set (aerie.draft-vocab/1 and SGLang's convention)."""
    if d2t.shape != (draft_vocab_size,) or t2d.shape != (vocab_size,):
        raise ValueError(
            f"vocab maps have shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)}; "
            f"expected ({draft_vocab_size},) and ({vocab_size},)"
        )
    target_ids = torch.arange(draft_vocab_size) + d2t.long().cpu()
    if not torch.equal(target_ids, t2d.bool().cpu().nonzero().flatten()):
        raise ValueError("d2t and t2d disagree: draft_id + d2t[draft_id] must list the t2d ids in ascending order")


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # shared with the target: SGLang swaps in the target's
        self.fc = nn.Linear(cfg.num_aux_layers * H, H, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        # Until real maps are loaded: the draft vocab is the first draft_vocab_size target ids.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    # -- inference / training forward ---------------------------------------------------------------------

    def project_aux(self, aux_hidden_states: Tensor) -> Tensor:
        """[B, T, A*H] target aux states -> [B, T, H] first-step hidden state."""
        return self.fc(aux_hidden_states.to(self.fc.weight.dtype))

    def forward(
        self,
        hidden_states: Tensor,
        input_ids: Tensor,
        position_ids: Tensor,
        cache: DrafterKVCache | TTTCache | None = None,
    ) -> tuple[Tensor, Tensor]:
        """hidden_states [B,T,H], input_ids [B,T] (target ids), position_ids [B,T] -> (logits [B,T,Vd], hidden_out [B,T,H]).

        Without a cache the rows attend causally among themselves. A DrafterKVCache appends this call's
        keys (queries see all cached positions); a TTTCache applies the training-time-test pattern.
        """
        embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)  # [B, T, H]
        hidden_out = self.midlayer(hidden_states, embeds, position_ids, cache)
        logits = self.lm_head(self.norm(hidden_out))
        return logits, hidden_out

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocab ids -> target ids (SGLang: hot_token_id = d2t + arange)."""
        return draft_ids + self.d2t[draft_ids]

    # -- construction -------------------------------------------------------------------------------------

    def set_vocab_maps(self, d2t: Tensor, t2d: Tensor) -> None:
        check_vocab_maps(d2t, t2d, self.cfg.draft_vocab_size, self.cfg.vocab_size)
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())

    @classmethod
    def from_target(
        cls,
        target_model: nn.Module,
        cfg: DrafterConfig,
        d2t: Tensor,
        t2d: Tensor,
        init_head_from_target: bool = True,
    ) -> "Eagle3Drafter":
        """New drafter with the target's embeddings copied and frozen.

        With ``init_head_from_target`` the draft lm_head starts as the target's lm_head rows of the draft
        vocab and the final norm as the target's final norm: the drafter learns to imitate the target's last
        hidden state, so that is a good prior (it stays trainable).
        """
        drafter = cls(cfg)
        embed = target_model.get_input_embeddings().weight
        if tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"target embeddings {tuple(embed.shape)} != ({cfg.vocab_size}, {cfg.hidden_size})")
        drafter.set_vocab_maps(d2t, t2d)
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(embed.detach().float())
            if init_head_from_target:
                head = target_model.get_output_embeddings().weight.detach().float()  # [V, H]
                ids = torch.arange(cfg.draft_vocab_size) + drafter.d2t
                drafter.lm_head.weight.copy_(head[ids])
                final_norm = getattr(getattr(target_model, "model", None), "norm", None)
                weight = getattr(final_norm, "weight", None)
                if weight is not None and weight.shape == drafter.norm.weight.shape:
                    drafter.norm.weight.copy_(weight.detach().float())
        return drafter

    # -- persistence --------------------------------------------------------------------------------------

    def save_pretrained(self, folder: str | Path, extra: dict | None = None, dtype: torch.dtype | None = torch.bfloat16) -> None:
        """Write config.json + model.safetensors that SGLang loads as LlamaForCausalLMEagle3.

        Float weights are stored in ``dtype`` (bf16 by default, what SGLang serves; None keeps their dtype);
        d2t stays int64 and t2d bool. Each file is published atomically; config.json goes last.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, t in self.state_dict().items():
            t = t.detach().cpu()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            tensors[name] = t.contiguous()
        stored = dtype if dtype is not None else self.fc.weight.dtype
        meta = {"format": FORMAT}
        atomic_write(folder / "model.safetensors", lambda p: save_file(tensors, p, metadata=meta))
        config = self.cfg.to_hf_config(_DTYPE_NAMES[stored], dict(extra or {}))
        atomic_write(folder / "config.json", lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> "Eagle3Drafter":
        """Load a drafter folder; float weights are cast to ``dtype`` (fp32 by default, for CPU math)."""
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        cfg = DrafterConfig.from_hf_config(config)
        state = load_file(folder / "model.safetensors")
        drafter = cls(cfg)
        missing = set(drafter.state_dict()) - set(state)
        unexpected = set(state) - set(drafter.state_dict())
        if missing or unexpected:
            raise ValueError(f"{folder}: drafter tensors missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        drafter.load_state_dict(state)
        check_vocab_maps(drafter.d2t, drafter.t2d, cfg.draft_vocab_size, cfg.vocab_size)
        return drafter.to(dtype)
