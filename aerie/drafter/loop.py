"""``train_drafter``: the drafter's training loop, read top to bottom.

data (hidden shards, draft vocab, windows) -> a drafter of the run's kind around the target's heads -> AdamW ->
resume or start -> per epoch: batches through the kind's objective, checkpoints, held-out evaluation, ``last`` /
``best`` exports -> the best epoch's drafter, train_log.jsonl and eval.json published in ``out_dir``. Everything
kind-specific comes from the kind (aerie.drafter_kinds: its ``DrafterKind`` and its torch side).

Recipe: AdamW (betas 0.9/0.95, weight decay on matrices only), linear warmup then cosine decay to
``min_lr_ratio``, gradient clipping; bf16 autocast on GPU, plain fp32 on CPU (deterministic: the same run
gives bit-identical weights). ``out_dir`` (``results/drafter/{run}/``) is written once, at the end, in
SGLang's layout (config.json, model.safetensors) plus train_log.jsonl and eval.json.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from aerie.drafter.config import TrainConfig
from aerie.drafter.curves import open_curves, publish_curves
from aerie.drafter.data import (
    Window,
    balance_ranks,
    batch_cost,
    batches,
    derived_seed,
    epoch_batches,
    load_batch,
    padded_tokens,
    plan_windows,
    prefetched,
    real_tokens,
    split_heldout,
)
from aerie.drafter.distributed import Dist, setup_distributed, shard_for_rank
from aerie.drafter.replay import replay_count
from aerie.drafter.state import (
    Progress,
    TrainLog,
    copy_atomic,
    data_fingerprint,
    load_train_state,
    save_train_state,
    set_rng_state,
    train_state_dir,
)
from aerie.drafter.traffic import combine_heldout, dataset_of_shard, floor_message, heldout_halfwidth
from aerie.drafter.warm_start import StartPull
from aerie.drafter_kinds.batch import Batch
from aerie.drafter_kinds.kind import DrafterKind, TargetView, TrainingMemory
from aerie.formats.hidden import open_hidden_shards, shard_layer_columns
from aerie.formats.vocab import load_draft_vocab
from aerie.target_model.config import read_text_config, target_architectures, target_num_hidden_layers
from aerie.tools.artifacts import atomic_publish
from aerie.tools.progress import job_progress

EVAL_FORMAT = "aerie.drafter-eval/1"
# eval.json's ``untrained``: the start's figures (with a weighted choice, its parts and their weights too)
UNTRAINED_KEYS = (
    "simulated_acceptance_length",
    "acceptance_per_position",
    "heldout_loss",
    "heldout_start_positions",
    "by_dataset",
    "weights",
)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """The LR schedule (linear warmup, then cosine decay or constant): a function of the step, its whole state."""
    warmup = max(1, math.ceil(cfg.warmup_ratio * total))
    if step < warmup:
        return cfg.learning_rate * (step + 1) / warmup
    if cfg.lr_schedule == "constant":
        return cfg.learning_rate
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.learning_rate * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


@dataclass
class TrainingRun:
    """What the steps of one ``train_drafter`` call share: the settings, this process's place, the data, the
    drafter kind and its torch side, the drafter and the target's head, and where the run's files go."""

    cfg: TrainConfig
    dist: Dist
    log: Callable[[str], None]
    hidden_shards: list[Path]
    vocab_path: Path | None  # None: the kind has no draft vocabulary
    target_path: Path
    out_dir: Path
    shards: list
    layer_ids: list[int]  # the target layers the drafter reads (aerie's convention)
    layer_columns: list[int] | None  # where they sit among the shards' captured layers (None: all, in order)
    kind: DrafterKind
    side: ModuleType  # the kind's torch side (DrafterKind.torch_side)
    model: nn.Module
    shape: Any
    head: Any  # the target's side of the loss, as the kind's build made it
    t_start: float
    dtype: torch.dtype = torch.float32  # master weights and batch tensors; autocast handles bf16 on GPU
    pull: StartPull | None = None  # drafter.init_pull: L2-SP toward the start weights, after each optimizer step

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def state_dir(self) -> Path:
        return train_state_dir(self.out_dir)

    @property
    def state_path(self) -> Path:
        return self.state_dir / "state.pt"

    @property
    def log_tmp(self) -> Path:
        return self.state_dir / "train_log.jsonl.partial"

    @property
    def settings(self) -> Any:
        return self.cfg.kind_settings

    @property
    def kernel(self) -> str:
        return self.side.kernel(self.settings, self.device)

    @property
    def capacity(self) -> int | None:
        """Rows of a packed batch row (None: one window per row)."""
        return self.cfg.max_seq_len if self.cfg.packing else None

    @property
    def lookahead(self) -> int:
        return self.kind.lookahead(self.settings)

    def load(self, group: list[Window]) -> Batch:
        return load_batch(
            group,
            self.shards,
            self.lookahead,
            self.device,
            self.dtype,
            self.capacity,
            layers=self.layer_columns,
            targets=self.kind.needs_target_distribution,
        )


@dataclass
class BatchPlan:
    """The run's windows and batches: training and held-out windows, the held-out batches this rank evaluates,
    each epoch's batch order for this rank, the optimizer steps in all, and what eval.json says about them."""

    train: list[Window]
    heldout: list[Window]
    heldout_sequences: int
    eval_groups: list[list[Window]]
    epoch_order: Callable[[int], list[list[Window]]]
    total_steps: int
    windows: dict
    # drafter.heldout_weights set: this rank's held-out batches of each weighted dataset (the choice's figure)
    eval_groups_by_dataset: dict[str, list[list[Window]]] | None = None


def train_drafter(
    hidden_shards: Sequence[Path],
    vocab_path: Path,
    target_path: Path,
    out_dir: Path,
    cfg: TrainConfig,
    log: Callable[[str], None] = print,
    on_step: Callable[[int], None] | None = None,
    layer_ids: Sequence[int] | None = None,
) -> dict:
    """Train a drafter on hidden shards; write out_dir (best drafter, train_log.jsonl, eval.json); return eval.

    ``layer_ids``: the target layers the drafter reads (its kind's capture_layer_ids: EAGLE-3's hidden.aux_layer_ids
    resolved against the target, DFlash's target_layer_ids); every shard must hold them, from a target as deep as
    ``target_path`` (None: the first shard's ids). ``vocab_path``: the draft vocabulary (None for a kind without
    one). Resumes from ``train_state_dir(out_dir)`` when a compatible state is there.
    ``on_step(step)`` is called after every optimizer step and its checkpoint (tests raise from it to simulate
    a kill).
    """
    run = open_run(hidden_shards, vocab_path, target_path, out_dir, cfg, log, layer_ids)
    plan = plan_batches(run)
    estimate = estimate_run_memory(run)
    opt = make_optimizer(run.model, cfg)
    fingerprint = data_fingerprint(run.hidden_shards, run.vocab_path, run.target_path, run.layer_ids)
    progress, resumed = resume_or_start(run, opt, fingerprint, plan.total_steps)
    elapsed_before = progress.seconds  # wall time of earlier attempts
    objective, step_module = make_objective(run)
    # the train log, kept beside out_dir until the end; a resumed run cuts it back to its checkpoint
    main = run.dist.main
    train_log = TrainLog(
        run.log_tmp,
        enabled=main,
        resume_at=progress.log_bytes if resumed else None,
        curves=open_curves(run.state_dir, cfg, enabled=main, resume_step=progress.step if resumed else None),
        progress=job_progress("training", plan.total_steps, unit="step", log=log, initial=progress.step)
        if main
        else None,
    )

    def checkpoint() -> None:  # the one place a training state is written
        progress.seconds = elapsed_before + time.time() - run.t_start
        if run.dist.main:
            progress.log_bytes = train_log.tell()
            save_train_state(
                run.state_path,
                run.model,
                opt,
                progress,
                cfg,
                fingerprint,
                run.dist.world,
                plan.total_steps,
                run.side.FROZEN_TARGET_TENSORS,
            )

    try:
        announce(run, plan, estimate)
        if resumed:
            train_log.write(
                {"event": "resume", "epoch": progress.epoch, "position": progress.position, "step": progress.step}
            )
        else:
            evaluate_untrained(run, plan, estimate, progress, train_log)
        run.model.train()
        for epoch in range(progress.epoch, cfg.epochs + 1):
            train_epoch(run, plan, objective, step_module, opt, progress, train_log, epoch, checkpoint, on_step)
            end_epoch(run, plan, progress, train_log, epoch)
            checkpoint()
    finally:
        train_log.close()
    result = run_result(run, plan, estimate, progress, elapsed_before + time.time() - run.t_start)
    publish(run, result)
    return result


def open_run(
    hidden_shards: Sequence[Path],
    vocab_path: Path | None,
    target_path: Path,
    out_dir: Path,
    cfg: TrainConfig,
    log: Callable[[str], None],
    layer_ids: Sequence[int] | None,
) -> TrainingRun:
    """Join the job, open and check the shards, build the drafter of the run's kind around the target's heads on
    the device."""
    t_start = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dist = setup_distributed(cfg)
    if not dist.main:
        log = lambda _msg: None  # noqa: E731 - rank 0 speaks for the job
    kind = cfg.drafter_kind
    side = kind.torch_side()
    shards = open_hidden_shards(hidden_shards)
    if layer_ids is None:  # the kind's choice for this target; EAGLE-3's: the layers the shards were captured at
        target = TargetView(read_text_config(target_path), tuple(target_architectures(target_path)))
        layer_ids = kind.capture_layer_ids(cfg.kind_settings, target, shards[0].aux_layer_ids)
    layer_ids = list(layer_ids)
    columns = shard_layer_columns(shards, layer_ids, target_num_hidden_layers(Path(target_path)))
    if kind.needs_draft_vocab and vocab_path is None:
        raise ValueError(f"drafter.kind {kind.name} trains a draft-vocabulary head: give it the draft vocab file")
    vocab = load_draft_vocab(Path(vocab_path)) if kind.needs_draft_vocab else None
    model, shape, head = side.build(Path(target_path), vocab, layer_ids, cfg, shards[0].layout, dist.device)
    side.check_training_data(shape, shards)
    if (shards[0].hidden_size, shards[0].vocab_size) != (shape.hidden_size, shape.vocab_size):
        raise ValueError(
            f"hidden shards were captured from a target with hidden {shards[0].hidden_size}, vocab "
            f"{shards[0].vocab_size}; {target_path} has hidden {shape.hidden_size}, vocab {shape.vocab_size}"
        )
    return TrainingRun(
        cfg, dist, log, [Path(x) for x in hidden_shards], Path(vocab_path) if vocab is not None else None,
        Path(target_path), Path(out_dir), shards, layer_ids, columns, kind, side, model, shape, head, t_start,
        pull=StartPull(model, cfg.init_pull) if cfg.init_pull else None,
    )  # fmt: skip


def plan_batches(run: TrainingRun) -> BatchPlan:
    """Windows, the held-out split (by sequence), each epoch's batch order (this rank's share of it; with several
    ranks ordered so that every step's batches cost about the same: ``balance_ranks``) and its statistics. With
    ``replay_dataset`` each epoch trains on every other window plus ``replay_share`` of the epoch from the replay
    dataset (``replay_windows``); with ``heldout_weights`` the held-out batches are kept per dataset."""
    cfg, dist = run.cfg, run.dist
    held = split_heldout(run.shards, cfg.eval_fraction, cfg.seed)
    windows_plan = plan_windows(run.shards, held, cfg.max_seq_len, run.lookahead)
    train_w, eval_w = windows_plan.train, windows_plan.heldout
    names = shard_datasets(run)
    replaying = [bool(cfg.replay_dataset) and name == cfg.replay_dataset for name in names]
    own_w = [w for w in train_w if not replaying[w.shard]]
    replay_pool = [w for w in train_w if replaying[w.shard]]
    if not own_w:
        raise ValueError("no training windows: the shards hold no generated (loss-masked) tokens")
    rows = run.kind.attention_cost_rows(run.shape)

    def epoch_windows(epoch: int) -> list[Window]:
        return own_w + replay_windows(replay_pool, len(own_w), cfg, epoch)

    def epoch_order(epoch: int) -> list[list[Window]]:
        groups = epoch_batches(epoch_windows(epoch), cfg, epoch)
        generator = torch.Generator().manual_seed(derived_seed(cfg.seed, "ranks", epoch))
        groups = balance_ranks(groups, dist.world, lambda g: batch_cost(g, run.capacity, rows), generator)
        return shard_for_rank(groups, dist.rank, dist.world)

    total_steps = sum(len(epoch_order(e)) for e in range(1, cfg.epochs + 1))
    all_groups = [
        *batches(eval_w, cfg, None),
        *(g for e in range(1, cfg.epochs + 1) for g in epoch_batches(epoch_windows(e), cfg, e)),
    ]
    # what the windows and batches are (train log and eval.json): long sequences are cut, never dropped
    windows = {
        **windows_plan.stats,
        "batch_size": cfg.batch_size,
        "max_batch_tokens": cfg.max_batch_tokens,
        "batch_token_limit": cfg.largest_batch_tokens,
        "packing": cfg.packing,
        "largest_batch_tokens": max(padded_tokens(g, run.capacity) for g in all_groups),
        "padded_per_real_token": sum(padded_tokens(g, run.capacity) for g in all_groups)
        / max(1, sum(real_tokens(g) for g in all_groups)),
    }
    if cfg.replay_dataset:
        windows["replay"] = {
            "dataset": cfg.replay_dataset,
            "share": cfg.replay_share,
            "pool_windows": len(replay_pool),
            "windows_per_epoch": len(replay_windows(replay_pool, len(own_w), cfg, 1)),
            "own_windows_per_epoch": len(own_w),
        }
    eval_groups = batches(eval_w, cfg, None)[dist.rank :: dist.world]
    by_dataset = None
    if cfg.heldout_weights:
        by_dataset = {
            d: batches([w for w in eval_w if names[w.shard] == d], cfg, None)[dist.rank :: dist.world]
            for d, _ in cfg.heldout_weights
            if d in names
        }
    return BatchPlan(train_w, eval_w, len(held), eval_groups, epoch_order, total_steps, windows, by_dataset)


def shard_datasets(run: TrainingRun) -> list[str]:
    """Each shard's dataset, checked against the settings that name datasets (drafter.replay_dataset,
    drafter.heldout_weights) when any does."""
    cfg = run.cfg
    named = [cfg.replay_dataset] if cfg.replay_dataset else []
    named += [d for d, _ in cfg.heldout_weights]
    if not named:
        return [""] * len(run.hidden_shards)
    names = [dataset_of_shard(p) for p in run.hidden_shards]
    if cfg.replay_dataset and cfg.replay_dataset not in names:  # an optional source that is not here
        run.log(
            f"WARNING: drafter.replay_dataset {cfg.replay_dataset!r} has no hidden shard in this run (its datasets: "
            f"{', '.join(sorted(set(names)))}): training runs without replay"
        )
    absent = [d for d, w in cfg.heldout_weights if w and d not in names]
    if absent:  # a benchmark-only set: nothing of it is held out here (the gate still weighs it)
        run.log(
            f"drafter.heldout_weights: {', '.join(absent)} has no hidden shard in this run, so the epoch choice "
            f"leaves it out (its datasets: {', '.join(sorted(set(names)))})"
        )
    return names


def replay_windows(pool: list[Window], own: int, cfg: TrainConfig, epoch: int) -> list[Window]:
    """The replay windows of ``epoch``: replay_share of the epoch (share / (1 - share) windows per own window, at
    most the whole pool), taken in turn from one seeded shuffle of the pool, so successive epochs see new ones."""
    count = replay_count(own, cfg.replay_share, len(pool))
    if not count:
        return []
    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(derived_seed(cfg.seed, "replay", 0)))
    start = (epoch - 1) * count
    return [pool[int(order[(start + i) % len(pool)])] for i in range(count)]


def estimate_run_memory(run: TrainingRun) -> TrainingMemory:
    target = TargetView(read_text_config(run.target_path), tuple(target_architectures(run.target_path)))
    hidden = {"layout": run.shards[0].layout, "target_topk": run.shards[0].topk or 32}
    draft_vocab = getattr(run.shape, "draft_vocab_size", 0)
    on_gpu = run.device.type == "cuda"
    return run.kind.training_memory(run.cfg, target, draft_vocab, run.layer_ids, on_gpu=on_gpu, hidden=hidden)


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW, weight decay on matrices only; the LR is set from lr_at(step) before every step."""
    decay_params = [w for w in model.parameters() if w.requires_grad and w.dim() >= 2]
    other_params = [w for w in model.parameters() if w.requires_grad and w.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay_params, "weight_decay": cfg.weight_decay}, {"params": other_params, "weight_decay": 0.0}],
        lr=cfg.learning_rate,
        betas=(0.9, 0.95),
    )


def resume_or_start(
    run: TrainingRun, opt: torch.optim.Optimizer, fingerprint: str, total_steps: int
) -> tuple[Progress, bool]:
    """Restore weights, optimizer, RNG and progress from a compatible training state, or start over with an
    empty state directory. Returns (progress, resumed)."""
    cfg, dist, state_path, state_dir = run.cfg, run.dist, run.state_path, run.state_dir
    state = load_train_state(state_path, cfg, fingerprint, dist.world) if cfg.resume else None
    dist.barrier()  # every rank has read the state before rank 0 may clear it
    if state is not None:
        missing, unexpected = run.model.load_state_dict(state["model"], strict=False)
        if set(missing) != set(run.side.FROZEN_TARGET_TENSORS) or unexpected:
            raise ValueError(
                f"{state_path}: drafter tensors missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
        opt.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        progress = Progress(**state["progress"])
        run.log(
            f"resuming from {state_path}: epoch {progress.epoch}, batch {progress.position}, "
            f"step {progress.step}/{total_steps}"
        )
    else:
        progress = Progress()
        if dist.main:
            shutil.rmtree(state_dir, ignore_errors=True)
            state_dir.mkdir(parents=True)
    if dist.main:
        for stale in state_dir.rglob(".*.tmp"):  # left by a write that was killed
            stale.unlink()
    return progress, state is not None


def make_objective(run: TrainingRun) -> tuple[nn.Module, nn.Module]:
    """(the kind's objective, the module a step calls: the objective itself, or wrapped in DDP under torchrun)."""
    objective = run.side.Objective(run.model, run.head, run.settings, run.kernel)
    if run.dist.world == 1:
        return objective, objective
    # gradients live in DDP's all-reduce buckets (no second gradient-sized copy: 3.6 GB for Kimi's drafter)
    ddp = nn.parallel.DistributedDataParallel(
        objective, device_ids=[run.device] if run.device.type == "cuda" else None, gradient_as_bucket_view=True
    )
    return objective, ddp


def held_out_eval(run: TrainingRun, plan: BatchPlan) -> dict:
    """The held-out evaluation the best epoch is chosen on: every held-out window pooled, or with
    drafter.heldout_weights each weighted dataset's evaluated apart and combined (aerie.drafter.traffic)."""
    if not plan.heldout:
        return dict(run.side.EMPTY_EVAL)
    all_reduce = run.dist.sum if run.dist.world > 1 else None

    def evaluate(groups: list[list[Window]]) -> dict:
        batches = (run.load(group) for group in groups)
        return run.side.evaluate(run.model, batches, run.head, run.settings, run.kernel, run.device, all_reduce)

    if plan.eval_groups_by_dataset is None:
        return evaluate(plan.eval_groups)
    evals = {
        d: evaluate(groups) if groups else dict(run.side.EMPTY_EVAL)
        for d, groups in plan.eval_groups_by_dataset.items()
    }
    combined = combine_heldout(evals, dict(run.cfg.heldout_weights))
    combined["halfwidth_95"] = heldout_halfwidth(combined["by_dataset"], combined["weights"])
    return combined


def announce(run: TrainingRun, plan: BatchPlan, estimate: TrainingMemory) -> None:
    cfg, w = run.cfg, plan.windows
    trainable = sum(x.numel() for x in run.model.parameters() if x.requires_grad) / 1e6
    run.log(
        f"drafter: {trainable:.2f}M trainable params, {len(plan.train)} train / {len(plan.heldout)} held-out "
        f"windows ({w['sequences_cut_into_windows']} sequences longer than {cfg.max_seq_len} rows cut into windows, "
        f"{w['window_rows']} rows), {plan.total_steps} steps, device {run.device}, {run.kernel} attention, "
        f"{'packed' if cfg.packing else 'padded'} batches ({w['padded_per_real_token']:.2f} padded per real token)"
        + (f", {run.dist.world} processes" if run.dist.world > 1 else "")
    )
    run.log(estimate.describe() + f" (estimate: the {run.kind.name} kind's training_memory)")


def evaluate_untrained(
    run: TrainingRun, plan: BatchPlan, estimate: TrainingMemory, progress: Progress, train_log: TrainLog
) -> None:
    train_log.write({"event": "data", "windows": plan.windows, "estimated_peak_bytes": estimate.total})
    progress.untrained = held_out_eval(run, plan)
    train_log.write({"event": "eval", "epoch": 0, **progress.untrained})
    untrained = progress.untrained
    if untrained.get("heldout_start_positions"):
        acceptance, loss = untrained["simulated_acceptance_length"], untrained["heldout_loss"]
        run.log(f"untrained: acceptance {acceptance:.3f}, loss {loss:.4f}" + by_dataset_text(untrained))
    if run.cfg.heldout_weights:  # can the held-out split tell drafters 0.05 apart? (a floor: starts as independent)
        warning = floor_message(untrained.get("halfwidth_95"), int(untrained.get("heldout_start_positions") or 0))
        if warning:
            run.log(f"WARNING: {warning}")
            train_log.write({"event": "warning", "heldout_floor": warning})
    if untrained.get("heldout_start_positions"):
        if run.cfg.init:  # warm start: the start folder competes; an epoch is exported only when it beats it
            progress.best_epoch, progress.best_acceptance = 0, acceptance
            if run.dist.main:
                facts = {"epoch": 0, "init": run.cfg.init}
                run.side.export(run.model, run.state_dir / "best", facts, run.layer_ids)


def by_dataset_text(evaluation: dict) -> str:
    """`` (domain 2.811 x 0.70, general 3.002 x 0.30)``: a weighted evaluation's parts, for the log."""
    parts = evaluation.get("by_dataset")
    if not parts:
        return ""
    weights = evaluation.get("weights") or {}
    return (
        " ("
        + ", ".join(
            f"{d} {e['simulated_acceptance_length']:.3f} x {weights.get(d, 0):.2f}"
            for d, e in parts.items()
            if e.get("simulated_acceptance_length") is not None
        )
        + ")"
    )


def train_step(
    run: TrainingRun,
    objective: nn.Module,
    step_module: nn.Module,
    opt: torch.optim.Optimizer,
    b: Batch,
    lr: float,
    step: int,
) -> tuple[torch.Tensor, list, torch.Tensor | None]:
    """One optimizer step on one batch: (loss, per-position stats, gradient norm before clipping). The kind's
    ``prepare`` (the target's side, anchors ...) runs outside autocast, seeded by the step (a resumed run draws the
    same)."""
    prepared = objective.prepare(b, derived_seed(run.cfg.seed, "step", step))
    for g in opt.param_groups:
        g["lr"] = lr
    with autocast(run.device):
        loss, stats = step_module(b, prepared)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    cfg = run.cfg
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip) if cfg.grad_clip > 0 else None
    opt.step()
    if run.pull is not None:
        run.pull.step(lr)
    return loss, stats, grad_norm


def autocast(device: torch.device):
    # bf16 autocast on GPU; exact fp32 on CPU (deterministic, and CPU bf16 is slow).
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train_epoch(
    run: TrainingRun,
    plan: BatchPlan,
    objective: nn.Module,
    step_module: nn.Module,
    opt: torch.optim.Optimizer,
    progress: Progress,
    train_log: TrainLog,
    epoch: int,
    checkpoint: Callable[[], None],
    on_step: Callable[[int], None] | None,
) -> None:
    """This rank's batches of the epoch from ``progress.position`` on (the next one loading in the background
    while a step runs), each an optimizer step, logged every ``log_every`` steps and checkpointed every
    ``checkpoint_every``."""
    cfg, dist = run.cfg, run.dist
    order = plan.epoch_order(epoch)
    t0 = time.time()
    for b in prefetched(order[progress.position :], run.load):
        lr = lr_at(progress.step, plan.total_steps, cfg)
        loss, stats, grad_norm = train_step(run, objective, step_module, opt, b, lr, progress.step)
        # rows, supervised rows and loss of all ranks (one small all-reduce; a no-op in one process)
        counts = dist.sum(torch.tensor([b.rows, float(stats[0][1]), float(loss.detach())], dtype=torch.float64))
        now = time.time()
        progress.train_seconds += now - t0
        t0 = now
        progress.step += 1
        progress.position += 1
        progress.tokens += int(counts[0])
        progress.supervised += int(counts[1])
        if progress.step % cfg.log_every == 0 or progress.step == plan.total_steps:
            log_step(run, plan, progress, train_log, epoch, lr, float(counts[2]) / dist.world, stats, grad_norm)
        if cfg.checkpoint_every and progress.step % cfg.checkpoint_every == 0 and progress.position < len(order):
            checkpoint()  # (the epoch's last batch is checkpointed after its evaluation)
            t0 = time.time()
        if on_step is not None:
            on_step(progress.step)
            t0 = time.time()


def log_step(
    run: TrainingRun,
    plan: BatchPlan,
    progress: Progress,
    train_log: TrainLog,
    epoch: int,
    lr: float,
    loss: float,
    stats: list,
    grad_norm: torch.Tensor | None,
) -> None:
    event = {
        "event": "train",
        "epoch": epoch,
        "step": progress.step,
        "lr": lr,
        "loss": loss,
        "loss_per_step": [float(c / max(float(w), 1.0)) for c, w, _ in stats],  # rank 0's
        "acc_per_step": [float(r / max(float(w), 1.0)) for _, w, r in stats],
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "tokens": progress.tokens,
        "tokens_per_s": progress.tokens / max(progress.train_seconds, 1e-9),
    }
    train_log.write(event)
    run.log(
        f"step {progress.step}/{plan.total_steps} loss {event['loss']:.4f} "
        f"acc0 {event['acc_per_step'][0]:.3f} {event['tokens_per_s']:.0f} tok/s"
    )


def end_epoch(run: TrainingRun, plan: BatchPlan, progress: Progress, train_log: TrainLog, epoch: int) -> None:
    """Evaluate, export ``last`` (and ``best`` when held-out acceptance improved), move progress to the next
    epoch (the caller checkpoints)."""
    evaluation = held_out_eval(run, plan)
    train_log.write({"event": "eval", "epoch": epoch, **evaluation})
    progress.epochs.append({"epoch": epoch, **evaluation})
    acceptance = evaluation.get("simulated_acceptance_length")
    # the first epoch, a better held-out acceptance, or every epoch when nothing is held out
    improved = acceptance is None or progress.best_acceptance is None or acceptance > progress.best_acceptance
    if run.dist.main:
        facts = {
            "target": str(run.target_path),
            "hidden_shards": [str(x) for x in run.hidden_shards],
            "draft_vocab": str(run.vocab_path) if run.vocab_path else None,
            "train_config": run.cfg.section(),
            "epoch": epoch,
            "tokens_trained": progress.tokens,
            # no wall-clock figure here (eval.json has them): a deterministic run exports identical bytes
            "simulated_acceptance_length": evaluation.get("simulated_acceptance_length"),
            "heldout_loss": evaluation.get("heldout_loss"),
        }
        run.side.export(run.model, run.state_dir / "last", facts, run.layer_ids)
        if improved:
            for name in ("model.safetensors", "config.json"):
                copy_atomic(run.state_dir / "last" / name, run.state_dir / "best" / name)
    if improved:
        progress.best_epoch, progress.best_acceptance = epoch, acceptance
    if evaluation.get("heldout_start_positions"):
        run.log(
            f"epoch {epoch}: acceptance {acceptance:.3f}, loss {evaluation['heldout_loss']:.4f}"
            + by_dataset_text(evaluation)
            + (" (best so far)" if improved else f" (best: epoch {progress.best_epoch})")
        )
    progress.epoch, progress.position = epoch + 1, 0


def run_result(run: TrainingRun, plan: BatchPlan, estimate: TrainingMemory, progress: Progress, seconds: float) -> dict:
    """eval.json: the best epoch's held-out figures, every epoch's, and what the run trained on and took."""
    chosen = progress.epochs[progress.best_epoch - 1] if progress.best_epoch else progress.untrained  # 0: the start
    best = {k: v for k, v in chosen.items() if k != "epoch"}
    device = run.device
    return {
        "format": EVAL_FORMAT,
        **best,  # the held-out figures of the drafter in out_dir
        "best_epoch": progress.best_epoch,
        "untrained": {
            k: progress.untrained.get(k) for k in UNTRAINED_KEYS if k in progress.untrained or k in UNTRAINED_KEYS[:3]
        },
        "per_epoch": [
            {k: e.get(k) for k in ("epoch", "simulated_acceptance_length", "heldout_loss")} for e in progress.epochs
        ]
        if plan.heldout
        else [],
        "epochs": progress.epochs,  # every epoch's full held-out evaluation
        "heldout_sequences": plan.heldout_sequences,
        "selection": selection_facts(run.cfg, progress),
        "tokens_trained": progress.tokens,  # real rows processed, summed over epochs
        "supervised_tokens": progress.supervised,  # step-0 rows that carried loss
        "train_seconds": progress.train_seconds,
        "seconds": seconds,
        "tokens_per_s": progress.tokens / max(progress.train_seconds, 1e-9),
        "optimizer_steps": progress.step,
        "kind": run.kind.name,
        **run.side.eval_facts(run.settings),
        "device": str(device),
        "processes": run.dist.world,
        "attention_kernel": run.kernel,
        "windows": plan.windows,
        "memory": {
            "estimated_peak_bytes": estimate.total,  # per process (the drafter kind's training_memory)
            "estimated_parts": estimate.parts,
            # what torch allocated at most on this process's GPU (None on the CPU)
            "measured_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        },
    }


def selection_facts(cfg: TrainConfig, progress: Progress) -> dict:
    """What the best epoch was chosen on: the pooled held-out split, or the traffic-weighted mix of datasets with
    its 95 % half-width (at the start) and whether it can tell drafters 0.05 apart."""
    if not cfg.heldout_weights:
        return {"figure": "pooled held-out acceptance"}
    start = progress.untrained or {}
    halfwidth = start.get("halfwidth_95")
    return {
        "figure": "traffic-weighted held-out acceptance",
        "heldout_weights": dict(cfg.heldout_weights),
        "halfwidth_95": halfwidth,
        "floor_warning": floor_message(halfwidth, int(start.get("heldout_start_positions") or 0)),
    }


def publish(run: TrainingRun, result: dict) -> None:
    """The best epoch's drafter, the log and eval.json into out_dir (rank 0); the resumable state goes."""
    out_dir, state_dir = run.out_dir, run.state_dir
    if run.dist.main:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("model.safetensors", "config.json"):
            copy_atomic(state_dir / "best" / name, out_dir / name)
        run.side.check_export(out_dir, run.layer_ids)
        copy_atomic(run.log_tmp, out_dir / "train_log.jsonl")
        publish_curves(state_dir, out_dir)  # tensorboard/: the curves beside the drafter
        atomic_publish(out_dir / "eval.json", lambda path: Path(path).write_text(json.dumps(result, indent=2) + "\n"))
        run.state_path.unlink(missing_ok=True)  # nothing left to resume; last/ and best/ stay
        run.log_tmp.unlink(missing_ok=True)
        run.log(
            f"drafter (epoch {result['best_epoch']} of {run.cfg.epochs}) written to {out_dir} in "
            f"{result['seconds']:.1f}s ({result['tokens_per_s']:.0f} tok/s)"
        )
    run.dist.barrier()
