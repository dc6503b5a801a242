"""Starting drafter training: the drafter rule's job (one process, or torchrun over its GPUs) and the command
line torchrun starts on every rank (``python -m aerie.drafter.cli``, installed as ``aerie-train-drafter``)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from aerie.drafter import distributed
from aerie.drafter.config import TrainConfig
from aerie.drafter.loop import train_drafter
from aerie.model_card import CardSettings, write_export_card
from aerie.target_model.config import resolve_aux_layer_ids, target_architectures, target_num_hidden_layers


def run_training_job(
    hidden_shards: Sequence[Path],
    vocab_path: Path,
    target_path: Path,
    out_dir: Path,
    cfg: TrainConfig,
    *,
    gpus: int,
    configured_aux_layer_ids: Sequence[int] | None,
    log: Callable[[str], None],
    log_path: Path,
    card: CardSettings | None = None,
    sglang: Mapping[str, Any] | None = None,
) -> None:
    """The drafter rule's work: resolve the aux layers, then train in this process, or - with ``gpus`` > 1 and
    that many visible - as torchrun processes (one per GPU, DDP) whose output goes to ``log_path``.

    The configured aux layers (null: SGLang's default for the target's depth) are checked against what SGLang
    serves; training refuses shards captured at other layers or from a target of another depth. Either way a
    killed job resumes where its last checkpoint left off (aerie.drafter.state). The exported folder gets its model
    card (README.md, aerie.model_card; ``card``: config section card, ``sglang``: the serve command's flags)."""
    aux_layer_ids = resolve_aux_layer_ids(
        configured_aux_layer_ids, target_num_hidden_layers(target_path), target_architectures(target_path)
    )
    inputs = (list(hidden_shards), vocab_path, target_path, out_dir)
    nproc = distributed.processes_for(gpus, cfg)
    if nproc <= 1:
        train_drafter(*inputs, cfg, log=log, aux_layer_ids=aux_layer_ids)
        write_export_card(out_dir, card or CardSettings(), str(target_path), hidden_shards, sglang)
        return
    cfg = replace(cfg, threads=max(1, cfg.threads // nproc))  # the job's cores, shared by the processes
    cmd = distributed.torchrun_command(nproc, *inputs, cfg, aux_layer_ids=aux_layer_ids)
    log(f"drafter: {nproc} processes: {shlex.join(cmd)}")
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads)}
    with open(log_path, "a", buffering=1) as out:  # the processes' output goes to the rule log
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        for sig in (signal.SIGTERM, signal.SIGINT):  # a cancelled job stops torchrun too (it tells its workers)
            signal.signal(sig, lambda signum, _frame: proc.send_signal(signum))
        rc = proc.wait()
    if rc != 0:
        raise SystemExit(f"torchrun exited with status {rc}; see {log_path}")
    write_export_card(out_dir, card or CardSettings(), str(target_path), hidden_shards, sglang)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="aerie-train-drafter", description="Train an EAGLE-3 drafter.")
    ap.add_argument("--hidden", nargs="+", required=True, help="aerie.hidden/2 shards")
    ap.add_argument("--vocab", required=True, help="aerie.draft-vocab/1 file")
    ap.add_argument("--target", required=True, help="the target's save_pretrained folder")
    ap.add_argument("--out", required=True, help="output folder for the drafter")
    ap.add_argument("--config", default="{}", help="TrainConfig fields as JSON")
    ap.add_argument(
        "--aux-layer-ids", default=None, help="the configured aux layer ids as JSON (checked against the shards)"
    )
    args = ap.parse_args(argv)
    cfg = TrainConfig(**json.loads(args.config))

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    try:
        ids = json.loads(args.aux_layer_ids) if args.aux_layer_ids else None
        # By hand as in the rule: ids SGLang would not serve (a DeepSeek/Kimi target's 0) are refused first; without
        # ids, training takes the shards' own (checked when they were captured).
        if ids is not None:
            try:
                layers, archs = target_num_hidden_layers(args.target), target_architectures(args.target)
                ids = resolve_aux_layer_ids(ids, layers, archs)
            except ValueError as e:
                raise SystemExit(f"aerie-train-drafter --aux-layer-ids: {e}") from None
        train_drafter(
            [Path(x) for x in args.hidden],
            Path(args.vocab),
            Path(args.target),
            Path(args.out),
            cfg,
            log=log,
            aux_layer_ids=ids,
        )
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
