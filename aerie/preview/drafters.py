"""The dry run's lines about the run's drafters: their kinds and warm-start folders."""

from __future__ import annotations

from pathlib import Path

from aerie.drafter_kinds.folders import resolve_drafter_folder
from aerie.plan.drafters import PlannedDrafter


def init_preview_text(drafter: PlannedDrafter, base: Path | None = None) -> str:
    """Where a drafter's warm-start folder is and what training takes from it, or where it looked for it."""
    train, where = drafter.train, ".".join(drafter.where)
    if drafter.init_folder is None:
        try:
            resolve_drafter_folder(train.init, base=base or Path.cwd())
            missing = "it could not be read"
        except FileNotFoundError as e:
            missing = str(e)
        return (
            f"aerie warm start ({drafter.name}): {where}.init {train.init!r} is NOT here - a real run refuses to start "
            f"until it is.\n  {missing}"
        )
    lines = train.drafter_kind.init_preview(drafter.init_folder, train.kind_settings)
    pull = f"; L2-SP pull toward its weights: init_pull {train.init_pull}" if train.init_pull else ""
    return (
        f"aerie warm start ({drafter.name}): {where}.init {train.init!r} -> {drafter.init_folder}\n"
        + "\n".join(f"  {line}" for line in lines)
        + pull
    )
