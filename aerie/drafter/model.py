"""The EAGLE-3 drafter: one decoder layer that reads the target's aux hidden states.

Architecture and names follow SGLang 0.5.23's ``LlamaForCausalLMEagle3`` (``python/sglang/srt/models/
llama_eagle3.py``; first read at commit 03d5a777) and, for ``attention: mla``, its
``Eagle3DeepseekV2ForCausalLM`` (``models/kimi_k25_eagle3.py``), which differs only in the attention
(see mla_layer.py):

    embeds  = embed_tokens(input_ids)                       # target vocab, the target's (not exported)
    h       = fc(concat(aux layers))                        # first step only: [A*H] -> [H] (fc_norm: per chunk)
    x       = concat(input_layernorm(embeds), hidden_norm(h))   # embeds FIRST, then the hidden: [2H]
    r       = h + self_attn(x)                              # attention reads 2H, writes H; residual is h, un-normed
    out     = r + mlp(post_attention_layernorm(r))          # hidden_out: fed back to the next draft step
    logits  = lm_head(norm(out))                            # draft vocab (norm_output: norm(out) is fed back)

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
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from aerie.artifacts import atomic_publish, write_safetensors
from aerie.drafter.layers import MLP, DrafterKVCache, RMSNorm, TTTCache
from aerie.drafter.llama_layer import LlamaAttention
from aerie.drafter.mla_layer import MLAAttention

FORMAT = "aerie.drafter/2"  # 2: no embed_tokens in the export, attention kind "mla"
READABLE_FORMATS = ("aerie.drafter/1", FORMAT)  # format 1 folders also carry embed_tokens.weight
ATTENTION_KINDS = ("llama", "mla")
# The architecture SGLang 0.5.23 serves for each attention kind (its models/llama_eagle3.py and
# models/kimi_k25_eagle3.py).
SGLANG_ARCHITECTURES = {"llama": "LlamaForCausalLMEagle3", "mla": "Eagle3DeepseekV2ForCausalLM"}
SGLANG_ARCHITECTURE = SGLANG_ARCHITECTURES["llama"]
# The Llama shape an MLA target's drafter gets unless set: the head size and KV-head count GPU attention
# kernels (FlashInfer, FA3) are built for. MLA targets have no plain head_dim to copy.
LLAMA_ON_MLA_HEAD_DIM = 128
LLAMA_ON_MLA_KV_HEADS = 8
# The embeddings are the target's: exports leave them out (SGLang's EAGLE worker swaps in the target's,
# the in-process benchmark passes them to from_pretrained).
EMBED_NAME = "embed_tokens.weight"

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _rope_theta(tc: Any) -> float:
    # transformers 5 keeps rope_theta in rope_parameters; 4.x and raw config.json files have it top-level.
    return float(
        getattr(tc, "rope_theta", None) or (getattr(tc, "rope_parameters", None) or {}).get("rope_theta") or 10000.0
    )


def _yarn_of(tc: Any) -> dict | None:
    """The yarn scaling of an MLA config, None for plain RoPE: transformers 5 keeps it in ``rope_parameters``;
    4.x and raw config.json files (Kimi's) in ``rope_scaling`` (``type`` or ``rope_type``)."""
    params = getattr(tc, "rope_parameters", None) or {}
    scaling = params if params.get("rope_type", "default") != "default" else getattr(tc, "rope_scaling", None)
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ("yarn", "deepseek_yarn"):
        raise ValueError(f"rope scaling {kind!r} is not supported by the MLA drafter (only yarn, as DeepSeek/Kimi)")
    return {"rope_type": "yarn", **{k: scaling[k] for k in _YARN_KEYS if k in scaling}}


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int  # mla: = num_attention_heads (keys are expanded per head from the latent)
    head_dim: int  # mla: qk_nope_head_dim + qk_rope_head_dim
    vocab_size: int  # target vocab
    draft_vocab_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    attention: str = "llama"  # "llama" (GQA) or "mla" (DeepSeek-V2 multi-latent attention, as Kimi's)
    # mla only (the target's values by default)
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_scaling: dict | None = None  # yarn parameters (DeepSeek style), None for plain RoPE
    rope_interleave: bool = True  # DeepSeek's rotary pairs are interleaved (SGLang: is_neox_style False)
    # EAGLE-3.1 options both SGLang classes read
    fc_norm: bool = False  # one RMSNorm per aux chunk before fc
    norm_output: bool = False  # the next draft step reads the post-norm hidden state

    def __post_init__(self) -> None:
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        if len(self.aux_layer_ids) < 2:
            raise ValueError(
                f"aux_layer_ids {self.aux_layer_ids}: an EAGLE-3 drafter needs at least two target layers. SGLang "
                "skips fc when the captured width equals the hidden width (one layer), so a one-layer drafter "
                "would be served with unprojected features it was never trained on; use two or more (SGLang's "
                "default is three)"
            )
        # SGLang concatenates captured layers in execution order, so the ids must be ascending to line up.
        if any(b <= a for a, b in zip(self.aux_layer_ids, self.aux_layer_ids[1:])):
            raise ValueError(f"aux_layer_ids {self.aux_layer_ids} must be strictly ascending (SGLang's capture order)")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r}: SGLang's LlamaMLP supports only 'silu'")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"drafter attention {self.attention!r} is not one of {list(ATTENTION_KINDS)}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..vocab_size ({self.vocab_size})")
        if self.attention == "mla":
            dims = {
                k: getattr(self, k)
                for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            }
            unset = [k for k, v in dims.items() if not v]
            if unset:
                # SGLang's Eagle3 MLA layer raises without q_lora_rank; the others size the projections.
                raise ValueError(
                    f"attention 'mla' needs {unset} (q_lora_rank too: SGLang's Eagle3 MLA layer has no q_proj path)"
                )
            if self.qk_rope_head_dim % 2:
                raise ValueError("qk_rope_head_dim must be even for rotary embeddings")
            return
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_layer_ids)

    def serving_kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """Bytes SGLang's KV cache holds per token for this drafter's one layer (bf16 by default).

        MLA caches the compressed latent and the shared rope key (kv_lora_rank + qk_rope_head_dim values, one
        "head"); Llama attention caches a key and a value per KV head. aerie's in-process caches expand MLA per
        head (see mla_layer.py), so this is the serving figure, not theirs.
        """
        if self.attention == "mla":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * bytes_per_value
        return 2 * self.num_key_value_heads * self.head_dim * bytes_per_value

    @property
    def sglang_architecture(self) -> str:
        return SGLANG_ARCHITECTURES[self.attention]

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        draft_vocab_size: int,
        aux_layer_ids: list[int],
        *,
        attention: str = "auto",
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
        fc_norm: bool = False,
        norm_output: bool = False,
    ) -> DrafterConfig:
        """Size the drafter like one decoder layer of the target (hidden size must match: embeddings are shared).

        ``target_config``: a transformers config or a namespace of the text config's fields.
        ``attention``: "auto" is "mla" for an MLA target (``kv_lora_rank`` set: DeepSeek-V3, Kimi) and "llama"
        otherwise. A Llama drafter of an MLA target gets head_dim 128 and 8 KV heads (fewer when the head count
        is not a multiple of 8) unless set: shapes the serving kernels take; the target's head count is kept
        (64 for Kimi). None everywhere: derived from the target.
        """
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        is_mla = getattr(tc, "kv_lora_rank", None) is not None
        kind = ("mla" if is_mla else "llama") if attention == "auto" else attention
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"drafter attention {attention!r} is not one of ['auto', {', '.join(ATTENTION_KINDS)}]")
        heads = int(num_attention_heads or tc.num_attention_heads)
        common = dict(
            hidden_size=int(tc.hidden_size),
            intermediate_size=int(intermediate_size or tc.intermediate_size),
            num_attention_heads=heads,
            vocab_size=int(tc.vocab_size),
            draft_vocab_size=int(draft_vocab_size),
            aux_layer_ids=list(aux_layer_ids),
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(tc),
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", 4096)),
            hidden_act="silu",
            attention=kind,
            fc_norm=bool(fc_norm),
            norm_output=bool(norm_output),
        )
        if kind == "mla":
            if not is_mla:
                raise ValueError(
                    "drafter attention 'mla' needs an MLA target (kv_lora_rank in its config); use 'llama'"
                )
            if num_key_value_heads is not None or head_dim is not None:
                raise ValueError(
                    "num_key_value_heads and head_dim are Llama-attention settings; an MLA drafter "
                    "takes its head sizes from the target (qk_nope/qk_rope/v_head_dim)"
                )
            nope, rope = int(tc.qk_nope_head_dim), int(tc.qk_rope_head_dim)
            return cls(
                **common,
                num_key_value_heads=heads,
                head_dim=nope + rope,
                q_lora_rank=getattr(tc, "q_lora_rank", None),
                kv_lora_rank=int(tc.kv_lora_rank),
                qk_nope_head_dim=nope,
                qk_rope_head_dim=rope,
                v_head_dim=int(tc.v_head_dim),
                rope_scaling=_yarn_of(tc),
                rope_interleave=bool(getattr(tc, "rope_interleave", True)),
            )
        if is_mla:
            # MLA targets (DeepSeek-V3 / Kimi) have no plain head_dim and keep 64 KV heads in their config.
            head_dim = head_dim or LLAMA_ON_MLA_HEAD_DIM
            # 8 KV heads, or the largest count below that divides the heads (grouped-query attention needs it)
            num_key_value_heads = num_key_value_heads or math.gcd(heads, LLAMA_ON_MLA_KV_HEADS)
        else:
            head_dim = head_dim or getattr(tc, "head_dim", None) or tc.hidden_size // int(tc.num_attention_heads)
            num_key_value_heads = num_key_value_heads or getattr(tc, "num_key_value_heads", None) or heads
        # The Llama drafter uses plain RoPE at the target's theta (SGLang's llama_eagle3 gets no yarn from us).
        return cls(**common, num_key_value_heads=int(num_key_value_heads), head_dim=int(head_dim))

    def to_hf_config(self, torch_dtype: str, aerie: dict) -> dict:
        """config.json as SGLang reads it: a LlamaConfig (llama) or DeepseekV3Config (mla) plus draft_vocab_size
        and eagle_config."""
        common = {
            "architectures": [self.sglang_architecture],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
        }
        if self.attention == "llama":
            kind = {"model_type": "llama", **common, "head_dim": self.head_dim}
            rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        else:
            kind = {
                "model_type": "deepseek_v3",  # transformers parses it as a DeepseekV3Config (SGLang's loader too)
                **common,
                "q_lora_rank": self.q_lora_rank,
                "kv_lora_rank": self.kv_lora_rank,
                "qk_nope_head_dim": self.qk_nope_head_dim,
                "qk_rope_head_dim": self.qk_rope_head_dim,
                "v_head_dim": self.v_head_dim,
                "rope_interleave": self.rope_interleave,
            }
            rope_parameters = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
            if self.rope_scaling:  # 4.x spelling as well (SGLang falls back to it without rope_parameters)
                kind["rope_scaling"] = {"type": "yarn", **self.rope_scaling}
        return {
            **kind,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings: SGLang's llama.py reads config.rope_theta, transformers 5 reads rope_parameters.
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            # SGLang ties lm_head to embed_tokens when this is true - wrong for a draft-vocab head.
            "tie_word_embeddings": False,
            "attention_bias": False,
            "torch_dtype": torch_dtype,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "use_aux_hidden_state": True,
            },
            # EAGLE-3.1 flags, written only when set (both SGLang classes default them to false)
            **({"fc_norm": True} if self.fc_norm else {}),
            **({"norm_output": True} if self.norm_output else {}),
            "aerie": {"format": FORMAT, **aerie},
        }

    @classmethod
    def from_hf_config(cls, cfg: dict) -> DrafterConfig:
        aerie = cfg.get("aerie") or {}
        if aerie.get("format") not in READABLE_FORMATS:
            raise ValueError(f"drafter config format {aerie.get('format')!r} is not one of {list(READABLE_FORMATS)}")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError("only single-layer EAGLE-3 drafters are supported")
        kinds = {arch: kind for kind, arch in SGLANG_ARCHITECTURES.items()}
        arch = (cfg.get("architectures") or [SGLANG_ARCHITECTURE])[0]
        if arch not in kinds:
            raise ValueError(f"drafter architecture {arch!r} is not one of {sorted(kinds)}")
        rope = SimpleNamespace(**{k: cfg.get(k) for k in ("rope_theta", "rope_parameters", "rope_scaling")})
        mla = {}
        if kinds[arch] == "mla":
            mla = {
                k: cfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            }
            mla.update(rope_scaling=_yarn_of(rope), rope_interleave=bool(cfg.get("rope_interleave", True)))
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg["draft_vocab_size"],
            aux_layer_ids=cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=_rope_theta(rope),
            max_position_embeddings=cfg["max_position_embeddings"],
            hidden_act=cfg["hidden_act"],
            attention=kinds[arch],
            fc_norm=bool(cfg.get("fc_norm", False)),
            norm_output=bool(cfg.get("norm_output", False)),
            **mla,
        )


class MidLayer(nn.Module):
    """SGLang's eagle3 decoder layer (``LlamaDecoderLayer`` in llama_eagle3.py, ``Eagle3MLADecoderLayer`` in
    kimi_k25_eagle3.py): the hidden state is the residual, embeds+hidden feed attention. Only the attention
    differs between the two kinds; SGLang's DeepseekV2MLP has the same gate/up/down SwiGLU as LlamaMLP."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # applied to the token embeddings
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # applied to the incoming hidden state
        self.self_attn: nn.Module = MLAAttention(cfg) if cfg.attention == "mla" else LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, hidden: Tensor, embeds: Tensor, position_ids: Tensor, cache) -> Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        residual = hidden + self.self_attn(x, position_ids, cache)
        return residual + self.mlp(self.post_attention_layernorm(residual))  # pre-norm output


# ----------------------------------------------------------------------------------------------------------
# the drafter


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
    """The EAGLE-3 drafter of either attention kind (``cfg.attention``); one API for training and the benchmark."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # shared with the target: SGLang swaps in the target's
        # True only for a drafter loaded from an export (which has no embeddings) until the target's are set.
        self.embeddings_missing = False
        self.fc = nn.Linear(cfg.num_aux_layers * H, H, bias=False)
        # EAGLE-3.1 fc_norm: each aux chunk normalised on its own before fc (SGLang: model.fc_norm.{i}).
        self.fc_norm = (
            nn.ModuleList(RMSNorm(H, cfg.rms_norm_eps) for _ in range(cfg.num_aux_layers)) if cfg.fc_norm else None
        )
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
        aux = aux_hidden_states.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            chunks = aux.chunk(self.cfg.num_aux_layers, dim=-1)  # [B, T, H] each, in aux_layer_ids order
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def forward(
        self,
        hidden_states: Tensor,
        input_ids: Tensor,
        position_ids: Tensor,
        cache: DrafterKVCache | TTTCache | None = None,
    ) -> tuple[Tensor, Tensor]:
        """hidden_states [B,T,H], input_ids [B,T] (target ids), position_ids [B,T] -> (logits [B,T,Vd],
        hidden_out [B,T,H]).

        Without a cache the rows attend causally among themselves. A DrafterKVCache appends this call's
        keys (queries see all cached positions); a TTTCache applies the training-time-test pattern.
        """
        if self.embeddings_missing:
            raise RuntimeError(
                "this drafter was loaded from an export without embed_tokens (they are the target's): call "
                "load_target_embeddings(target.get_input_embeddings().weight) or pass embed_tokens= to from_pretrained"
            )
        embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)  # [B, T, H]
        hidden_out = self.midlayer(hidden_states, embeds, position_ids, cache)
        normed = self.norm(hidden_out)
        logits = self.lm_head(normed)
        # SGLang returns the pre-norm sum as the next step's hidden state unless norm_output (EAGLE-3.1) is set.
        return logits, normed if self.cfg.norm_output else hidden_out

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocab ids -> target ids (SGLang: hot_token_id = d2t + arange)."""
        return draft_ids + self.d2t[draft_ids]

    # -- construction -------------------------------------------------------------------------------------

    def load_target_embeddings(self, embed: Tensor) -> None:
        """Copy in the target's input embeddings [V, H] (exports leave them out: they are the target's)."""
        if tuple(embed.shape) != (self.cfg.vocab_size, self.cfg.hidden_size):
            raise ValueError(
                f"target embeddings {tuple(embed.shape)} != ({self.cfg.vocab_size}, {self.cfg.hidden_size}) "
                "of the drafter: it was built for another target"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed.detach())
        self.embeddings_missing = False

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
    ) -> Eagle3Drafter:
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
        drafter.load_target_embeddings(embed.detach().float())
        with torch.no_grad():
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

    def save_pretrained(
        self, folder: str | Path, extra: dict | None = None, dtype: torch.dtype | None = torch.bfloat16
    ) -> None:
        """Write config.json + model.safetensors that SGLang loads (LlamaForCausalLMEagle3 or
        Eagle3DeepseekV2ForCausalLM, by ``cfg.attention``).

        The frozen embeddings are left out: SGLang's EAGLE worker replaces them with the target's after loading
        and the benchmark passes the target's to from_pretrained. Float weights are stored in ``dtype`` (bf16 by
        default, what SGLang serves; None keeps their dtype); d2t stays int64 and t2d bool. Each file is
        published atomically; config.json goes last.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, t in self.state_dict().items():
            if name == EMBED_NAME:
                continue
            t = t.detach().cpu()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            tensors[name] = t.contiguous()
        stored = dtype if dtype is not None else self.fc.weight.dtype
        meta = {"format": FORMAT}
        atomic_publish(folder / "model.safetensors", lambda p: write_safetensors(p, tensors, meta))
        config = self.cfg.to_hf_config(_DTYPE_NAMES[stored], dict(extra or {}))
        atomic_publish(folder / "config.json", lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))

    @classmethod
    def from_pretrained(
        cls, folder: str | Path, dtype: torch.dtype = torch.float32, embed_tokens: Tensor | None = None
    ) -> Eagle3Drafter:
        """Load a drafter folder; float weights are cast to ``dtype`` (fp32 by default, for CPU math).

        ``embed_tokens``: the target's input embeddings [V, H]. Exports do not carry them (format 1 folders
        did); without them the drafter loads but refuses to run until ``load_target_embeddings``.
        """
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        cfg = DrafterConfig.from_hf_config(config)
        state = load_file(folder / "model.safetensors")
        drafter = cls(cfg)
        wanted = set(drafter.state_dict()) - {EMBED_NAME}
        missing = wanted - set(state)
        unexpected = set(state) - wanted - {EMBED_NAME}
        if missing or unexpected:
            raise ValueError(f"{folder}: drafter tensors missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        drafter.load_state_dict(state, strict=False)
        check_vocab_maps(drafter.d2t, drafter.t2d, cfg.draft_vocab_size, cfg.vocab_size)
        if embed_tokens is not None:
            drafter.load_target_embeddings(embed_tokens.float())
        else:
            drafter.embeddings_missing = EMBED_NAME not in state
        return drafter.to(dtype)
