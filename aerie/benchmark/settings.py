"""The bench rule's settings: which backend measures, which references it runs, which sets, checked at parse time.

``bench.backend``: ``inprocess`` decodes with the target in the job's own Python (``aerie.benchmark.run``; the target
must fit the job's GPUs, ``aerie.target_model.placement``), ``sglang`` has SGLang serve it (``aerie.benchmark.serving``,
the serving harness: the baseline, each trained drafter's and each reference's server in turn, config ``sglang:``).
Both write the same report and pass the same gate (``aerie.benchmark.gate``).

``bench.references``: what every trained drafter of the run is measured against in the same run, on the same
prompts, with the same settings (aerie.benchmark.methods). Built in: ``untrained`` (each trained drafter as training
starts it; in-process only), ``ngram`` (prompt lookup at the chain width: in-process ``num_draft_steps`` drafts, under
SGLang its NGRAM algorithm with ``speculative_num_draft_tokens`` and a breadth of 1), ``ngram_default`` (SGLang's
NGRAM at its own defaults: 12 draft tokens, breadth 10; labelled so). Anything else names a drafter folder of any kind
aerie reads (EAGLE-3, DFlash: its config.json's architecture says which): a path (relative to the workflow's
directory) or a Hub repo id already in the Hugging Face cache (``lightseekorg/kimi-k2.5-eagle3``,
``z-lab/Kimi-K2.5-DFlash``), served like a trained drafter of its kind (SGLang: its kind's flags; in-process: its
kind's reader and drafting). A folder that is here and does not fit the target is refused at parse time, naming it;
one that is not here yet is named in the dry run and refused by the bench job before any server starts.

``bench.sets``: benchmark sets besides the datasets' held-out prompts (the published cards' MT-Bench, GSM8K test,
HumanEval): :mod:`aerie.prompts.bench_sets`.

Torch-free: imported while Snakemake parses the workflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aerie.benchmark.gate import Gate
from aerie.benchmark.methods import BASELINE, BUILTIN_ROLES, DRAFTER, NGRAM_DEFAULT, UNTRAINED, folder_kind
from aerie.drafter_kinds.folders import resolve_drafter_folder
from aerie.drafter_kinds.kind import TargetView
from aerie.formats.backends import backend_named
from aerie.target_model.config import architectures, read_config, read_described_config, text_config

# Built-in references each backend can run, and its default set (config bench.references absent).
BUILTIN_REFERENCES = {"inprocess": ("untrained", "ngram"), "sglang": ("ngram", "ngram_default")}
DEFAULT_REFERENCES = {"inprocess": ("untrained", "ngram"), "sglang": ("ngram",)}
# Names a reference drafter folder cannot take: they are the report's own methods.
RESERVED_NAMES = (BASELINE, *BUILTIN_ROLES)
BUILTIN_NOTES = {  # the dry run's word on a built-in reference
    UNTRAINED: " (each trained drafter's twin as training starts it)",
    NGRAM_DEFAULT: " (SGLang's own NGRAM width: acceptance not comparable, speed is)",
}


@dataclass(frozen=True)
class Reference:
    """One reference of a run: its report name, role (a built-in name or ``drafter``) and, for a drafter, the
    folder it resolved to (None while it is not here)."""

    name: str
    role: str
    folder: Path | None = None
    missing: str | None = None  # why the folder was not found (the hint to fetch it)


@dataclass(frozen=True)
class TargetLoad:
    """How a job loads the target (``target.*``): its folder, device, dtype and whether its own code may run."""

    path: Path
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False

    @classmethod
    def of(cls, target: Mapping[str, Any]) -> TargetLoad:
        return cls(
            Path(target["path"]),
            str(target.get("device", "auto")),
            str(target.get("dtype", "auto")),
            bool(target.get("trust_remote_code", False)),
        )


@dataclass(frozen=True)
class BenchRun:
    """How the benchmark decodes every method, the same for each (``bench.*``): ``max_new_tokens`` greedy tokens
    per prompt; ``num_draft_steps`` the chain width (EAGLE-3, prompt lookup; a DFlash drafter drafts its block);
    ``repeats`` timed runs of each method per prompt after ``warmup`` untimed rounds; the first ``max_prompts`` of
    each set; ``threads`` torch threads (None: torch's own); ``references`` each reference's name (a built-in role or
    a drafter folder's name); ``chat_template_kwargs`` for rendering every prompt."""

    max_new_tokens: int
    num_draft_steps: int = 3
    repeats: int = 1
    warmup: int = 1
    max_prompts: int | None = None
    threads: int | None = None
    references: tuple[str, ...] = DEFAULT_REFERENCES["inprocess"]
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"bench.repeats must be >= 1, got {self.repeats}")
        object.__setattr__(self, "references", tuple(self.references))
        object.__setattr__(self, "chat_template_kwargs", dict(self.chat_template_kwargs or {}))


@dataclass(frozen=True)
class BenchSettings:
    """``bench.*`` resolved once by the plan (aerie.plan.resolve.bench_settings): the backend that measures, how it
    decodes (its references as configured: built-in roles and drafter folder specs, resolved by the job once the
    folders are here), and the gate (``bench.gate`` with ``bench.traffic``)."""

    backend: str
    run: BenchRun
    gate: Gate

    @classmethod
    def of(cls, bench: Mapping[str, Any]) -> BenchSettings:
        """From a validated config's ``bench`` section (the schema's defaults filled)."""
        run = BenchRun(
            max_new_tokens=int(bench["max_new_tokens"]),
            num_draft_steps=int(bench["num_draft_steps"]),
            repeats=int(bench["repeats"]),
            warmup=int(bench["warmup"]),
            max_prompts=bench.get("max_prompts"),
            threads=bench.get("threads"),
            references=tuple(bench_references(bench)),
            chat_template_kwargs=bench.get("chat_template_kwargs") or {},
        )
        gate = Gate(**bench.get("gate", {}), traffic=dict(bench.get("traffic") or {}))
        return cls(backend_named("bench", bench.get("backend")).name, run, gate)

    def as_config(self) -> dict[str, Any]:
        """The ``bench`` keys the references' checks read (aerie.benchmark.settings.check_references)."""
        return {"backend": self.backend, "references": list(self.run.references)}


def bench_references(bench: Mapping[str, Any]) -> list[str]:
    """The references of this run as configured: ``bench.references``, or the backend's default set."""
    backend = backend_named("bench", bench.get("backend")).name
    refs = bench.get("references")
    return list(DEFAULT_REFERENCES[backend] if refs is None else refs)


def resolve_reference_folder(spec: str, base: Path | None) -> tuple[Path | None, str | None]:
    """(the folder a reference names, None) or (None, why it is not here): a path from ``base`` or a Hub repo id in
    the offline Hugging Face cache."""
    try:
        return resolve_drafter_folder(spec, base), None
    except FileNotFoundError as e:
        return None, str(e)


def resolve_references(bench: Mapping[str, Any], base: Path | None = None) -> list[Reference]:
    """Every reference of the run, drafter folders resolved (offline) from ``base`` (the workflow's directory)."""
    backend = backend_named("bench", bench.get("backend")).name
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
            out.append(Reference(spec, DRAFTER, folder, missing))
    names = [r.name for r in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"bench.references names {', '.join(dupes)} twice")
    return out


def target_dimensions(config: Mapping[str, Any]) -> dict[str, Any]:
    """What parse time knows of the target: ``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
    ``architectures`` (each only when known: the folder's config.json, else target.config_json, else the config's
    own target keys)."""
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
    by its kind (the architecture its config.json names), which checks its tensors and its fit to the target
    (``DrafterKind.reference_problems``)."""
    try:
        kind, _ = folder_kind(folder)
    except ValueError as e:  # no config.json, or an architecture no kind reads
        return [str(e)]
    text = {k: v for k, v in dims.items() if k != "architectures"}
    # A TargetView reads the target's vocab, width and depth: with one unknown (no config.json yet) the folder is
    # checked on its own here, and against the target by the bench job, which checks again once the target is here.
    complete = all(k in text for k in ("vocab_size", "hidden_size", "num_hidden_layers"))
    target = TargetView(text, tuple(dims.get("architectures") or ())) if complete else None
    return kind.reference_problems(folder, target)


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
