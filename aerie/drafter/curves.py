"""Training curves where users look: every train_log.jsonl event as TensorBoard scalars (and W&B when asked).

While training runs the event files live in the training state (``results/drafter/.{run}.train_state/tensorboard``,
so a resumed run continues them: TensorBoard's ``purge_step`` drops what the interrupted attempt wrote after its
checkpoint); the finished drafter folder carries them in ``tensorboard/`` (the Hub shows such a folder's curves on
the model page). Watch a run live with ``tensorboard --logdir results/drafter``.

Tags (TTT position k = draft step k of the unroll, 0 first), all on the optimizer-step axis:
  per logged step:  train/loss, train/lr, train/grad_norm, train/tokens_per_s, train/loss_per_position/k,
                    train/top1_match_per_position/k
  per epoch, at the step it ended (step 0: the untrained drafter): heldout/acceptance_length, heldout/loss,
                    heldout/acceptance_per_position/k, heldout/loss_per_position/k, heldout/top1_match_per_position/k,
                    epoch/epoch, and epoch/train_loss, epoch/train_top1_match_per_position/k (means of its logged steps)
``top1_match_per_position``: how often the draft's top token is the target's at position k with the context teacher-
forced (each position alone); ``acceptance_per_position``: how often a chain of drafts is still accepted at k
(conditional on every earlier draft): two different figures, two different names. A custom-scalars layout puts each
per-position family on one chart. One axis for both keeps a resumed run's
purge exact and the held-out points on the training curves they belong to.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

CURVES_DIR = "tensorboard"

# eval event key -> TensorBoard tag (lists get one tag per TTT position)
_HELDOUT = {
    "simulated_acceptance_length": "heldout/acceptance_length",
    "heldout_loss": "heldout/loss",
    "acceptance_per_position": "heldout/acceptance_per_position",
    "heldout_loss_per_step": "heldout/loss_per_position",
    "heldout_accuracy_per_step": "heldout/top1_match_per_position",
}
_TRAIN = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens_per_s": "train/tokens_per_s"}


class TrainCurves:
    """Writes the curves of one training run (rank 0 only; see the module for the tags)."""

    def __init__(
        self,
        logdir: Path,
        *,
        resume_step: int | None = None,
        tensorboard: bool = True,
        wandb_project: str = "",
        run_name: str = "",
        config: dict[str, Any] | None = None,
    ):
        self.logdir = Path(logdir)
        # resumed: events from the interrupted attempt past its checkpoint are dropped, then written again
        purge = resume_step + 1 if resume_step is not None else None
        self._tb = SummaryWriter(str(self.logdir), purge_step=purge, flush_secs=20) if tensorboard else None
        self._wandb = _open_wandb(wandb_project, run_name, config, self.logdir) if wandb_project else None
        self._epoch_train: list[dict[str, Any]] = []
        self._step = resume_step or 0
        self._layout_written = False

    def add(self, event: dict[str, Any]) -> None:
        """One train_log.jsonl event (``train`` and ``eval`` events make curves; others are ignored)."""
        kind = event.get("event")
        if kind == "train":
            self._train(event)
        elif kind == "eval":
            self._eval(event)

    def _train(self, event: dict[str, Any]) -> None:
        step = int(event["step"])
        self._step = step
        scalars = {tag: event.get(key) for key, tag in _TRAIN.items()}
        scalars |= _per_position("train/loss_per_position", event.get("loss_per_step"))
        scalars |= _per_position("train/top1_match_per_position", event.get("acc_per_step"))
        self._write(scalars, step)
        self._layout(len(event.get("acc_per_step") or []))
        self._epoch_train.append(event)

    def _eval(self, event: dict[str, Any]) -> None:
        epoch = int(event["epoch"])
        scalars: dict[str, Any] = {}
        for key, tag in _HELDOUT.items():
            value = event.get(key)
            scalars |= _per_position(tag, value) if isinstance(value, list) else {tag: value}
        logged = [e for e in self._epoch_train if e.get("epoch") == epoch]
        if logged:  # the epoch's training figures: means of its logged steps
            scalars["epoch/train_loss"] = sum(e["loss"] for e in logged) / len(logged)
            positions = min(len(e.get("acc_per_step") or []) for e in logged)
            scalars |= _per_position(
                "epoch/train_top1_match_per_position",
                [sum(e["acc_per_step"][k] for e in logged) / len(logged) for k in range(positions)],
            )
        self._epoch_train = [e for e in self._epoch_train if e.get("epoch") != epoch]
        scalars["epoch/epoch"] = epoch
        self._write(scalars, self._step)
        if self._tb is not None:
            self._tb.flush()

    def _write(self, scalars: dict[str, Any], step: int) -> None:
        numbers = {
            tag: float(v) for tag, v in scalars.items() if isinstance(v, int | float) and not isinstance(v, bool)
        }
        for tag, value in numbers.items() if self._tb is not None else ():
            self._tb.add_scalar(tag, value, step)
        if self._wandb is not None and numbers:
            self._wandb.log(numbers, step=step)

    def _layout(self, positions: int) -> None:
        if self._layout_written or not positions or self._tb is None:
            return
        family = lambda prefix: [f"{prefix}/{k}" for k in range(positions)]  # noqa: E731
        self._tb.add_custom_scalars(
            {
                "per TTT position (per step)": {
                    "train loss": ["Multiline", family("train/loss_per_position")],
                    "train top-1 match": ["Multiline", family("train/top1_match_per_position")],
                },
                "per TTT position (per epoch)": {
                    "held-out acceptance": ["Multiline", family("heldout/acceptance_per_position")],
                    "held-out loss": ["Multiline", family("heldout/loss_per_position")],
                    "train top-1 match (epoch mean)": ["Multiline", family("epoch/train_top1_match_per_position")],
                },
            }
        )
        self._layout_written = True

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _per_position(prefix: str, values: list[float] | None) -> dict[str, float]:
    return {f"{prefix}/{k}": v for k, v in enumerate(values or [])}


def _open_wandb(project: str, run_name: str, config: dict[str, Any] | None, logdir: Path) -> Any:
    try:
        import wandb
    except ImportError:
        raise ValueError(
            f"drafter.wandb_project is {project!r} but the wandb package is not installed "
            "(pip install wandb; TensorBoard curves need nothing)"
        ) from None
    return wandb.init(project=project, name=run_name or None, config=config, dir=str(logdir.parent), resume="allow")


def open_curves(state_dir: Path, cfg: Any, *, enabled: bool, resume_step: int | None) -> TrainCurves | None:
    """The run's curves writer, or None (not rank 0, or ``drafter.tensorboard: false`` without W&B)."""
    if not enabled or not (cfg.tensorboard or cfg.wandb_project):
        return None
    return TrainCurves(
        Path(state_dir) / CURVES_DIR,
        resume_step=resume_step,
        tensorboard=cfg.tensorboard,
        wandb_project=cfg.wandb_project,
        run_name=Path(state_dir).name.removeprefix(".").removesuffix(".train_state"),  # the run: "demo"
        config=cfg.section(),
    )


def publish_curves(state_dir: Path, out_dir: Path) -> None:
    """Move the finished run's event files into the drafter folder (``out_dir/tensorboard/``)."""
    src = Path(state_dir) / CURVES_DIR
    if not src.is_dir():
        return
    dest = Path(out_dir) / CURVES_DIR
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest)
    shutil.rmtree(src, ignore_errors=True)


def read_curves(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files under ``logdir``: tag -> [(step, value)] (tests, the report)."""
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
