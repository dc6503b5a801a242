"""The methods of one benchmark run: every trained drafter of the run and every reference, each with its role, its
drafter kind and its draft width. Both backends measure this list, and the gate, the plots, the report and the model
card read it back from the report (``aerie.bench/4``, docs/formats.md).

Roles:
- ``trained``: a drafter this run trained (``results/drafter/{name}``), named by its drafter name (the run's name for
  a run with one drafter, ``{run}-{key}`` for each entry of ``drafters``);
- ``untrained``: a trained drafter's twin exactly as training starts it (in-process only): its kind builds it from
  scratch (same shape and seed), or, for a warm start, it is the ``drafter.init`` folder the trained folder records
  (its ``folder``); named ``untrained`` when the run trains one drafter and ``untrained:{drafter}`` when it trains
  several;
- ``ngram`` (prompt lookup at the chain width: in-process ``bench.num_draft_steps`` drafts, under SGLang its NGRAM at
  ``sglang.speculative_num_draft_tokens``), ``ngram_default`` (SGLang's NGRAM at its own defaults);
- ``drafter``: a reference drafter folder (any tool's, any kind aerie reads: ``kind_of_folder``), named as
  ``bench.references`` names it.

A method's draft width (``draft_tokens``) is what it proposes per verify step: its kind says it for drafters
(EAGLE-3 chains ``num_draft_steps``, DFlash drafts ``block_size - 1``). Acceptance lengths are compared only between
methods of the same width; speed always.

Torch-free: the dry run and SGLang's environment read it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aerie.drafter_kinds import kind_of_folder
from aerie.drafter_kinds.folders import read_folder_config, warm_start_of
from aerie.drafter_kinds.kind import DrafterKind

TRAINED, UNTRAINED, NGRAM, NGRAM_DEFAULT, DRAFTER = "trained", "untrained", "ngram", "ngram_default", "drafter"
ROLES = (TRAINED, UNTRAINED, NGRAM, NGRAM_DEFAULT, DRAFTER)
BUILTIN_ROLES = (UNTRAINED, NGRAM, NGRAM_DEFAULT)  # references bench.references names by their role
BASELINE = "baseline"  # the no-drafter run every method is measured against; no method may take its name


@dataclass(frozen=True)
class Method:
    """One speculative method of a run (module docstring)."""

    name: str
    role: str
    kind: str | None  # the drafter kind (aerie.drafter_kinds) of a drafter method; None for prompt lookup
    draft_tokens: int  # drafts proposed per verify step
    folder: Path | None = None  # a drafter folder (trained or reference)
    twin_of: str | None = None  # an untrained twin: the trained drafter it is the twin of

    def describe(self) -> dict[str, Any]:
        """What the report says of the method beside its figures."""
        return {
            "role": self.role,
            "kind": self.kind,
            "draft_tokens": self.draft_tokens,
            "folder": str(self.folder) if self.folder is not None else None,
            "twin_of": self.twin_of,
        }


def folder_kind(folder: str | Path) -> tuple[DrafterKind, dict[str, Any]]:
    """(the kind of a drafter folder, its config.json): the kind whose SGLang architecture config.json names."""
    config = read_folder_config(Path(folder))
    return kind_of_folder(config, where=str(folder)), config


def folder_draft_tokens(folder: str | Path, kind: DrafterKind, num_draft_steps: int) -> int:
    """Drafts per verify step of the drafter in ``folder``: its kind's width, with the settings the folder fixes
    (a DFlash block size) and ``num_draft_steps`` for a chain."""
    settings = kind.settings_from_folder(kind.settings({}), Path(folder))
    return int(kind.draft_tokens(settings, num_draft_steps))


def untrained_name(drafter: str, trained: int) -> str:
    """The untrained twin's method name: ``untrained`` beside one trained drafter, ``untrained:{drafter}`` beside
    several (the report stays unambiguous)."""
    return UNTRAINED if trained == 1 else f"{UNTRAINED}:{drafter}"


def drafter_method(name: str, role: str, folder: Path, num_draft_steps: int) -> Method:
    """A drafter folder as a method, read by its kind."""
    kind, _ = folder_kind(folder)
    return Method(name, role, kind.name, folder_draft_tokens(folder, kind, num_draft_steps), Path(folder))


def bench_methods(
    drafters: Mapping[str, Path],
    references: Sequence[str],
    folders: Mapping[str, Path],
    *,
    num_draft_steps: int,
    ngram_draft_tokens: int,
    ngram_default_draft_tokens: int | None = None,
) -> dict[str, Method]:
    """Every method of a run, in the order they are measured and reported: the trained drafters (``drafters``: name
    -> folder, in the run's order), then each reference as ``references`` lists them (``untrained``: one twin per
    trained drafter; a name in ``folders``: that drafter folder). ValueError when no drafter is given, a reference
    is unknown or two methods would share a name."""
    if not drafters:
        raise ValueError("the benchmark needs at least one trained drafter")
    methods: dict[str, Method] = {}

    def add(method: Method) -> None:
        if method.name in methods or method.name == BASELINE:
            raise ValueError(
                f"two methods of the benchmark would be named {method.name!r}: rename the run, the drafters entry or "
                "the reference"
            )
        methods[method.name] = method

    for name, folder in drafters.items():
        add(drafter_method(name, TRAINED, Path(folder), num_draft_steps))
    trained = list(methods.values())
    for ref in references:
        if ref in folders:
            add(drafter_method(ref, DRAFTER, Path(folders[ref]), num_draft_steps))
        elif ref == UNTRAINED:
            for d in trained:
                start = warm_start_of(d.folder, base=Path.cwd()) if d.folder is not None else None
                add(Method(untrained_name(d.name, len(trained)), UNTRAINED, d.kind, d.draft_tokens, start, d.name))
        elif ref == NGRAM:
            add(Method(NGRAM, NGRAM, None, ngram_draft_tokens))
        elif ref == NGRAM_DEFAULT and ngram_default_draft_tokens is not None:
            add(Method(NGRAM_DEFAULT, NGRAM_DEFAULT, None, ngram_default_draft_tokens))
        else:
            raise ValueError(f"unknown reference {ref!r} (built in: {', '.join(BUILTIN_ROLES)}; or a drafter folder)")
    return methods


def trained_drafters(methods: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The trained drafters among a report's ``methods``, in order."""
    return [m for m, v in methods.items() if v.get("role") == TRAINED]


def references_of(methods: Mapping[str, Mapping[str, Any]], drafter: str) -> list[str]:
    """The references a trained drafter is judged against: every method but the trained drafters and the untrained
    twins of its siblings (a drafter is not judged against another one this run trained)."""
    return [
        m
        for m, v in methods.items()
        if v.get("role") != TRAINED and (v.get("role") != UNTRAINED or v.get("twin_of") in (None, drafter))
    ]
