"""Rule drafter: train the EAGLE-3 drafter on all hidden shards and export it for SGLang.

With ``resources.gpu`` = G > 1 and at least two GPUs visible, training runs as torchrun processes (one per
GPU, DDP) started from here; otherwise in this process. Either way a killed job resumes where its last
checkpoint left off (results/drafter/.{run}.train_state/, see aerie.drafter.train).
"""

from aerie.gpu_slots import acquire_rule_gpus
from aerie.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
# First, before torch is imported: this job's own GPUs (CUDA_VISIBLE_DEVICES), or a clear failure when
# Snakemake granted fewer than the rule needs; a no-op without GPUs.
acquire_rule_gpus(snakemake, log)

import os  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

from aerie.drafter.train import (  # noqa: E402
    TrainConfig,
    processes_for,
    target_num_hidden_layers,
    torchrun_command,
    train_drafter,
)
from aerie.capture import target_architectures  # noqa: E402
from aerie.hidden import resolve_aux_layer_ids  # noqa: E402
from aerie.rulelog import snakemake_threads  # noqa: E402

cfg = TrainConfig(**{"threads": snakemake_threads(snakemake), **(snakemake.params.drafter or {})})
inputs = (
    [Path(p) for p in snakemake.input.hidden],
    Path(snakemake.input.vocab),
    Path(snakemake.params.target),
    Path(snakemake.output[0]),
)
# The configured aux layers (null: SGLang's default for the target's depth); training refuses shards captured
# at other layers or from a target of another depth, and an export naming other layers.
aux_layer_ids = resolve_aux_layer_ids(snakemake.params.aux_layer_ids, target_num_hidden_layers(inputs[2]),
                                      target_architectures(inputs[2]))
nproc = processes_for(int(getattr(snakemake.resources, "gpu", 0) or 0), cfg)
if nproc > 1:
    cfg = replace(cfg, threads=max(1, cfg.threads // nproc))  # the job's cores, shared by the processes
    cmd = torchrun_command(nproc, *inputs, cfg, aux_layer_ids=aux_layer_ids)
    log(f"drafter: {nproc} processes: {shlex.join(cmd)}")
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads)}
    with open(snakemake.log[0], "a", buffering=1) as out:  # the processes' output goes to the rule log
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        for sig in (signal.SIGTERM, signal.SIGINT):  # a cancelled job stops torchrun too (it tells its workers)
            signal.signal(sig, lambda signum, _frame: proc.send_signal(signum))
        rc = proc.wait()
    if rc != 0:
        raise SystemExit(f"torchrun exited with status {rc}; see {snakemake.log[0]}")
else:
    train_drafter(*inputs, cfg, log=log, aux_layer_ids=aux_layer_ids)
