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

speculators (vLLM) folders are another layout (``speculators_model_type``, ``layers.0.*``, a biased ``fc``): they are
refused by name, as is anything aerie's drafter cannot represent exactly (a biased layer, Llama rope scaling, more
than one layer), because training on it would not be what SGLang then serves.

``resolve_drafter_folder`` finds a folder from a path or a Hub repo id, offline: the Hugging Face cache only.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aerie.drafter.shape import READABLE_FORMATS, SGLANG_ARCHITECTURES, DrafterConfig
from aerie.sglang_capture.mapping import captured_output_ids, predicted_capture_inputs
from aerie.target_model.config import default_aux_layer_ids

EMBED_NAME = "embed_tokens.weight"
KINDS_BY_ARCHITECTURE = {arch: kind for kind, arch in SGLANG_ARCHITECTURES.items()}
# SGLang's default when a drafter names no aux layers: three (llama_eagle3 / kimi_k25_eagle3 size fc so).
DEFAULT_NUM_AUX_LAYERS = 3
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


class DrafterFolderError(ValueError):
    """A drafter folder that cannot be read, or does not fit the config; ``problems`` lists every reason, each
    naming the tensor or the setting."""

    def __init__(self, folder: str | Path, problems: Sequence[str]):
        self.folder = str(folder)
        self.problems = list(problems)
        super().__init__(f"drafter folder {folder}: " + "; ".join(self.problems))


# ---- finding a folder -----------------------------------------------------------------------------------------


def hub_cache_dirs() -> list[Path]:
    """Where huggingface_hub keeps downloaded repos, in its own order of precedence."""
    dirs = []
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    xdg = os.environ.get("XDG_CACHE_HOME")
    dirs.append((Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub")
    return list(dict.fromkeys(dirs))


def looks_like_repo_id(spec: str) -> bool:
    """``owner/name`` (optionally ``@revision``) and not an existing path."""
    name = spec.split("@", 1)[0]
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def resolve_drafter_folder(spec: str | Path, base: Path | None = None) -> Path:
    """The folder ``spec`` names: a local path (relative to ``base``, the workflow's directory) or a Hub repo id
    (``owner/name[@revision]``) already in the Hugging Face cache - nothing is downloaded. Raises
    FileNotFoundError saying every place it looked."""
    spec = str(spec)
    path = Path(spec).expanduser()
    if not path.is_absolute() and base is not None:
        path = Path(base) / path
    if (path / "config.json").is_file():
        return path
    looked = [str(path)]
    if looks_like_repo_id(spec):
        repo, _, revision = spec.partition("@")
        for cache in hub_cache_dirs():
            repo_dir = cache / ("models--" + repo.replace("/", "--"))
            ref = repo_dir / "refs" / (revision or "main")
            snapshot = ref.read_text().strip() if ref.is_file() else (revision or "")
            candidate = repo_dir / "snapshots" / snapshot if snapshot else repo_dir / "snapshots" / "<refs/main>"
            if snapshot and (candidate / "config.json").is_file():
                return candidate
            looked.append(str(candidate))
        hint = (
            f"download it where the network is reachable: huggingface-cli download {repo}"
            + (f" --revision {revision}" if revision else "")
            + " (or set HF_HUB_CACHE / HF_HOME to the cache that has it)"
        )
    else:
        hint = "give the folder that holds its config.json and safetensors weights"
    raise FileNotFoundError(
        f"drafter folder {spec!r} not found (no config.json); looked in: {', '.join(looked)}. {hint}"
    )


# ---- reading it -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredTensor:
    dtype: str  # safetensors dtype name: F32, BF16, I64, BOOL ...
    shape: tuple[int, ...]
    file: str  # the safetensors file (name within the folder)
    stored_name: str  # its name in that file


def read_safetensors_header(path: Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """(tensors by stored name, metadata) of one safetensors file, from its JSON header only."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", None) or {}
    tensors = {
        name: StoredTensor(str(info["dtype"]), tuple(int(x) for x in info["shape"]), path.name, name)
        for name, info in header.items()
    }
    return tensors, meta


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: the index's shards, else model.safetensors, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        raise DrafterFolderError(
            folder,
            [
                "no safetensors weights"
                + (
                    f" (it has {', '.join(other)}: convert them to safetensors, which can be checked unloaded)"
                    if other
                    else ""
                )
            ],
        )
    return files


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
        fc = self.tensors.get("fc.weight")
        if fc is not None and len(fc.shape) == 2 and fc.shape[1] % self.target_hidden_size == 0:
            return fc.shape[1] // self.target_hidden_size
        return DEFAULT_NUM_AUX_LAYERS

    @property
    def has_embeddings(self) -> bool:
        return EMBED_NAME in self.tensors

    def drafter_config(self, aux_layer_ids: Sequence[int]) -> DrafterConfig:
        """The drafter's shape, with ``aux_layer_ids`` in aerie's convention (see served_aux_layer_ids)."""
        return drafter_config_of(self.config, self.kind, aux_layer_ids)

    def describe(self) -> str:
        ids = self.stated_aux_layer_ids
        return (
            f"{self.architecture} ({self.kind} attention), written by {self.writer}, hidden {self.hidden_size}, "
            f"vocab {self.vocab_size}, draft vocab {self.draft_vocab_size}, "
            f"aux ids {ids if ids is not None else 'not stated (SGLang default)'}, {len(self.tensors)} tensors"
            + ("" if self.has_embeddings else " (no embed_tokens: the target's are used)")
        )


def _config_problems(config: Mapping[str, Any]) -> list[str]:
    """What in a config.json aerie's drafter cannot be exactly (each names the key)."""
    problems = []
    if config.get("speculators_model_type"):
        return [
            f"config.json is a speculators (vLLM) config (type {config['speculators_model_type']!r}): "
            "not the layout SGLang loads (layers.0.* names, a biased fc); export it to SGLang's layout first"
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


def read_drafter_folder(path: str | Path) -> DrafterFolder:
    """Read a drafter folder's config.json and safetensors headers; DrafterFolderError names what is unreadable or
    not representable. Shapes are checked against a config by ``check_drafter_folder``."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise DrafterFolderError(path, ["no config.json"]) from None
    except json.JSONDecodeError as e:
        raise DrafterFolderError(path, [f"config.json is not JSON: {e}"]) from None
    problems = _config_problems(config)
    if problems:
        raise DrafterFolderError(path, problems)
    tensors: dict[str, StoredTensor] = {}
    metadata: dict[str, str] = {}
    for file in weight_files(path):
        found, meta = read_safetensors_header(file)
        metadata.update(meta)
        for stored, info in found.items():
            name = canonical_name(stored)
            if name in tensors:
                raise DrafterFolderError(path, [f"tensor {name} is stored twice ({tensors[name].file}, {file.name})"])
            tensors[name] = info
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
        from types import SimpleNamespace

        from aerie.drafter.shape import _yarn_of

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
        elif name == "d2t" and info.dtype in _FLOAT_DTYPES:
            problems.append(f"tensor d2t is {info.dtype}: expected integer offsets")
        elif name not in ("d2t", "t2d") and info.dtype not in _FLOAT_DTYPES:
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
    for key in ("fc_norm", "norm_output"):
        if shape.get(key) and not folder.config.get(key):
            problems.append(f"drafter.{key} is true, the folder's config.json has no {key}")

    served = None
    if num_hidden_layers is not None:
        served = served_aux_layer_ids(folder.stated_aux_layer_ids, num_hidden_layers, architectures)
    if aux_layer_ids is not None:
        ids = list(aux_layer_ids)
        if folder.num_aux_layers != len(ids):
            problems.append(
                f"it reads {folder.num_aux_layers} aux layers (eagle_config ids {folder.stated_aux_layer_ids}, fc "
                f"width), hidden.aux_layer_ids has {len(ids)}: {ids}"
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
