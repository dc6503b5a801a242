"""Training state for exact resume, kept beside the output (Snakemake deletes a failed job's declared output).

``train_state_dir(out_dir)`` = ``results/drafter/.{run}.train_state/`` holds ``state.pt`` (drafter weights
without the frozen embeddings, AdamW state, schedule step, epoch and position in its batch order, counters,
eval history, RNG states, the config and a fingerprint of the data; written atomically every
``checkpoint_every`` steps and after each epoch), ``train_log.jsonl.partial``, and ``last/`` / ``best/``
exports. A restarted run with the same data and config continues from state.pt and ends with the same
weights as an uninterrupted one (exactly, on CPU); a state of other data or settings is refused by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from aerie.drafter.config import RESUME_MAY_CHANGE, TrainConfig
from aerie.drafter.curves import TrainCurves
from aerie.tools.artifacts import atomic_publish
from aerie.tools.progress import JobProgress

try:
    import numpy as np
except ImportError:  # numpy is optional: its RNG state is saved only when it is there
    np = None


STATE_FORMAT = "aerie.drafter-train-state/1"


def train_state_dir(out_dir: Path) -> Path:
    """Where the resumable state of ``out_dir`` lives: beside it (results/drafter/.{run}.train_state), so it
    survives Snakemake deleting the declared output of a failed job."""
    out_dir = Path(out_dir)
    return out_dir.parent / f".{out_dir.name}.train_state"


@dataclass
class Progress:
    """Where training stands: what a resume restores besides weights, optimizer and RNG."""

    epoch: int = 1  # the epoch in progress (epochs + 1 once all are done)
    position: int = 0  # batches of this epoch's order (this rank's share) already trained
    step: int = 0  # optimizer steps so far: the LR schedule's state
    tokens: int = 0  # real rows trained, all ranks
    supervised: int = 0  # step-0 rows that carried loss, all ranks
    train_seconds: float = 0.0
    seconds: float = 0.0  # wall time of the run so far, earlier (killed) attempts included
    log_bytes: int = 0  # length of the partial train log at this checkpoint
    untrained: dict = field(default_factory=dict)  # held-out eval before training
    epochs: list = field(default_factory=list)  # held-out eval after each epoch: {"epoch": e, **eval}
    best_epoch: int = 0
    best_acceptance: float | None = None


def _safetensors_header_sha(path: Path) -> str:
    """sha256 of a safetensors header (tensor names, shapes, offsets, metadata such as sample ids)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return hashlib.sha256(f.read(n)).hexdigest()[:16]


def data_fingerprint(
    hidden_shards: Sequence[Path], vocab_path: Path | None, target_path: Path, layer_ids: list[int]
) -> dict:
    """What the training data is: shard paths, sizes and header hashes, the draft vocab (None: the kind has none),
    the target, the layers the drafter reads."""

    def file(p):
        return [str(p), os.path.getsize(p), _safetensors_header_sha(Path(p))]

    return {
        "hidden_shards": [file(p) for p in hidden_shards],
        "draft_vocab": file(vocab_path) if vocab_path is not None else None,
        "target": str(target_path),
        "aux_layer_ids": list(layer_ids),
    }


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(v if not isinstance(v, list) else tuple(v) for v in state["python"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if np is not None and "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def save_train_state(
    path: Path,
    model: nn.Module,
    opt,
    progress: Progress,
    cfg: TrainConfig,
    fingerprint: dict,
    world: int,
    total_steps: int,
    frozen: Sequence[str] = (),
) -> None:
    """Everything a resume needs, in one atomically replaced file. The drafter's ``frozen`` tensors (the target's
    embeddings an EAGLE-3 drafter holds) are left out: the resumed run reads them from the target again (they are
    the biggest tensor: 4.7 GB fp32 for Kimi)."""
    state = {
        "format": STATE_FORMAT,
        "config": cfg.section(),
        "fingerprint": fingerprint,
        "world_size": world,
        "model": {k: v for k, v in model.state_dict().items() if k not in frozen},
        "optimizer": opt.state_dict(),
        "scheduler": {"kind": "warmup-cosine (lr_at)", "step": progress.step, "total_steps": total_steps},
        "progress": asdict(progress),
        "rng": rng_state(),
    }
    atomic_publish(path, lambda p: torch.save(state, p))


def load_train_state(path: Path, cfg: TrainConfig, fingerprint: dict, world: int) -> dict | None:
    """The state at ``path`` when it was written for this data and these settings; None when there is none.
    Anything else is refused: mixing two runs' data or settings would give a drafter nobody asked for."""
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"{path}: format {state.get('format')!r}, expected {STATE_FORMAT!r}")
    problems = []
    saved = {k: v for k, v in state["config"].items() if k not in RESUME_MAY_CHANGE}
    now = {k: v for k, v in cfg.section().items() if k not in RESUME_MAY_CHANGE}
    for k in sorted(saved.keys() | now.keys()):
        if saved.get(k) != now.get(k):
            problems.append(f"drafter.{k} was {saved.get(k)!r}, is {now.get(k)!r}")
    for k in sorted(state["fingerprint"].keys() | fingerprint.keys()):
        if state["fingerprint"].get(k) != fingerprint.get(k):
            problems.append(f"{k} differ")
    if state["world_size"] != world:
        problems.append(f"it ran as {state['world_size']} processes, this run has {world}")
    if problems:
        raise ValueError(
            f"{path} holds the training state of another run ({'; '.join(problems)}); delete {path.parent} "
            "to start over, or set drafter.resume: false to overwrite it"
        )
    return state


def copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    atomic_publish(dst, lambda p: shutil.copyfile(src, p))


class TrainLog:
    """train_log.jsonl while training runs: kept beside out_dir as ``train_log.jsonl.partial``, one JSON event
    a line; a resumed run cuts it back to the length its checkpoint recorded. Only rank 0 writes (others
    get ``enabled=False`` and every call is a no-op)."""

    def __init__(
        self,
        path: Path,
        *,
        enabled: bool,
        resume_at: int | None,
        curves: TrainCurves | None = None,
        progress: JobProgress | None = None,
    ):
        self._file = None
        # every event also goes to the run's curves (TensorBoard, W&B); train events move the job's progress
        self._curves, self._progress = (curves, progress) if enabled else (None, None)
        if not enabled:
            return
        if resume_at is not None:
            self._file = path.open("a+")
            self._file.truncate(min(resume_at, self._file.seek(0, os.SEEK_END)))
            self._file.seek(0, os.SEEK_END)
        else:
            self._file = path.open("w")

    def write(self, event: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(event) + "\n")
            self._file.flush()
        if self._curves is not None:
            self._curves.add(event)
        if self._progress is not None and event.get("event") == "train":
            self._progress.postfix(loss=f"{event['loss']:.4f}", acc0=f"{(event.get('acc_per_step') or [0])[0]:.3f}")
            self._progress.set(event["step"])

    def tell(self) -> int:
        return self._file.tell() if self._file is not None else 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        for sink in (self._curves, self._progress):
            if sink is not None:
                sink.close()
        self._curves = self._progress = None
