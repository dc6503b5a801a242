"""Drafter kinds: each one package here behind one interface (``aerie.drafter_kinds.kind.DrafterKind``).

- ``eagle3``: EAGLE-3, one decoder layer fed the target's aux layers, chained drafting, TTT training
  (``attention: llama | mla``);
- ``dflash``: DFlash, block diffusion: a few layers that draft a whole block in one forward from the target's
  features, trained on anchored blocks.

``kinds()`` finds them (each package's ``KIND``), ``kind_named(drafter.kind)`` and ``kind_of_folder(config.json)``
pick one. The drafter stage, the benchmark, the previews and the published folder reach a kind only through here.
Torch-free: parse time reads the registry.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from aerie.drafter_kinds.kind import DrafterKind

DEFAULT_KIND = "eagle3"


@functools.cache
def kinds() -> dict[str, DrafterKind]:
    """Every kind package of aerie.drafter_kinds, by name (imported for its torch-free ``KIND``)."""
    found: dict[str, DrafterKind] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.ispkg:
            kind = getattr(importlib.import_module(f"{__name__}.{info.name}"), "KIND", None)
            if isinstance(kind, DrafterKind):
                found[kind.name] = kind
    return found


def kind_named(name: str | None) -> DrafterKind:
    """The kind ``drafter.kind`` names (``eagle3`` when unset); ValueError naming the setting otherwise."""
    known = kinds()
    name = name or DEFAULT_KIND
    if name not in known:
        raise ValueError(f"drafter.kind {name!r} is not one of {', '.join(sorted(known))}")
    return known[name]


def kind_of_folder(config: Mapping[str, Any], where: str = "the drafter folder") -> DrafterKind:
    """The kind whose SGLang architecture a drafter folder's config.json names; ValueError naming what it says."""
    architectures = list(config.get("architectures") or [])
    if not architectures:  # EAGLE-3 folders of some tools name none: SGLang takes the class from the flag
        return kinds()[DEFAULT_KIND]
    for kind in kinds().values():
        if any(a in kind.architectures for a in architectures):
            return kind
    served = {a: k.name for k in kinds().values() for a in k.architectures}
    raise ValueError(
        f"{where}: config.json architectures {architectures} are none of the drafters aerie reads "
        f"({', '.join(f'{a} ({k})' for a, k in served.items())})"
    )
