"""Several processes (torchrun): each trains every world-th batch of the epoch's order (padded so all ranks
step together, like DistributedSampler), DDP averages gradients, evaluation sums are all-reduced, and only
rank 0 writes files. Without WORLD_SIZE > 1 nothing here does anything. Also the torchrun command the
drafter rule runs when its job has several GPUs.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from aerie.drafter.config import TrainConfig


def shard_for_rank(groups: list, rank: int, world: int) -> list:
    """This rank's share of a batch order: every world-th batch, the order padded by wrapping around so that
    every rank gets the same number (DistributedSampler's rule: DDP ranks must step together)."""
    if world == 1:
        return list(groups)
    per_rank = math.ceil(len(groups) / world)
    padded = [groups[i % len(groups)] for i in range(per_rank * world)] if groups else []
    return padded[rank::world]


@dataclass
class Dist:
    """This process's place in a torchrun job; rank 0 of 1 when started plainly."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, t: Tensor) -> Tensor:
        """All-reduce (sum) over ranks; the identity in a single process."""
        if self.world == 1:
            return t
        x = t.to(self.device)
        torch.distributed.all_reduce(x)
        return x.to(t.device)

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier(**({"device_ids": [self.device.index]} if self.device.type == "cuda" else {}))


def setup_distributed(cfg: TrainConfig) -> Dist:
    """Join the torchrun job when WORLD_SIZE > 1 (NCCL on CUDA, gloo on CPU); else pick the device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    if world == 1:
        return Dist(device=torch.device(("cuda" if cuda else "cpu") if cfg.device == "auto" else cfg.device))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    return Dist(rank, world, device)


def processes_for(gpus: int, cfg: TrainConfig) -> int:
    """Training processes for a job granted ``gpus`` GPUs: one per visible GPU when there are several."""
    if gpus <= 1 or cfg.device == "cpu" or not torch.cuda.is_available():
        return 1
    return min(gpus, torch.cuda.device_count())


def torchrun_command(
    nproc: int,
    hidden_shards: Sequence[Path],
    vocab_path: Path,
    target_path: Path,
    out_dir: Path,
    cfg: TrainConfig,
    python: str = sys.executable,
    layer_ids: Sequence[int] | None = None,
) -> list[str]:
    """``torchrun --standalone --nproc_per_node=N -m aerie.drafter.cli ...`` (as python -m torch.distributed.run,
    so it runs under the same interpreter)."""
    return [
        python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "aerie.drafter.cli",
        "--hidden", *[str(x) for x in hidden_shards],
        "--vocab", str(vocab_path),
        "--target", str(target_path),
        "--out", str(out_dir),
        "--config", json.dumps(cfg.section()),
        *(["--layer-ids", json.dumps(list(layer_ids))] if layer_ids is not None else []),
    ]  # fmt: skip
