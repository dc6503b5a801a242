"""The DFlash drafter's shape, its SGLang config.json and server flags, and its size/memory/time estimates:
torch-free, so parse time (the fit plan, the time preview) sizes the drafter exactly as training builds it.

What SGLang 0.5.23 serves as ``DFlashDraftModel`` (python/sglang/srt/models/dflash.py): a stack of Qwen3-style
decoder layers (GQA with a per-head RMSNorm on q and k, SwiGLU MLP) over the embeddings of a block
``[last verified token, MASK x (B-1)]``, with the target's features written into every layer's keys and values:
``ctx = hidden_norm(fc(concat of K target layers' outputs))`` projected by each layer's own k/v projections. It has
no embedding and no lm_head: the target's embed the block and project the drafts over the full vocabulary.

Target layer ids (``dflash_config.target_layer_ids``): 0-based decoder layers whose OUTPUT the draft reads, the
same convention as aerie's capture (id i = the output of decoder layer i = transformers'
``output_hidden_states[i + 1]``). SGLang captures "before layer id+1": every target that serves DFLASH in 0.5.23
(``set_dflash_layers_to_capture`` in models/llama.py, qwen3.py, qwen3_moe.py, deepseek_v2.py - which Kimi K2.5's
kimi_k25.py delegates to) stores ``layers_to_capture = [id + 1 ...]`` and captures the residual stream entering
that layer, i.e. the output of layer id. Unlike EAGLE-3 on DeepSeek there is no "+1 only when the first id is 1"
rule. The capture happens inside the layer loop, so the last layer's output (id = depth - 1) is never captured;
the captured features are concatenated in layer order, so the ids must ascend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

FORMAT = "aerie.dflash/1"
READABLE_FORMATS = (FORMAT,)
SGLANG_ARCHITECTURE = "DFlashDraftModel"
SGLANG_MODEL_TYPE = "qwen3"  # transformers parses the config as a Qwen3Config (layer_types, sliding_window, q/k norm)
LAYER_TYPES = ("full_attention", "sliding_attention")
# The head shape a drafter of an MLA target (DeepSeek-V3, Kimi: no plain head_dim) gets unless set, as z-lab's
# Kimi-K2.5-DFlash: 128-wide heads, 8 KV heads (the shapes GPU attention kernels are built for).
MLA_TARGET_HEAD_DIM = 128
MLA_TARGET_KV_HEADS = 8
# The rotary keys SGLang 0.5.23's get_rope reads for "yarn" (layers/rotary_embedding/factory.py).
YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attn_factor",
    "extrapolation_factor",
    "truncate",
)
# Targets whose SGLang 0.5.23 set_dflash_layers_to_capture maps id -> the input of layer id + 1 (the output of layer
# id, aerie's convention), read in models/{llama,mistral,qwen3,qwen3_moe,deepseek_v2,kimi_k25}.py. Qwen2ForCausalLM
# has no such method in 0.5.23: SGLang refuses DFLASH on it.
SGLANG_DFLASH_TARGETS = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "KimiK25ForConditionalGeneration",
)
# The DFlash paper's loss-decay settings (Eq. 4): gamma per block size (NVIDIA Model-Optimizer quotes them as
# "7 for block_size=16, 5 for 10, 4 for 8"; SpecForge 0.2.0 leaves gamma unset by default).
PAPER_LOSS_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def config_value(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def text_config_of(config: Any) -> Any:
    """The language model's config of a transformers config, a config.json dict or a namespace (a multimodal
    wrapper's ``text_config``, as Kimi K2.5's)."""
    if hasattr(config, "get_text_config"):
        return config.get_text_config()
    inner = config_value(config, "text_config")
    return inner if inner is not None else config


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SGLang 0.5.23's default target layers (speculative/dflash_utils.py build_target_layer_ids): the middle layer
    for a one-layer draft, else ``num_draft_layers`` points spread evenly over layers 1..depth-3, rounded with
    Python's round (half to even). 61 target layers, 6 draft layers: [1, 12, 24, 35, 47, 58]."""
    if num_target_layers <= 0 or num_draft_layers <= 0:
        raise ValueError(f"need positive layer counts, got target {num_target_layers}, draft {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    if last < first:
        raise ValueError(f"SGLang's default target layers need a target of >= 4 layers, got {num_target_layers}")
    span = last - first
    return [int(round(first + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def default_loss_gamma(block_size: int) -> float:
    """The loss decay gamma (weight exp(-(k-1)/gamma) on block slot k) for a block size: the paper's settings at
    8, 10 and 16, linear between them, and beyond them the nearest segment's slope (never below 1)."""
    points = sorted(PAPER_LOSS_GAMMA.items())
    if block_size in PAPER_LOSS_GAMMA:
        return PAPER_LOSS_GAMMA[block_size]
    segments = list(zip(points, points[1:]))
    (x0, y0), (x1, y1) = next(
        (s for s in segments if s[0][0] <= block_size <= s[1][0]),
        segments[0] if block_size < points[0][0] else segments[-1],
    )
    return max(1.0, y0 + (block_size - x0) * (y1 - y0) / (x1 - x0))


def rope_scaling_of(scaling: Mapping[str, Any] | None, where: str = "drafter.rope_scaling") -> dict | None:
    """A rope_scaling / rope_parameters dict as the draft uses it: None for plain RoPE, else the YaRN keys SGLang
    reads. Any other scaling is refused (aerie's rotary implements plain and YaRN, as SGLang computes them)."""
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ("yarn", "deepseek_yarn"):
        raise ValueError(f"{where} type {kind!r}: the DFlash drafter implements plain RoPE and YaRN only")
    missing = [k for k in ("factor", "original_max_position_embeddings") if scaling.get(k) is None]
    if missing:
        raise ValueError(f"{where} (yarn) has no {missing}")
    return {"rope_type": "yarn", **{k: scaling[k] for k in YARN_KEYS if scaling.get(k) is not None}}


def _rope_of(config: Any) -> tuple[float, dict | None]:
    """(rope_theta, yarn scaling or None) of a config as SGLang's get_rope_config reads it: rope_parameters
    (transformers 5) when set, else the 4.x rope_theta / rope_scaling."""
    params = config_value(config, "rope_parameters")
    if params:
        theta = params.get("rope_theta", config_value(config, "rope_theta", 10000.0))
        return float(theta), rope_scaling_of(params)
    return float(config_value(config, "rope_theta") or 10000.0), rope_scaling_of(config_value(config, "rope_scaling"))


@dataclass(frozen=True)
class DFlashShape:
    """Everything SGLang 0.5.23's config.json for ``DFlashDraftModel`` carries. Sequences are stored as tuples."""

    hidden_size: int  # = the target's (the block is embedded with the target's embeddings)
    num_hidden_layers: int  # the draft's decoder layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's: lm_head rows, the mask id's range
    num_target_layers: int  # the target's depth
    target_layer_ids: tuple[int, ...]  # aerie's convention: the outputs of these target layers, ascending
    block_size: int  # B: one anchor + B-1 drafts; SGLang's verify window
    mask_token_id: int
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None: plain RoPE; else YaRN keys (rope_scaling_of)
    layer_types: tuple[str, ...] = ()  # per draft layer; () = all full_attention
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included (HF convention)

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen: normalise once
        fix("target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        fix("layer_types", tuple(self.layer_types) or ("full_attention",) * int(self.num_hidden_layers))
        fix("rope_scaling", rope_scaling_of(self.rope_scaling))
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"drafter.{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(
                f"drafter.block_size must be >= 2, got {self.block_size}: slot 0 is the last verified token, "
                "slots 1..B-1 are the drafts"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"drafter.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"drafter.num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"drafter.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"drafter.hidden_act {self.hidden_act!r}: the DFlash drafter's MLP is SwiGLU (silu)")
        if self.attention_bias:
            raise ValueError("drafter.attention_bias: the DFlash drafter has no biases (SGLang would load them)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"drafter.mask_token_id {self.mask_token_id} is outside the target vocab 0..{self.vocab_size - 1} "
                "(SGLang refuses it: it cannot resize the target's embeddings)"
            )
        self._check_target_layers()
        self._check_layer_types()

    def _check_target_layers(self) -> None:
        ids, depth = self.target_layer_ids, self.num_target_layers
        if not ids:
            raise ValueError("drafter.target_layer_ids is empty: the draft reads at least one target layer")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise ValueError(
                f"drafter.target_layer_ids {list(ids)} must be strictly ascending: SGLang concatenates the captured "
                "layers in the order the forward reaches them"
            )
        if ids[0] < 0 or ids[-1] >= depth - 1:
            raise ValueError(
                f"drafter.target_layer_ids {list(ids)} must lie in 0..{depth - 2} for a target of {depth} layers: "
                "SGLang captures layer i's output at the input of layer i+1, so the last layer's is never captured"
            )

    def _check_layer_types(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"drafter.layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} draft layers"
            )
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"drafter.layer_types {bad}: each must be one of {list(LAYER_TYPES)}")
        if self.has_sliding_layers and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(
                f"drafter.sliding_window must be >= 1 with sliding_attention layers, got {self.sliding_window}"
            )

    # -- derived -------------------------------------------------------------------------------------------------

    @property
    def num_context_features(self) -> int:
        """K: target layers concatenated per token (fc reads K * hidden_size)."""
        return len(self.target_layer_ids)

    @property
    def has_sliding_layers(self) -> bool:
        return "sliding_attention" in self.layer_types

    @property
    def all_sliding(self) -> bool:
        return all(t == "sliding_attention" for t in self.layer_types)

    def window_of(self, layer_type: str) -> int | None:
        """Keys (itself included) a query of that layer type sees; None: unbounded."""
        return self.sliding_window if layer_type == "sliding_attention" else None

    # -- construction --------------------------------------------------------------------------------------------

    @classmethod
    def from_target(
        cls,
        target_text_config: Any,
        *,
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        target_layer_ids: Sequence[int] | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
        sliding_window: int | None = None,
        layer_types: Sequence[str] | None = None,
        rope_scaling: Mapping[str, Any] | str | None = "target",
        max_position_embeddings: int | None = None,
    ) -> DFlashShape:
        """The drafter of a target, sized as the peers do (z-lab's drafters; SpecForge's config generator):

        - hidden size, vocab, depth, rms_norm_eps and max_position_embeddings are the target's; the heads and the
          MLP width too unless set (the target's ``intermediate_size`` is its dense layers' width: 18432 for Kimi);
        - head_dim and KV heads: the target's; for an MLA target (``kv_lora_rank`` set: DeepSeek-V3, Kimi), which
          has no plain head_dim, 128 and 8 KV heads (fewer when the heads are not a multiple of 8), as z-lab's
          Kimi-K2.5-DFlash;
        - rope: the target's theta and, with ``rope_scaling="target"``, the target's YaRN scaling as SGLang reads
          config.json (rope_parameters, else rope_scaling); None for plain RoPE, or a dict;
        - target_layer_ids: SGLang 0.5.23's default for (target depth, draft layers);
        - layer_types: all full_attention, or all sliding_attention when ``sliding_window`` is set.
        """
        tc = text_config_of(target_text_config)
        heads = int(num_attention_heads or config_value(tc, "num_attention_heads"))
        depth = int(config_value(tc, "num_hidden_layers"))
        if config_value(tc, "kv_lora_rank") is not None:  # MLA: no head_dim to copy; the KV heads in its config are 64
            head_dim = head_dim or MLA_TARGET_HEAD_DIM
            num_key_value_heads = num_key_value_heads or math.gcd(heads, MLA_TARGET_KV_HEADS)
        else:
            head_dim = head_dim or config_value(tc, "head_dim") or int(config_value(tc, "hidden_size")) // heads
            num_key_value_heads = num_key_value_heads or config_value(tc, "num_key_value_heads") or heads
        theta, target_scaling = _rope_of(tc)
        scaling = target_scaling if rope_scaling == "target" else rope_scaling
        if layer_types is None:
            layer_types = ("sliding_attention" if sliding_window else "full_attention",) * int(num_layers)
        return cls(
            hidden_size=int(config_value(tc, "hidden_size")),
            num_hidden_layers=int(num_layers),
            num_attention_heads=heads,
            num_key_value_heads=int(num_key_value_heads),
            head_dim=int(head_dim),
            intermediate_size=int(intermediate_size or config_value(tc, "intermediate_size")),
            vocab_size=int(config_value(tc, "vocab_size")),
            num_target_layers=depth,
            target_layer_ids=tuple(target_layer_ids or default_target_layer_ids(depth, int(num_layers))),
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            rms_norm_eps=float(config_value(tc, "rms_norm_eps") or 1e-6),
            max_position_embeddings=int(
                max_position_embeddings or config_value(tc, "max_position_embeddings") or 32768
            ),
            rope_theta=theta,
            rope_scaling=dict(scaling) if scaling else None,
            layer_types=tuple(layer_types),
            sliding_window=sliding_window,
        )

    # -- SGLang's config.json ------------------------------------------------------------------------------------

    def to_sglang_config(self, torch_dtype: str, facts: Mapping[str, Any]) -> dict:
        """config.json as SGLang 0.5.23 reads it (through transformers' Qwen3Config): the Qwen3 layer keys,
        ``layer_types`` with ``use_sliding_window`` (Qwen3Config drops ``sliding_window`` without it, and SGLang
        then refuses the sliding layers), ``block_size`` and ``num_target_layers`` top-level, ``dflash_config``
        with the mask id and target layers, rope both as ``rope_parameters`` (transformers 5) and
        ``rope_theta``/``rope_scaling`` (4.x), and an ``aerie`` block with ``facts``."""
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        return {
            "architectures": [SGLANG_ARCHITECTURE],
            "model_type": SGLANG_MODEL_TYPE,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            **({"rope_scaling": {"type": "yarn", **self.rope_scaling}} if self.rope_scaling else {}),
            "layer_types": list(self.layer_types),
            "use_sliding_window": self.has_sliding_layers,
            "sliding_window": self.sliding_window if self.has_sliding_layers else None,
            "max_window_layers": self.num_hidden_layers,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "torch_dtype": torch_dtype,
            "aerie": {"format": FORMAT, **facts},
        }

    @classmethod
    def from_sglang_config(
        cls, cfg: Mapping[str, Any], *, vocab_size: int | None = None, num_target_layers: int | None = None
    ) -> DFlashShape:
        """The shape of a folder's config.json written by aerie or another tool, read as SGLang 0.5.23 does:
        ``dflash_config`` keys, else the top-level fallback (mask_token_id, target_layer_ids, block_size,
        num_target_layers); ``layer_types`` absent -> Qwen3Config's rule (sliding from ``max_window_layers`` on
        when ``use_sliding_window``); ``sliding_window`` only with ``use_sliding_window``. ``vocab_size`` /
        ``num_target_layers``: the target's, where the config lacks them (SGLang uses the target's own); with
        no ``target_layer_ids`` the ids are SGLang's default for the target's depth."""
        nested = cfg.get("dflash_config") or {}
        pick = lambda key: nested.get(key, cfg.get(key))  # noqa: E731 - SGLang: nested first, then top-level
        aerie = cfg.get("aerie") or {}
        if aerie and aerie.get("format") not in READABLE_FORMATS:
            raise ValueError(f"config.json aerie.format {aerie.get('format')!r} is not one of {list(READABLE_FORMATS)}")
        mask = pick("mask_token_id")
        if mask is None:
            raise ValueError(
                "config.json names no dflash_config.mask_token_id: SGLang would resolve dflash_config.mask_token "
                "('<|MASK|>' by default) through the tokenizer, adding it when absent; set the id explicitly"
            )
        depth = pick("num_target_layers") or num_target_layers
        if depth is None:
            raise ValueError("config.json has no num_target_layers and the target's depth was not given")
        layers = int(cfg["num_hidden_layers"])
        ids = pick("target_layer_ids")
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        types = cfg.get("layer_types")
        if types is None:  # transformers' Qwen3Config fills it so
            first = int(cfg.get("max_window_layers", 28))
            types = [
                "sliding_attention" if sliding is not None and i >= first else "full_attention" for i in range(layers)
            ]
        theta, scaling = _rope_of(cfg)
        heads = int(cfg["num_attention_heads"])
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg.get("vocab_size") or vocab_size),
            num_target_layers=int(depth),
            target_layer_ids=tuple(ids if ids is not None else default_target_layer_ids(int(depth), layers)),
            block_size=int(pick("block_size") or 16),  # SGLang's default when the config names none
            mask_token_id=int(mask),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            rope_theta=theta,
            rope_scaling=scaling,
            layer_types=tuple(types),
            sliding_window=int(sliding) if sliding is not None else None,
        )

    def as_dict(self) -> dict:
        return asdict(self)


# ---- the layers to capture, and SGLang's flags ---------------------------------------------------------------------


def capture_layer_ids(shape: DFlashShape, target_architecture: str) -> list[int]:
    """The target decoder layers (aerie's convention: id i = the output of layer i) whose outputs the drafter
    reads, in the order fc concatenates them. For every target SGLang 0.5.23 serves DFLASH on, that is
    ``target_layer_ids`` itself (see the module docstring); other architectures are refused, since SGLang's
    mapping for them was not read."""
    if target_architecture not in SGLANG_DFLASH_TARGETS:
        raise ValueError(
            f"target architecture {target_architecture!r}: SGLang 0.5.23's DFLASH capture was verified for "
            f"{', '.join(SGLANG_DFLASH_TARGETS)} (each captures the output of layer id at the input of id+1)"
        )
    return list(shape.target_layer_ids)


def sglang_flags(
    folder: str, shape: DFlashShape, *, num_draft_tokens: int | None = None, draft_window_size: int | None = None
) -> list[str]:
    """SGLang 0.5.23's server flags to serve the drafter in ``folder`` (names from srt/arg_groups/fields/spec.py,
    where server_args.py's fields now live: the flag is ``--`` + the field name with ``-`` for ``_``).

    ``--speculative-num-draft-tokens`` is the verify window (SGLang defaults it to the folder's block_size; it is
    written out so the command says what runs); fewer than block_size is allowed (SGLang runs a shorter block than
    the drafter was trained on), more is refused. ``--speculative-draft-window-size`` keeps only the last W
    committed tokens in the draft's KV cache (every layer): given only when every draft layer slides, where it
    defaults to sliding_window and cannot cut what a layer attends to. ``--speculative-dflash-draft-window-size``
    (in z-lab's card) is no 0.5.23 flag."""
    tokens = int(num_draft_tokens or shape.block_size)
    if not 2 <= tokens <= shape.block_size:
        raise ValueError(
            f"speculative num_draft_tokens {tokens} must be in 2..{shape.block_size} (the drafter's block_size): "
            "slots past the block were never trained"
        )
    flags = [
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        str(folder),
        "--speculative-num-draft-tokens",
        str(tokens),
    ]
    if draft_window_size is not None and not shape.all_sliding:
        raise ValueError(
            "speculative draft_window_size: the drafter has full_attention layers, trained on the whole context; "
            "SGLang's --speculative-draft-window-size would cut it for every layer"
        )
    if shape.all_sliding:
        window = int(draft_window_size or shape.sliding_window)
        if window < max(tokens, shape.sliding_window):
            raise ValueError(
                f"speculative draft_window_size {window} must be >= the layers' sliding_window "
                f"{shape.sliding_window} and >= num_draft_tokens {tokens} (SGLang refuses a window below the block)"
            )
        flags += ["--speculative-draft-window-size", str(window)]
    return flags


# ---- sizes, memory, time -------------------------------------------------------------------------------------------


def parameter_count(shape: DFlashShape) -> int:
    """Trainable parameters (all of them: the embeddings and lm_head are the target's, not the drafter's)."""
    H, h, kv, d, I = (  # noqa: E741
        shape.hidden_size,
        shape.num_attention_heads,
        shape.num_key_value_heads,
        shape.head_dim,
        shape.intermediate_size,
    )
    attention = H * h * d + 2 * H * kv * d + h * d * H + 2 * d  # q, k, v, o; q_norm, k_norm
    layer = attention + 3 * H * I + 2 * H  # MLP; input and post-attention norms
    return shape.num_hidden_layers * layer + shape.num_context_features * H * H + 2 * H  # fc; hidden_norm, norm


def serving_kv_bytes_per_token(shape: DFlashShape, bytes_per_value: int = 2) -> int:
    """Bytes SGLang's draft KV pool holds per token (bf16 by default): a key and a value per KV head per draft
    layer (speculative/dflash_utils.py dflash_draft_cell_size_per_token). Kimi's drafter: 24576."""
    return 2 * shape.num_key_value_heads * shape.head_dim * shape.num_hidden_layers * bytes_per_value


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes one training step holds on its GPU, by what they are (see ``training_memory``)."""

    weights: int  # fp32 master weights
    gradients: int  # fp32
    optimizer: int  # AdamW exp_avg + exp_avg_sq, fp32
    frozen_target: int  # the target's embedding matrix and lm_head, in the compute dtype
    batch: int  # token ids, loss mask, sequence starts, target features
    activations: int  # what the layers keep for backward (all layers, or with checkpointing one + the inputs)
    logits: int  # one chunk of lm_head logits, their softmax and gradient (fp32)

    @property
    def optimizer_state(self) -> int:
        """Weights + gradients + AdamW: 16 bytes per parameter."""
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return self.optimizer_state + self.frozen_target + self.batch + self.activations + self.logits

    def describe(self) -> str:
        gb = lambda n: f"{n / 1e9:.1f} GB"  # noqa: E731
        return (
            f"{gb(self.total)}: fp32 weights {gb(self.weights)} + grads {gb(self.gradients)} + AdamW "
            f"{gb(self.optimizer)}, target embeddings+lm_head {gb(self.frozen_target)}, batch {gb(self.batch)}, "
            f"activations {gb(self.activations)}, logits chunk {gb(self.logits)}"
        )


def training_memory(
    shape: DFlashShape,
    *,
    batch_tokens: int,
    num_anchors: int,
    compute_bytes: int = 2,
    feature_bytes: int = 2,
    loss_chunk_blocks: int = 64,
    checkpoint_layers: bool = False,
) -> TrainingMemory:
    """An estimate of one training step's GPU memory (what is counted is each field of TrainingMemory).

    ``batch_tokens``: context tokens in the step (rows x window); ``num_anchors``: blocks in the step (all
    sequences together); each block adds ``block_size`` query tokens. Activations are the tensors autograd keeps
    in the compute dtype (bf16 under autocast: ``compute_bytes``): per block token and layer the residual, two
    norms' outputs, q before/after its norm and rotary, k and v, the attention output, the MLP's gate, up and
    product; per context token and layer its k (before/after norm and rotary) and v; the projected context once.
    Flex attention keeps its output and log-sum-exp only (the dense reference path would add a [heads, queries,
    keys] score matrix per layer: CPU tests only). With ``checkpoint_layers`` a layer keeps its input and one
    layer's activations exist at a time. The loss takes ``loss_chunk_blocks`` blocks of logits at a time."""
    P = parameter_count(shape)
    H, h, kv, d, I = (  # noqa: E741
        shape.hidden_size,
        shape.num_attention_heads,
        shape.num_key_value_heads,
        shape.head_dim,
        shape.intermediate_size,
    )
    queries = num_anchors * shape.block_size
    per_query = 4 * H + 3 * h * d + 3 * kv * d + 4 * I + h  # + h: the log-sum-exp
    per_context = 3 * kv * d
    per_layer = (queries * per_query + batch_tokens * per_context) * compute_bytes
    layers = shape.num_hidden_layers
    if checkpoint_layers:
        kept = layers * (queries * H + batch_tokens * per_context) * compute_bytes + per_layer
    else:
        kept = layers * per_layer
    kept += batch_tokens * H * compute_bytes  # hidden_norm(fc(features)), shared by every layer
    chunk_rows = min(loss_chunk_blocks, num_anchors) * (shape.block_size - 1)
    return TrainingMemory(
        weights=4 * P,
        gradients=4 * P,
        optimizer=8 * P,
        frozen_target=2 * shape.vocab_size * H * compute_bytes,
        batch=batch_tokens * (8 + 4 + 8 + shape.num_context_features * H * feature_bytes),
        activations=kept,
        logits=3 * chunk_rows * shape.vocab_size * 4,
    )


def optimizer_state_fits(shape: DFlashShape, gpu_bytes: int, *, other_bytes: int = 0) -> tuple[bool, str]:
    """Whether the drafter's fp32 weights, gradients and AdamW moments (16 bytes per parameter) plus
    ``other_bytes`` fit one GPU of ``gpu_bytes``; the sentence says the numbers. Kimi K2.5's drafter (6 layers,
    ~3.48B parameters): ~55.7 GB, so it fits an 80 GB H100 with ~24 GB left for activations, the target's
    embeddings and lm_head (~4.7 GB in bf16) and the logits - a 141 GB H200 is comfortable; no single GPU holds it
    beside the target itself."""
    P = parameter_count(shape)
    need = 16 * P + other_bytes
    fits = need <= gpu_bytes
    return fits, (
        f"{P / 1e9:.2f}B parameters x 16 bytes (fp32 weights 4 + grads 4 + AdamW 8) = {16 * P / 1e9:.1f} GB"
        + (f" + {other_bytes / 1e9:.1f} GB other" if other_bytes else "")
        + f" {'fits' if fits else 'does not fit'} {gpu_bytes / 1e9:.1f} GB"
    )


def train_flops_per_token(shape: DFlashShape, num_anchors: int, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per context token of a sequence of ``seq_len`` tokens with up to
    ``num_anchors`` blocks, for the time preview. Forward: fc over every token, each layer's k/v over every token,
    the layers over the block tokens, attention from each block token to the context before its anchor (S/2 on
    average for uniform anchors; at most the window in sliding layers) and its block, lm_head over the B-1 draft
    slots. Backward costs twice the forward, except fc (its input needs no gradient) and lm_head (its weight needs
    none): once."""
    S = max(int(seq_len), 1)
    N = max(min(int(num_anchors), S - 1), 0)
    B = shape.block_size
    H, h, kv, d, I = (  # noqa: E741
        shape.hidden_size,
        shape.num_attention_heads,
        shape.num_key_value_heads,
        shape.head_dim,
        shape.intermediate_size,
    )
    Q = N * B
    fc = 2 * S * shape.num_context_features * H * H
    head = 2 * N * (B - 1) * H * shape.vocab_size
    layers = 0.0
    for layer_type in shape.layer_types:
        window = shape.window_of(layer_type)
        context_keys = S / 2 if window is None else min(S / 2, window)
        block_keys = B if window is None else (B + 1) / 2
        layers += 2 * S * H * 2 * kv * d  # context k, v
        layers += 2 * Q * (H * (h * d + 2 * kv * d) + h * d * H + 3 * H * I)  # q, k, v, o, MLP
        layers += 4 * Q * h * d * (context_keys + block_keys)  # scores and weighted values
    return (2 * fc + 2 * head + 3 * layers) / S
