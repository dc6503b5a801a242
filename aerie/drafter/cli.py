"""Starting drafter training: the drafter rule's job (one process, or torchrun over its GPUs) and the command
line torchrun starts on every rank (``python -m aerie.drafter.cli``, installed as ``aerie-train-drafter``)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from aerie.drafter import distributed
from aerie.drafter.config import TrainConfig
from aerie.drafter.loop import train_drafter
from aerie.drafter_kinds.kind import TargetView
from aerie.target_model.config import (
    read_text_config,
    target_architectures,
)


def drafter_layer_ids(cfg: TrainConfig, target_path: Path, configured_aux_layer_ids: Sequence[int] | None) -> list[int]:
    """The target layers the drafter reads: its kind's choice for this target (EAGLE-3: hidden.aux_layer_ids, null
    meaning SGLang's default; DFlash: drafter.target_layer_ids, else SGLang's default), refused unless SGLang
    captures and serves exactly them."""
    target = TargetView(read_text_config(target_path), tuple(target_architectures(target_path)))
    return cfg.drafter_kind.capture_layer_ids(cfg.kind_settings, target, configured_aux_layer_ids)


def run_training_job(
    hidden_shards: Sequence[Path],
    vocab_path: Path | None,
    target_path: Path,
    out_dir: Path,
    cfg: TrainConfig,
    *,
    gpus: int,
    configured_aux_layer_ids: Sequence[int] | None,
    log: Callable[[str], None],
    log_path: Path,
) -> None:
    """The drafter rule's work: resolve the layers the drafter reads (``drafter_layer_ids``), then train in this
    process, or - with ``gpus`` > 1 and that many visible - as torchrun processes (one per GPU, DDP) whose output goes
    to ``log_path``. Training refuses shards without those layers or from a target of another depth. Either way a
    killed job resumes where its last checkpoint left off (aerie.drafter.state)."""
    layer_ids = drafter_layer_ids(cfg, target_path, configured_aux_layer_ids)
    inputs = (list(hidden_shards), vocab_path, target_path, out_dir)
    nproc = distributed.processes_for(gpus, cfg)
    if nproc <= 1:
        train_drafter(*inputs, cfg, log=log, layer_ids=layer_ids)
        return
    cfg = cfg.replace(threads=max(1, cfg.threads // nproc))  # the job's cores, shared by the processes
    cmd = distributed.torchrun_command(nproc, *inputs, cfg, layer_ids=layer_ids)
    log(f"drafter: {nproc} processes: {shlex.join(cmd)}")
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads)}
    with open(log_path, "a", buffering=1) as out:  # the processes' output goes to the rule log
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        for sig in (signal.SIGTERM, signal.SIGINT):  # a cancelled job stops torchrun too (it tells its workers)
            signal.signal(sig, lambda signum, _frame: proc.send_signal(signum))
        rc = proc.wait()
    if rc != 0:
        raise SystemExit(f"torchrun exited with status {rc}; see {log_path}")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="aerie-train-drafter", description="Train a drafter (any kind: --config kind).")
    ap.add_argument("--hidden", nargs="+", required=True, help="aerie.hidden/2 shards")
    ap.add_argument("--vocab", default=None, help="aerie.draft-vocab/1 file (kinds with a draft vocabulary: eagle3)")
    ap.add_argument("--target", required=True, help="the target's save_pretrained folder")
    ap.add_argument("--out", required=True, help="output folder for the drafter")
    ap.add_argument("--config", default="{}", help="the drafter section as JSON (its kind, every key)")
    ap.add_argument(
        "--aux-layer-ids", default=None, help="hidden.aux_layer_ids as JSON (EAGLE-3: resolved as the rule does)"
    )
    ap.add_argument("--layer-ids", default=None, help="the layers the drafter reads, resolved (torchrun's ranks)")
    args = ap.parse_args(argv)
    cfg = TrainConfig.of(json.loads(args.config))

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    try:
        # By hand as in the rule: layers SGLang would not serve (a DeepSeek/Kimi target's 0) are refused first;
        # without any, training takes the shards' own (checked when they were captured).
        ids = json.loads(args.layer_ids) if args.layer_ids else None
        if ids is None and args.aux_layer_ids:
            try:
                ids = drafter_layer_ids(cfg, Path(args.target), json.loads(args.aux_layer_ids))
            except ValueError as e:
                raise SystemExit(f"aerie-train-drafter --aux-layer-ids: {e}") from None
        train_drafter(
            [Path(x) for x in args.hidden],
            Path(args.vocab) if args.vocab else None,
            Path(args.target),
            Path(args.out),
            cfg,
            log=log,
            layer_ids=ids,
        )
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def exit_now() -> None:
    """A torchrun rank that finished (the drafter is written, the group destroyed) leaves without the interpreter's
    teardown: there gloo's worker threads can abort the process (SIGABRT, "terminate called without an active
    exception", seen once in CI on CPU), which made torchrun fail a job whose work was done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a torchrun rank (python -m aerie.drafter.cli)
        exit_now()
