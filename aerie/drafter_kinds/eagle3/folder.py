"""Drafter folders written by any EAGLE-3 tool, read without torch: what ``drafter.init`` names, what the in-process
benchmark loads, and what parse time checks against the config before any money is spent.

A drafter folder is what SGLang 0.5.23 loads with ``--speculative-draft-model-path``: ``config.json`` (a
``LlamaForCausalLMEagle3`` or ``Eagle3DeepseekV2ForCausalLM`` config with ``draft_vocab_size`` and, optionally,
``eagle_config.eagle_aux_hidden_state_layer_ids``) and safetensors weights (``model.safetensors``, or shards named
by ``model.safetensors.index.json``). aerie's export, SpecForge's ``save_pretrained``, TorchSpec's and the published
Kimi K2.5 drafters all have this layout; they differ in details this module absorbs:

- no ``aerie`` block, no ``head_dim`` (then hidden_size / heads), no ``draft_vocab_size`` (then the target vocab),
  no ``eagle_config`` ids (then SGLang's default layers for the target's depth);
- tensor names with a ``model.`` prefix (SGLang's loader strips it: it prepends ``model.`` itself);
- ``embed_tokens.weight`` present or absent (SGLang replaces it with the target's);
- ``t2d`` absent (SGLang never reads it: it is rebuilt from ``d2t``), ``t2d`` stored as integers;
- aux ids in SGLang's DeepSeek spelling: DeepseekV2/V3 and Kimi K2.5 add 1 to the ids only when the first one is
  1, so a published K2.5 drafter's ``[2, 30, 58]`` is served the outputs of layers ``[1, 29, 57]`` - aerie's
  convention. ``served_aux_layer_ids`` turns the stated ids into the layers SGLang feeds the drafter on a target.

speculators (vLLM) folders are another layout (``speculators_model_type``, a nested layer config, ``layers.N.*``
tensor names): they are refused naming what the folder actually has, as is anything aerie's drafter cannot
represent exactly (a biased layer, Llama rope scaling, more
than one layer), because training on it would not be what SGLang then serves.

``resolve_drafter_folder`` finds a folder from a path or a Hub repo id, offline: the Hugging Face cache only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from aerie.drafter_kinds.eagle3.shape import READABLE_FORMATS, SGLANG_ARCHITECTURES, DrafterConfig, _yarn_of
from aerie.drafter_kinds.folders import (
    FLOAT_DTYPES,
    DrafterFolderError,
    StoredTensor,
    read_folder_config,
    read_tensor_index,
)
from aerie.target_model.config import captured_output_ids, default_aux_layer_ids, predicted_capture_inputs

EMBED_NAME = "embed_tokens.weight"
KINDS_BY_ARCHITECTURE = {arch: kind for kind, arch in SGLANG_ARCHITECTURES.items()}
# EAGLE 3.1's two switches (config.json keys SGLang 0.5.23 reads for both drafter classes; off when absent).
EAGLE31_SWITCHES = ("fc_norm", "norm_output")
# SGLang's default when a drafter names no aux layers: three (llama_eagle3 / kimi_k25_eagle3 size fc so).
DEFAULT_NUM_AUX_LAYERS = 3


def canonical_name(stored: str) -> str:
    """aerie's (and SGLang's checkpoint) tensor name: without the ``model.`` prefix some exporters add."""
    return stored.removeprefix("model.")


@dataclass
class DrafterFolder:
    """A drafter folder as written, read from config.json and the safetensors headers (no tensor data)."""

    path: Path
    config: dict[str, Any]
    kind: str  # "llama" or "mla"
    tensors: dict[str, StoredTensor]  # by canonical name
    stated_aux_layer_ids: list[int] | None  # eagle_config's ids as written (None: the folder names none)
    writer: str  # who wrote it, as far as the files say (aerie's export, or "another tool")
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return SGLANG_ARCHITECTURES[self.kind]

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def draft_vocab_size(self) -> int:
        return int(self.config.get("draft_vocab_size") or self.config["vocab_size"])

    @property
    def target_hidden_size(self) -> int:
        return int(self.config.get("target_hidden_size") or self.hidden_size)

    @property
    def num_aux_layers(self) -> int:
        """How many target layers fc reads: the stated ids, else fc's width, else SGLang's default three."""
        if self.stated_aux_layer_ids is not None:
            return len(self.stated_aux_layer_ids)
        return self.fc_width_aux_layers or DEFAULT_NUM_AUX_LAYERS

    @property
    def has_embeddings(self) -> bool:
        return EMBED_NAME in self.tensors

    @property
    def fc_width_aux_layers(self) -> int | None:
        """How many aux layers fc's width holds (its input columns / the target's hidden size), None when fc is
        absent or its width is not a whole number of them."""
        fc = self.tensors.get("fc.weight")
        if fc is None or len(fc.shape) != 2 or fc.shape[1] % self.target_hidden_size:
            return None
        return fc.shape[1] // self.target_hidden_size

    def aux_count_source(self) -> str:
        """Where ``num_aux_layers`` comes from, with both figures when the folder states ids and has an fc."""
        width = self.fc_width_aux_layers
        fc = self.tensors.get("fc.weight")
        fc_text = f"fc.weight {list(fc.shape)} = {width} x hidden {self.target_hidden_size}" if width else ""
        if self.stated_aux_layer_ids is not None:
            ids = f"{len(self.stated_aux_layer_ids)} eagle_config ids {self.stated_aux_layer_ids}"
            return f"{ids}; {fc_text}" if fc_text else ids
        return fc_text or f"neither ids nor an fc: SGLang's default {DEFAULT_NUM_AUX_LAYERS}"

    def aux_count_conflict(self) -> str | None:
        """The folder against itself: eagle_config names N aux ids but fc's width holds M aux layers."""
        width, ids = self.fc_width_aux_layers, self.stated_aux_layer_ids
        if width is None or ids is None or width == len(ids):
            return None
        fc = self.tensors["fc.weight"]
        return (
            f"config.json eagle_config names {len(ids)} aux layer ids {ids}, but fc.weight {list(fc.shape)} reads "
            f"{width} (= {fc.shape[1]} columns / hidden {self.target_hidden_size}): SGLang would feed fc "
            f"{len(ids) * self.target_hidden_size} columns; the folder is inconsistent"
        )

    def eagle31_upgrade(self, shape: Mapping[str, Any]) -> list[str]:
        """The EAGLE 3.1 switches the settings turn on that this folder lacks (trained from the folder: fc_norm's
        new weights start at 1, norm_output has no tensor)."""
        return [k for k in EAGLE31_SWITCHES if shape.get(k) and not self.config.get(k)]

    def drafter_config(self, aux_layer_ids: Sequence[int]) -> DrafterConfig:
        """The drafter's shape, with ``aux_layer_ids`` in aerie's convention (see served_aux_layer_ids)."""
        return drafter_config_of(self.config, self.kind, aux_layer_ids)

    def describe(self) -> str:
        ids = self.stated_aux_layer_ids
        return (
            f"{self.architecture} ({self.kind} attention), written by {self.writer}, hidden {self.hidden_size}, "
            f"vocab {self.vocab_size}, draft vocab {self.draft_vocab_size}, "
            f"aux ids {ids if ids is not None else 'not stated (SGLang default)'}, {len(self.tensors)} tensors"
            + (
                f" (its own embed_tokens {list(self.tensors[EMBED_NAME].shape)} are dropped: SGLang swaps in the "
                "target's, and so does training)"
                if self.has_embeddings
                else " (no embed_tokens: the target's are used)"
            )
        )


def _config_problems(config: Mapping[str, Any]) -> list[str]:
    """What in a config.json aerie's drafter cannot be exactly (each names the key)."""
    problems = []
    if config.get("speculators_model_type"):
        return [
            f"config.json is a speculators (vLLM) config (speculators_model_type {config['speculators_model_type']!r}"
            + (f", architectures {config['architectures']}" if config.get("architectures") else ", no architectures")
            + "): SGLang 0.5.23 loads LlamaForCausalLMEagle3 / Eagle3DeepseekV2ForCausalLM configs"
            + (
                " (this one nests its layer's settings in transformer_layer_config)"
                if "transformer_layer_config" in config
                else ""
            )
        ]
    arch = (config.get("architectures") or [None])[0]
    if arch not in KINDS_BY_ARCHITECTURE:
        problems.append(
            f"config.json architectures {config.get('architectures')!r}: not an EAGLE-3 drafter SGLang serves "
            f"({' or '.join(sorted(KINDS_BY_ARCHITECTURE))})"
        )
    if int(config.get("num_hidden_layers", 1)) != 1:
        problems.append(f"config.json num_hidden_layers {config['num_hidden_layers']}: only one-layer drafters")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if not isinstance(config.get(key), int):
            problems.append(f"config.json has no {key}")
    for key in ("attention_bias", "mlp_bias", "bias"):
        if config.get(key):
            problems.append(f"config.json {key}: true - aerie's drafter has no biases (SGLang would load them)")
    if config.get("tie_word_embeddings"):
        problems.append("config.json tie_word_embeddings: true - SGLang would tie the draft head to the embeddings")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"config.json hidden_act {config['hidden_act']!r}: SGLang's drafter MLP is silu only")
    if KINDS_BY_ARCHITECTURE.get(arch) == "llama":
        scaling = config.get("rope_scaling") or {}
        kind = scaling.get("rope_type") or scaling.get("type")
        params = config.get("rope_parameters") or {}
        kind = kind or (params.get("rope_type") if params.get("rope_type") not in (None, "default") else None)
        if kind not in (None, "default"):
            problems.append(
                f"config.json rope scaling {kind!r}: the llama drafter uses plain RoPE (SGLang would apply the scaling)"
            )
    aerie = config.get("aerie")
    if isinstance(aerie, Mapping) and aerie.get("format") not in READABLE_FORMATS:
        problems.append(f"config.json aerie.format {aerie.get('format')!r} is not one of {list(READABLE_FORMATS)}")
    eagle = config.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        problems.append("config.json eagle_config.use_aux_hidden_state: false - not an EAGLE-3 (aux-state) drafter")
    return problems


def _speculators_tensor_facts(path: Path) -> list[str]:
    """What a speculators folder's tensors do differently from SGLang's layout, as found (names, fc's bias): each
    difference named only when it is there."""
    try:
        tensors, _ = read_tensor_index(path, canonical_name)
    except DrafterFolderError as e:
        return e.problems
    facts = []
    layer = sorted(n for n in tensors if n.startswith("layers."))
    if layer:
        facts.append(
            f"its decoder layer's {len(layer)} tensors are named layers.N.* (e.g. {layer[0]}); SGLang's layout "
            "names them midlayer.*"
        )
    if "fc.bias" in tensors:
        facts.append(f"it has fc.bias {list(tensors['fc.bias'].shape)}: SGLang's fc has no bias")
    biased = sorted(n for n in tensors if n.endswith(".bias") and n != "fc.bias")
    if biased:
        facts.append(f"it has biases SGLang's drafter lacks: {', '.join(biased[:4])}")
    facts.append("export it to SGLang's layout first (config.json + midlayer.* tensors), then start from that")
    return facts


def read_drafter_folder(path: str | Path) -> DrafterFolder:
    """Read a drafter folder's config.json and safetensors headers; DrafterFolderError names what is unreadable or
    not representable. Shapes are checked against a config by ``check_drafter_folder``."""
    path = Path(path)
    config = read_folder_config(path)
    problems = _config_problems(config)
    if problems and config.get("speculators_model_type"):
        problems += _speculators_tensor_facts(path)
    if problems:
        raise DrafterFolderError(path, problems)
    tensors, metadata = read_tensor_index(path, canonical_name)
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    aerie = config.get("aerie") or {}
    writer = f"aerie ({aerie['format']})" if aerie.get("format") else "another tool (no aerie block in config.json)"
    return DrafterFolder(
        path=path,
        config=config,
        kind=KINDS_BY_ARCHITECTURE[config["architectures"][0]],
        tensors=tensors,
        stated_aux_layer_ids=[int(i) for i in ids] if ids is not None else None,
        writer=writer,
        metadata=metadata,
    )


def drafter_config_of(config: Mapping[str, Any], kind: str, aux_layer_ids: Sequence[int]) -> DrafterConfig:
    """DrafterConfig from any tool's config.json (defaults where SGLang has them)."""
    heads = int(config["num_attention_heads"])
    mla: dict[str, Any] = {}
    if kind == "mla":
        mla = {
            k: config.get(k)
            for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        }
        rope = SimpleNamespace(**{k: config.get(k) for k in ("rope_parameters", "rope_scaling")})
        mla.update(rope_scaling=_yarn_of(rope), rope_interleave=bool(config.get("rope_interleave", True)))
        head_dim = int(mla["qk_nope_head_dim"] or 0) + int(mla["qk_rope_head_dim"] or 0)
        kv_heads = heads
    else:
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        kv_heads = int(config.get("num_key_value_heads") or heads)
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    return DrafterConfig(
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(config["vocab_size"]),
        draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
        aux_layer_ids=list(aux_layer_ids),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        hidden_act=str(config.get("hidden_act", "silu")),
        attention=kind,
        fc_norm=bool(config.get("fc_norm", False)),
        norm_output=bool(config.get("norm_output", False)),
        **mla,
    )


def expected_tensor_shapes(d: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of aerie's drafter of shape ``d`` except the embeddings, with its shape - what SGLang's
    LlamaForCausalLMEagle3 / Eagle3DeepseekV2ForCausalLM load (tests/test_warm_start.py keeps this equal to
    Eagle3Drafter's state_dict)."""
    H, A = d.hidden_size, d.num_aux_layers
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (H, A * H)}
    if d.fc_norm:
        shapes.update({f"fc_norm.{i}.weight": (H,) for i in range(A)})
    p = "midlayer."
    shapes.update({f"{p}{n}.weight": (H,) for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")})
    a = p + "self_attn."
    h = d.num_attention_heads
    if d.attention == "mla":
        n, r, v = d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim
        shapes.update(
            {
                a + "q_a_proj.weight": (d.q_lora_rank, 2 * H),
                a + "q_a_layernorm.weight": (d.q_lora_rank,),
                a + "q_b_proj.weight": (h * (n + r), d.q_lora_rank),
                a + "kv_a_proj_with_mqa.weight": (d.kv_lora_rank + r, 2 * H),
                a + "kv_a_layernorm.weight": (d.kv_lora_rank,),
                a + "kv_b_proj.weight": (h * (n + v), d.kv_lora_rank),
                a + "o_proj.weight": (H, h * v),
            }
        )
    else:
        kv, hd = d.num_key_value_heads, d.head_dim
        shapes.update(
            {
                a + "q_proj.weight": (h * hd, 2 * H),
                a + "k_proj.weight": (kv * hd, 2 * H),
                a + "v_proj.weight": (kv * hd, 2 * H),
                a + "o_proj.weight": (H, h * hd),
            }
        )
    I = d.intermediate_size  # noqa: E741
    shapes.update(
        {
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
            "norm.weight": (H,),
            "lm_head.weight": (d.draft_vocab_size, H),
            "d2t": (d.draft_vocab_size,),
            "t2d": (d.vocab_size,),
        }
    )
    return shapes


def tensor_problems(folder: DrafterFolder, d: DrafterConfig) -> list[str]:
    """Missing, extra and mis-shaped tensors of ``folder`` against the drafter ``d`` (each named)."""
    expected = expected_tensor_shapes(d)
    stored = dict(folder.tensors)
    problems = []
    embed = stored.pop(EMBED_NAME, None)
    if embed is not None and embed.shape != (d.vocab_size, d.hidden_size):
        problems.append(f"tensor {EMBED_NAME} has shape {list(embed.shape)}, expected {[d.vocab_size, d.hidden_size]}")
    optional = {"t2d"}  # SGLang never reads t2d: it is rebuilt from d2t when absent
    if d.draft_vocab_size == d.vocab_size:
        optional.add("d2t")  # a full-vocab head needs no map
    for name, shape in expected.items():
        info = stored.pop(name, None)
        if info is None:
            if name not in optional:
                problems.append(f"tensor {name} is missing (expected shape {list(shape)})")
            continue
        if info.shape != shape:
            problems.append(f"tensor {name} has shape {list(info.shape)}, expected {list(shape)}")
        elif name == "d2t" and info.dtype in FLOAT_DTYPES:
            problems.append(f"tensor d2t is {info.dtype}: expected integer offsets")
        elif name not in ("d2t", "t2d") and info.dtype not in FLOAT_DTYPES:
            problems.append(f"tensor {name} is {info.dtype}: expected a float dtype")
    for name in sorted(stored):
        problems.append(f"tensor {name} is not part of the drafter (shape {list(stored[name].shape)})")
    return problems


# ---- the layers SGLang feeds it -------------------------------------------------------------------------------


def served_aux_layer_ids(
    stated: Sequence[int] | None, num_hidden_layers: int, architectures: Sequence[str] = ()
) -> list[int]:
    """The decoder-layer outputs (aerie's convention) SGLang 0.5.23 feeds a drafter whose config states ``stated``
    on a target of ``num_hidden_layers`` with ``architectures``.

    No ids: SGLang's default (the inputs of [2, L//2, L-3]). Ids: the target's ``set_eagle3_layers_to_capture`` maps
    them to layer inputs - id + 1 for most models; for DeepseekV2/V3 and Kimi K2.5 only when the first id is 1, else
    the ids themselves, i.e. outputs one lower ([2, 30, 58] is served the outputs [1, 29, 57]). -1 would be the
    embeddings (the input of layer 0)."""
    if stated is None:
        return default_aux_layer_ids(num_hidden_layers)
    return captured_output_ids(predicted_capture_inputs(list(architectures), list(stated)))


def check_drafter_folder(
    folder: DrafterFolder,
    *,
    aux_layer_ids: Sequence[int] | None,
    num_hidden_layers: int | None,
    architectures: Sequence[str] = (),
    target_hidden_size: int | None = None,
    target_vocab_size: int | None = None,
    draft_vocab_size: int | None = None,
    shape: Mapping[str, Any] | None = None,
) -> DrafterConfig:
    """The drafter ``folder`` holds, refused (DrafterFolderError, every reason named) unless it fits the config:

    - ``aux_layer_ids``: hidden.aux_layer_ids resolved (aerie's convention); SGLang must serve the folder exactly
      these layers on this target (``served_aux_layer_ids``), in number and ids;
    - ``target_hidden_size`` / ``target_vocab_size``: the target's; the drafter's embeddings and fc are sized by them;
    - ``draft_vocab_size``: vocab.draft_vocab_size capped at the target vocab (the folder's vocab is kept);
    - ``shape``: the drafter section's shape settings (TrainConfig.drafter_shape()); a set one must equal the folder's;
    - every tensor present (embeddings and t2d may be absent), none extra, each of its shape.

    A value given as None is not known yet (the target is not here) and is checked when training starts.
    """
    problems = []
    if folder.hidden_size != folder.target_hidden_size:
        problems.append(
            f"target_hidden_size {folder.target_hidden_size} != hidden_size {folder.hidden_size}: aerie's drafter "
            "shares the target's embeddings, so its width is the target's"
        )
    if target_hidden_size is not None and folder.target_hidden_size != target_hidden_size:
        problems.append(
            f"it reads a target of hidden size {folder.target_hidden_size} (config.json "
            f"{'target_hidden_size' if 'target_hidden_size' in folder.config else 'hidden_size'}), the target has "
            f"{target_hidden_size}"
        )
    if target_vocab_size is not None and folder.vocab_size != target_vocab_size:
        problems.append(f"config.json vocab_size {folder.vocab_size} != the target's vocab size {target_vocab_size}")
    if draft_vocab_size is not None and folder.draft_vocab_size != draft_vocab_size:
        problems.append(
            f"config.json draft_vocab_size {folder.draft_vocab_size} != vocab.draft_vocab_size {draft_vocab_size}: "
            f"training keeps the folder's draft vocabulary, so set vocab.draft_vocab_size: {folder.draft_vocab_size}"
        )
    shape = dict(shape or {})
    kind = shape.get("attention") or "auto"
    if kind != "auto" and kind != folder.kind:
        problems.append(f"it is a {folder.kind} drafter ({folder.architecture}), drafter.attention is {kind!r}")
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        want = shape.get(key)
        if not want:
            continue
        have = _folder_dim(folder, key)
        if have != want:
            problems.append(f"config.json {key} is {have}, drafter.{key} is {want}")

    conflict = folder.aux_count_conflict()
    if conflict:
        problems.append(conflict)
    served = None
    if num_hidden_layers is not None:
        served = served_aux_layer_ids(folder.stated_aux_layer_ids, num_hidden_layers, architectures)
    if aux_layer_ids is not None:
        ids = list(aux_layer_ids)
        if folder.num_aux_layers != len(ids):
            problems.append(
                f"it reads {folder.num_aux_layers} aux layers ({folder.aux_count_source()}), hidden.aux_layer_ids has "
                f"{len(ids)}: {ids}"
            )
        elif served is not None and served != ids:
            stated = folder.stated_aux_layer_ids
            how = (
                f"states no ids, so SGLang serves its default layers {served}"
                if stated is None
                else f"states eagle_config ids {stated}, which SGLang serves on this target as the outputs of layers "
                f"{served}"
            )
            problems.append(
                f"it {how}, but hidden.aux_layer_ids is {ids} (the layers captured for training): set "
                f"hidden.aux_layer_ids: {served}"
                + (" (aerie's convention)" if stated is not None and stated != served else "")
            )
    if not problems:
        ids_for_shape = list(aux_layer_ids) if aux_layer_ids is not None else served
        if ids_for_shape is None:
            ids_for_shape = list(range(1, folder.num_aux_layers + 1))  # the count is what sizes the tensors
        try:
            d = folder.drafter_config(ids_for_shape)
        except (KeyError, TypeError, ValueError) as e:
            raise DrafterFolderError(folder.path, [f"config.json: {e}"]) from None
        problems += tensor_problems(folder, d)
        if not problems:
            return d
    raise DrafterFolderError(folder.path, problems)


def _folder_dim(folder: DrafterFolder, key: str) -> int:
    cfg = folder.config
    if key == "num_key_value_heads":
        return (
            int(cfg.get(key) or cfg["num_attention_heads"])
            if folder.kind == "llama"
            else int(cfg["num_attention_heads"])
        )
    if key == "head_dim":
        if folder.kind == "mla":
            return int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
        return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    return int(cfg[key])
