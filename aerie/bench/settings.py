"""The bench rule's settings: which backend measures, which references it runs, which sets, checked at parse time.

``bench.backend``: ``inprocess`` decodes with the target in the job's own Python (``aerie.bench.run``; the target
must fit the job's GPUs, ``aerie.target_model.placement``), ``sglang`` has SGLang serve it (``aerie.bench.serving``, the
serving harness: baseline, EAGLE-3 and reference servers in turn, config ``sglang:``). Both write the same report and
pass the same gate (``aerie.bench.gate``).

``bench.references``: what the trained drafter is measured against in the same run, on the same prompts, with the
same settings. Built in: ``untrained`` (the drafter as training starts it; in-process only), ``ngram`` (prompt lookup
at the trained drafter's draft width: in-process the same chain of ``num_draft_steps`` drafts, under SGLang its NGRAM
algorithm with ``speculative_num_draft_tokens`` and a breadth of 1), ``ngram_default`` (SGLang's NGRAM at its own
defaults: 12 draft tokens, breadth 10; labelled so). Anything else names a drafter folder: a path (relative to the
workflow's directory) or a Hub repo id already in the Hugging Face cache (``lightseekorg/kimi-k2.5-eagle3``), served
like the trained drafter (SGLang: another EAGLE-3 server with the same flags; in-process: the same reader and
decoder). A folder that is here and does not fit the target is refused at parse time, naming it; one that is not
here yet is named in the dry run and refused by the bench job before any server starts.

``bench.sets``: benchmark sets besides the datasets' held-out prompts (the published cards' MT-Bench, GSM8K test,
HumanEval): :mod:`aerie.bench.sets`.

Torch-free: imported while Snakemake parses the workflow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BACKENDS = ("inprocess", "sglang")
# Built-in references each backend can run, and its default set (config bench.references absent).
BUILTIN_REFERENCES = {"inprocess": ("untrained", "ngram"), "sglang": ("ngram", "ngram_default")}
DEFAULT_REFERENCES = {"inprocess": ("untrained", "ngram"), "sglang": ("ngram",)}
# Names a reference drafter folder cannot take: they are the report's own methods.
RESERVED_NAMES = ("baseline", "eagle3", "untrained", "ngram", "ngram_default")
# Whether a reference drafts at the trained drafter's width (its acceptance length is then comparable).
MATCHED_WIDTH = {"untrained": True, "ngram": True, "ngram_default": False, "drafter": True}


@dataclass(frozen=True)
class Reference:
    """One reference of a run: its report name, kind (a built-in name or ``drafter``) and, for a drafter, the
    folder it resolved to (None while it is not here)."""

    name: str
    kind: str
    folder: Path | None = None
    missing: str | None = None  # why the folder was not found (the hint to fetch it)

    @property
    def matched_width(self) -> bool:
        return MATCHED_WIDTH[self.kind]


def bench_references(bench: Mapping[str, Any]) -> list[str]:
    """The references of this run as configured: ``bench.references``, or the backend's default set."""
    backend = bench.get("backend", "inprocess")
    refs = bench.get("references")
    return list(DEFAULT_REFERENCES[backend] if refs is None else refs)


def method_kinds(references: Sequence[str], folders: Mapping[str, Path]) -> dict[str, dict[str, Any]]:
    """``{method: {kind, folder, matched_width}}`` of the trained drafter (``eagle3``) and every reference."""
    kinds: dict[str, dict[str, Any]] = {"eagle3": {"kind": "trained", "folder": None, "matched_width": True}}
    for name in references:
        kind = "drafter" if name in folders else name
        kinds[name] = {
            "kind": kind,
            "folder": str(folders[name]) if name in folders else None,
            "matched_width": MATCHED_WIDTH[kind],
        }
    return kinds


def resolve_reference_folder(spec: str, base: Path | None) -> tuple[Path | None, str | None]:
    """(the folder a reference names, None) or (None, why it is not here): a path from ``base`` or a Hub repo id in
    the offline Hugging Face cache."""
    from aerie.drafter.folder import resolve_drafter_folder

    try:
        return resolve_drafter_folder(spec, base), None
    except FileNotFoundError as e:
        return None, str(e)


def resolve_references(bench: Mapping[str, Any], base: Path | None = None) -> list[Reference]:
    """Every reference of the run, drafter folders resolved (offline) from ``base`` (the workflow's directory)."""
    backend = bench.get("backend", "inprocess")
    out = []
    for spec in bench_references(bench):
        spec = str(spec)
        if spec in RESERVED_NAMES:
            if spec not in BUILTIN_REFERENCES[backend]:
                raise ValueError(
                    f"bench.references: {spec} cannot run with bench.backend: {backend} (built in there: "
                    f"{', '.join(BUILTIN_REFERENCES[backend])}; untrained - the drafter as training starts it - is "
                    "decoded by aerie in-process only, ngram_default is SGLang's NGRAM at its own width); set "
                    "bench.references: [" + ", ".join(DEFAULT_REFERENCES[backend]) + "] or name drafter folders"
                )
            out.append(Reference(spec, spec))
        else:
            folder, missing = resolve_reference_folder(spec, base)
            out.append(Reference(spec, "drafter", folder, missing))
    names = [r.name for r in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"bench.references names {', '.join(dupes)} twice")
    return out


def target_dimensions(config: Mapping[str, Any]) -> dict[str, Any]:
    """What parse time knows of the target: ``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
    ``architectures`` (each only when known: the folder's config.json, else target.config_json, else the config's
    own target keys)."""
    from aerie.target_model.config import architectures, read_config, read_described_config, text_config

    target = config.get("target") or {}
    full: dict[str, Any] = {}
    path = Path(str(target.get("path", "")))
    try:
        if target.get("path") and (path / "config.json").is_file():
            full = read_config(path)
        elif target.get("config_json"):
            full = read_described_config(target["config_json"])
    except (OSError, ValueError):
        full = {}
    known = text_config(full)
    dims: dict[str, Any] = {k: known.get(k) for k in ("vocab_size", "hidden_size", "num_hidden_layers")}
    for k in ("hidden_size", "num_hidden_layers"):
        dims[k] = dims[k] or target.get(k)
    out: dict[str, Any] = {k: int(v) for k, v in dims.items() if isinstance(v, int) and not isinstance(v, bool)}
    if full:
        out["architectures"] = architectures(full)
    return out


def reference_fit_problems(folder: Path, dims: Mapping[str, Any]) -> list[str]:
    """Why a reference drafter folder cannot be served on this target (empty: it fits, as far as ``dims`` go): read
    with the drafter folder reader (any tool's SGLang layout), every tensor checked, its width and vocabulary
    against the target's. Its aux layers are its own (SGLang feeds each drafter the layers its config names)."""
    from aerie.drafter.folder import (
        DrafterFolderError,
        check_drafter_folder,
        read_drafter_folder,
        served_aux_layer_ids,
    )

    try:
        info = read_drafter_folder(folder)
        check_drafter_folder(
            info,
            aux_layer_ids=None,
            num_hidden_layers=dims.get("num_hidden_layers"),
            architectures=dims.get("architectures") or (),
            target_hidden_size=dims.get("hidden_size"),
            target_vocab_size=dims.get("vocab_size"),
        )
    except DrafterFolderError as e:
        return e.problems
    layers = dims.get("num_hidden_layers")
    if layers:
        served = served_aux_layer_ids(info.stated_aux_layer_ids, layers, dims.get("architectures") or ())
        if max(served) >= layers or min(served) < 0:
            return [f"SGLang would feed it the outputs of layers {served}, outside the target's {layers} layers"]
    return []


def check_references(config: Mapping[str, Any], base: Path | None = None) -> list[Reference]:
    """The run's references, each drafter folder that is here checked against the target (ValueError naming the
    folder and every reason); a folder not here yet is returned with ``missing`` set (the dry run names it)."""
    refs = resolve_references(config.get("bench") or {}, base)
    dims = target_dimensions(config)
    for r in refs:
        if r.folder is not None:
            problems = reference_fit_problems(r.folder, dims)
            if problems:
                raise ValueError(
                    f"bench.references: {r.name} ({r.folder}) does not fit the target: " + "; ".join(problems)
                )
    return refs


def check_bench_config(config: Mapping[str, Any], base: Path | None = None) -> list[Reference]:
    """ValueError naming the setting when the bench settings cannot work together (called by rules/bench.smk);
    returns the references (:func:`check_references`)."""
    bench = config.get("bench") or {}
    backend = bench.get("backend", "inprocess")
    if backend not in BACKENDS:
        raise ValueError(f"bench.backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    refs = check_references(config, base)
    from aerie.bench.sets import check_bench_sets

    check_bench_sets(config)
    if backend != "sglang":
        return refs
    from aerie.bench.sglang_server import sglang_settings

    settings = sglang_settings(config.get("sglang"))
    gpus = (config.get("resources") or {}).get("bench_gpus", 1)
    if settings["tp"] > gpus:
        raise ValueError(
            f"sglang.tp: {settings['tp']} GPUs per server, but rule bench gets resources.bench_gpus: {gpus}; "
            f"set resources.bench_gpus: {settings['tp']} (the servers run inside the bench job, on its GPUs)"
        )
    return refs


def bench_preview_text(config: Mapping[str, Any], refs: list[Reference]) -> str:
    """The dry run's benchmark lines: backend, sets, every reference and what the gate requires."""
    from aerie.bench.sets import bench_sets

    bench = config.get("bench") or {}
    held_out = [n for n, d in (config.get("datasets") or {}).items() if d.get("bench_prompts", 0) > 0]
    sets = [f"{n} (held out of datasets.{n})" for n in held_out]
    for name, spec in bench_sets(config).items():
        src = spec["source"]
        label = src.get("name") or src.get("path") or src.get("data_files") or src["kind"]
        fallback = spec.get("fallback") or {}
        fb = fallback.get("path") or fallback.get("data_files") or fallback.get("name")
        sets.append(f"{name} ({label}" + (f", else {fb}" if fb else "") + ")")
    gate = bench.get("gate") or {}
    beat = gate.get("must_beat_references", True)
    lines = [
        f"aerie benchmark: backend {bench.get('backend', 'inprocess')}, one table per set: {', '.join(sets)}",
        f"  the gate: speedup >= {gate.get('min_speedup', 1.0)}, lossless, no failed request"
        + (", beat every reference on every set" if beat else ""),
        references_text(refs),
    ]
    return "\n".join(lines)


def references_text(refs: list[Reference]) -> str:
    """The dry run's lines about the references."""
    lines = []
    for r in refs:
        if r.kind != "drafter":
            width = "" if r.matched_width else " (SGLang's own NGRAM width: acceptance not comparable, speed is)"
            lines.append(f"  reference {r.name}: built in{width}")
        elif r.folder is not None:
            lines.append(f"  reference {r.name}: drafter folder {r.folder}")
        else:
            lines.append(f"  reference {r.name}: NOT HERE YET - the bench job will refuse to start. {r.missing}")
    return "\n".join(lines)
