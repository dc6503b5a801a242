"""The backends of the two GPU stages that can run on SGLang (capture: ``hidden.backend``; benchmark:
``bench.backend``), as the config, the rules, the previews and the records (a shard's or a bench report's
``backend``) name them: the one place these names are compared.

What the workflow may ask of a backend without loading it: which software environment its job runs in and where
the config holds its own options. Running one is its stage's business (aerie.hidden.backends,
aerie.benchmark.job); the responses stage's backends are named in aerie.formats.responses and its API backends in
aerie.responses.api.backends. Torch-free: imported while Snakemake parses the workflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StageBackend:
    """One backend of one stage: ``setting`` is where the config names it, ``name`` its value there."""

    setting: str
    name: str
    in_sglang: bool  # the job imports SGLang: it runs in envs/sglang.yaml, on its own torch and transformers
    options_at: tuple[str, ...] = ()  # where the config holds the backend's own options (() when it has none)

    def options(self, config: Mapping[str, Any]) -> dict[str, Any] | None:
        """The backend's own options in the whole ``config`` (None: it takes none; {}: none set)."""
        if not self.options_at:
            return None
        section: Any = config
        for key in self.options_at:
            section = (section or {}).get(key)
        return dict(section or {})


HIDDEN_BACKENDS = {
    b.name: b
    for b in (
        StageBackend("hidden.backend", "hf", in_sglang=False),  # the target in the job's process (transformers)
        StageBackend("hidden.backend", "sglang", in_sglang=True, options_at=("hidden", "sglang")),
    )
}
BENCH_BACKENDS = {
    b.name: b
    for b in (
        StageBackend("bench.backend", "inprocess", in_sglang=False),  # aerie.benchmark.run, one process
        StageBackend("bench.backend", "sglang", in_sglang=True, options_at=("sglang",)),  # its servers
    )
}
# stage -> (its backends, the default when the config names none)
STAGE_BACKENDS = {"hidden": (HIDDEN_BACKENDS, "hf"), "bench": (BENCH_BACKENDS, "inprocess")}


def backend_named(stage: str, name: str | None) -> StageBackend:
    """``stage``'s backend called ``name`` (None: the stage's default), as the config or a record names it; a
    ValueError naming the setting when there is none such."""
    registry, default = STAGE_BACKENDS[stage]
    name = default if name is None else name
    try:
        return registry[name]
    except (KeyError, TypeError):
        raise ValueError(f"{stage}.backend: {name!r} is not one of {', '.join(registry)}") from None


def stage_backend(config: Mapping[str, Any], stage: str) -> StageBackend:
    """The backend ``config`` sets for ``stage`` (``hidden`` or ``bench``)."""
    return backend_named(stage, (config.get(stage) or {}).get("backend"))
