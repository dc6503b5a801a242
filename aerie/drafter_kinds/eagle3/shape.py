"""The drafter's shape (``DrafterConfig``) and its config.json for SGLang: torch-free, so parse time (the fit
plan, ``aerie.drafter_kinds.eagle3.memory``) sizes the drafter exactly as training builds it.
``aerie.drafter_kinds.eagle3.model`` builds the
modules from it (and re-exports every name here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

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
