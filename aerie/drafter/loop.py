"""``train_drafter``: the drafter's training loop, read top to bottom.

data (hidden shards, draft vocab, windows) -> a drafter around the target's heads -> AdamW -> resume or
start -> per epoch: batches through the TTT unroll and loss, checkpoints, held-out evaluation, ``last`` /
``best`` exports -> the best epoch's drafter, train_log.jsonl and eval.json published in ``out_dir``.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from aerie.artifacts import atomic_publish
from aerie.drafter.config import TrainConfig
from aerie.drafter.curves import open_curves, publish_curves
from aerie.drafter.data import (
    Batch,
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
from aerie.drafter.evaluate import EMPTY_EVAL, evaluate
from aerie.drafter.layers import attention_kernel
from aerie.drafter.memory import TrainingMemory, attention_cost_rows, estimate_training_memory
from aerie.drafter.model import DrafterConfig, Eagle3Drafter
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
from aerie.drafter.ttt import TargetHead, TTTUnroll, autocast
from aerie.drafter.warm_start import StartPull, start_from_folder
from aerie.formats.hidden import check_shard_layers, open_hidden_shards
from aerie.formats.vocab import DraftVocab, load_draft_vocab
from aerie.progress import job_progress
from aerie.target_model.config import read_text_config, target_num_hidden_layers
from aerie.target_model.heads import read_target_heads

EVAL_FORMAT = "aerie.drafter-eval/1"


def check_exported_layer_ids(folder: Path, aux_layer_ids: Sequence[int]) -> None:
    """Re-read an exported drafter's config.json: SGLang captures the layers named there, so they must be the
    layers the drafter was trained on."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    exported = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if exported != list(aux_layer_ids):
        raise ValueError(
            f"{folder}/config.json: eagle_config.eagle_aux_hidden_state_layer_ids is {exported}, but the drafter "
            f"was trained on hidden shards captured at aux layers {list(aux_layer_ids)}; refusing to publish it"
        )


def export_drafter(model: Eagle3Drafter, folder: Path, aux_layer_ids: Sequence[int], facts: dict) -> None:
    """The drafter in SGLang's layout at ``folder`` (with aerie's training facts), re-read to check its layers."""
    model.save_pretrained(folder, extra=facts)
    check_exported_layer_ids(folder, aux_layer_ids)


def build_drafter(
    target_path: Path, vocab: DraftVocab, aux_layer_ids: list[int], cfg: TrainConfig, need_lm_head: bool
) -> tuple[Eagle3Drafter, DrafterConfig, torch.Tensor | None]:
    """A new drafter around the target's frozen embeddings (lm_head and norm from the target's too, with
    init_head_from_target), and the target's lm_head [V, H] when ``need_lm_head`` (soft targets of ``full``
    hidden shards) - as Eagle3Drafter.from_target would build it from the loaded model, without loading it."""
    roles = ["embed", "norm"] + (["lm_head"] if need_lm_head or cfg.init_head_from_target else [])
    heads = read_target_heads(target_path, roles)
    if cfg.init:  # warm start: every tensor from the drafter folder, checked against this run (warm_start.py)
        model = start_from_folder(cfg.init, target_path, vocab, aux_layer_ids, cfg, heads.embed)
        return model, model.cfg, heads.lm_head if need_lm_head else None
    # Only settings that differ from "derived from the target" are passed on.
    shape = {k: v for k, v in cfg.drafter_shape().items() if v not in (None, False, "auto")}
    dcfg = DrafterConfig.from_target(SimpleNamespace(**heads.config), len(vocab.d2t), aux_layer_ids, **shape)
    if tuple(heads.embed.shape) != (dcfg.vocab_size, dcfg.hidden_size):
        raise ValueError(f"target embeddings {tuple(heads.embed.shape)} != ({dcfg.vocab_size}, {dcfg.hidden_size})")
    torch.manual_seed(cfg.seed)  # deterministic drafter init
    model = Eagle3Drafter(dcfg)
    model.set_vocab_maps(vocab.d2t, vocab.t2d)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(heads.embed)
        if cfg.init_head_from_target:
            model.lm_head.weight.copy_(heads.lm_head[vocab.target_ids])
            if heads.norm is not None and heads.norm.shape == model.norm.weight.shape:
                model.norm.weight.copy_(heads.norm)
    return model, dcfg, heads.lm_head if need_lm_head else None


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
    drafter and the target's head, and where the run's files go."""

    cfg: TrainConfig
    dist: Dist
    log: Callable[[str], None]
    hidden_shards: list[Path]
    vocab_path: Path
    target_path: Path
    out_dir: Path
    shards: list
    aux_layer_ids: list[int]
    model: Eagle3Drafter
    dcfg: DrafterConfig
    head: TargetHead
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
    def kernel(self) -> str:
        return attention_kernel(self.cfg.attention_kernel, self.device)

    @property
    def capacity(self) -> int | None:
        """Rows of a packed batch row (None: one window per row)."""
        return self.cfg.max_seq_len if self.cfg.packing else None

    def load(self, group: list[Window]) -> Batch:
        return load_batch(group, self.shards, self.cfg.ttt_steps, self.device, self.dtype, self.capacity)


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


def train_drafter(
    hidden_shards: Sequence[Path],
    vocab_path: Path,
    target_path: Path,
    out_dir: Path,
    cfg: TrainConfig,
    log: Callable[[str], None] = print,
    on_step: Callable[[int], None] | None = None,
    aux_layer_ids: Sequence[int] | None = None,
) -> dict:
    """Train a drafter on hidden shards; write out_dir (best drafter, train_log.jsonl, eval.json); return eval.

    ``aux_layer_ids``: the configured aux layers (hidden.aux_layer_ids resolved against the target); every
    shard must have been captured at exactly these layers of a target as deep as ``target_path`` (None: the
    first shard's ids). Resumes from ``train_state_dir(out_dir)`` when a compatible state is there.
    ``on_step(step)`` is called after every optimizer step and its checkpoint (tests raise from it to simulate
    a kill).
    """
    run = open_run(hidden_shards, vocab_path, target_path, out_dir, cfg, log, aux_layer_ids)
    plan = plan_batches(run)
    estimate = estimate_run_memory(run)
    opt = make_optimizer(run.model, cfg)
    fingerprint = data_fingerprint(run.hidden_shards, run.vocab_path, run.target_path, run.aux_layer_ids)
    progress, resumed = resume_or_start(run, opt, fingerprint, plan.total_steps)
    elapsed_before = progress.seconds  # wall time of earlier attempts
    unroll = wrap_unroll(run)
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
                run.state_path, run.model, opt, progress, cfg, fingerprint, run.dist.world, plan.total_steps
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
            train_epoch(run, plan, unroll, opt, progress, train_log, epoch, checkpoint, on_step)
            end_epoch(run, plan, progress, train_log, epoch)
            checkpoint()
    finally:
        train_log.close()
    result = run_result(run, plan, estimate, progress, elapsed_before + time.time() - run.t_start)
    publish(run, result)
    return result


def open_run(
    hidden_shards: Sequence[Path],
    vocab_path: Path,
    target_path: Path,
    out_dir: Path,
    cfg: TrainConfig,
    log: Callable[[str], None],
    aux_layer_ids: Sequence[int] | None,
) -> TrainingRun:
    """Join the job, open and check the shards, build the drafter around the target's heads on the device."""
    t_start = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dist = setup_distributed(cfg)
    if not dist.main:
        log = lambda _msg: None  # noqa: E731 - rank 0 speaks for the job
    device = dist.device
    shards = open_hidden_shards(hidden_shards)
    aux_layer_ids = list(aux_layer_ids) if aux_layer_ids is not None else shards[0].aux_layer_ids
    check_shard_layers(shards, aux_layer_ids, target_num_hidden_layers(Path(target_path)))
    vocab = load_draft_vocab(Path(vocab_path))
    model, dcfg, lm_head = build_drafter(
        Path(target_path), vocab, aux_layer_ids, cfg, need_lm_head=shards[0].layout == "full"
    )
    if (shards[0].hidden_size, shards[0].vocab_size) != (dcfg.hidden_size, dcfg.vocab_size):
        raise ValueError(
            f"hidden shards were captured from a target with hidden {shards[0].hidden_size}, vocab "
            f"{shards[0].vocab_size}; {target_path} has hidden {dcfg.hidden_size}, vocab {dcfg.vocab_size}"
        )
    model = model.to(device)
    if shards[0].layout == "full":
        head = TargetHead(
            full=lm_head.to(device).float(),
            draft=lm_head[vocab.target_ids].to(device).float(),
            t2d=vocab.t2d.to(device),
        )
    else:  # compact shards carry the target's top-k: no [V, H] head on the device (4.7 GB fp32 for Kimi)
        head = TargetHead(full=None, draft=None, t2d=vocab.t2d.to(device))
    return TrainingRun(
        cfg, dist, log, [Path(x) for x in hidden_shards], Path(vocab_path), Path(target_path), Path(out_dir),
        shards, aux_layer_ids, model, dcfg, head, t_start,
        pull=StartPull(model, cfg.init_pull) if cfg.init_pull else None,
    )  # fmt: skip


def plan_batches(run: TrainingRun) -> BatchPlan:
    """Windows, the held-out split (by sequence), each epoch's batch order (this rank's share of it; with several
    ranks ordered so that every step's batches cost about the same: ``balance_ranks``) and its statistics."""
    cfg, dist = run.cfg, run.dist
    held = split_heldout(run.shards, cfg.eval_fraction, cfg.seed)
    windows_plan = plan_windows(run.shards, held, cfg.max_seq_len, cfg.ttt_steps)
    train_w, eval_w = windows_plan.train, windows_plan.heldout
    if not train_w:
        raise ValueError("no training windows: the shards hold no generated (loss-masked) tokens")
    rows = attention_cost_rows(run.dcfg)

    def epoch_order(epoch: int) -> list[list[Window]]:
        groups = epoch_batches(train_w, cfg, epoch)
        generator = torch.Generator().manual_seed(derived_seed(cfg.seed, "ranks", epoch))
        groups = balance_ranks(groups, dist.world, lambda g: batch_cost(g, run.capacity, rows), generator)
        return shard_for_rank(groups, dist.rank, dist.world)

    total_steps = sum(len(epoch_order(e)) for e in range(1, cfg.epochs + 1))
    all_groups = [
        *batches(eval_w, cfg, None),
        *(g for e in range(1, cfg.epochs + 1) for g in epoch_batches(train_w, cfg, e)),
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
    eval_groups = batches(eval_w, cfg, None)[dist.rank :: dist.world]
    return BatchPlan(train_w, eval_w, len(held), eval_groups, epoch_order, total_steps, windows)


def estimate_run_memory(run: TrainingRun) -> TrainingMemory:
    return estimate_training_memory(
        run.cfg,
        read_text_config(run.target_path),
        run.dcfg.draft_vocab_size,
        1 if run.device.type == "cuda" else 0,
        num_aux_layers=len(run.aux_layer_ids),
        hidden_layout=run.shards[0].layout,
        target_topk=run.shards[0].topk or 32,
    )


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
        if set(missing) != {"embed_tokens.weight"} or unexpected:
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


def wrap_unroll(run: TrainingRun) -> nn.Module:
    """The TTT unroll as the module a step calls: wrapped in DDP under torchrun."""
    unroll: nn.Module = TTTUnroll(run.model, run.cfg.ttt_steps, run.cfg.step_loss_decay, run.kernel)
    if run.dist.world > 1:
        # gradients live in DDP's all-reduce buckets (no second gradient-sized copy: 3.6 GB for Kimi's drafter)
        unroll = nn.parallel.DistributedDataParallel(
            unroll, device_ids=[run.device] if run.device.type == "cuda" else None, gradient_as_bucket_view=True
        )
    return unroll


def held_out_eval(run: TrainingRun, plan: BatchPlan) -> dict:
    if not plan.heldout:
        return dict(EMPTY_EVAL)
    all_reduce = run.dist.sum if run.dist.world > 1 else None
    return evaluate(run.model, plan.eval_groups, run.shards, run.head, run.cfg, run.device, run.dtype, all_reduce)


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
    run.log(estimate.describe() + " (estimate: aerie.drafter.memory)")


def evaluate_untrained(
    run: TrainingRun, plan: BatchPlan, estimate: TrainingMemory, progress: Progress, train_log: TrainLog
) -> None:
    train_log.write({"event": "data", "windows": plan.windows, "estimated_peak_bytes": estimate.total})
    progress.untrained = held_out_eval(run, plan)
    train_log.write({"event": "eval", "epoch": 0, **progress.untrained})
    untrained = progress.untrained
    if untrained.get("heldout_start_positions"):
        acceptance, loss = untrained["simulated_acceptance_length"], untrained["heldout_loss"]
        run.log(f"untrained: acceptance {acceptance:.3f}, loss {loss:.4f}")
        if run.cfg.init:  # warm start: the start folder competes; an epoch is exported only when it beats it
            progress.best_epoch, progress.best_acceptance = 0, acceptance
            if run.dist.main:
                export_drafter(run.model, run.state_dir / "best", run.aux_layer_ids, {"epoch": 0, "init": run.cfg.init})


def train_step(
    run: TrainingRun, unroll: nn.Module, opt: torch.optim.Optimizer, b: Batch, lr: float
) -> tuple[torch.Tensor, list, torch.Tensor | None]:
    """One optimizer step on one batch: (loss, per-step stats, gradient norm before clipping)."""
    targets = run.head.prepare(b, run.cfg)
    for g in opt.param_groups:
        g["lr"] = lr
    with autocast(run.device):
        loss, stats, _ = unroll(b, targets)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    cfg = run.cfg
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip) if cfg.grad_clip > 0 else None
    opt.step()
    if run.pull is not None:
        run.pull.step(lr)
    return loss, stats, grad_norm


def train_epoch(
    run: TrainingRun,
    plan: BatchPlan,
    unroll: nn.Module,
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
        loss, stats, grad_norm = train_step(run, unroll, opt, b, lr)
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
            "draft_vocab": str(run.vocab_path),
            "train_config": asdict(run.cfg),
            "epoch": epoch,
            "tokens_trained": progress.tokens,
            # no wall-clock figure here (eval.json has them): a deterministic run exports identical bytes
            "simulated_acceptance_length": evaluation.get("simulated_acceptance_length"),
            "heldout_loss": evaluation.get("heldout_loss"),
        }
        export_drafter(run.model, run.state_dir / "last", run.aux_layer_ids, facts)
        if improved:
            for name in ("model.safetensors", "config.json"):
                copy_atomic(run.state_dir / "last" / name, run.state_dir / "best" / name)
    if improved:
        progress.best_epoch, progress.best_acceptance = epoch, acceptance
    if evaluation.get("heldout_start_positions"):
        run.log(
            f"epoch {epoch}: acceptance {acceptance:.3f}, loss {evaluation['heldout_loss']:.4f}"
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
            k: progress.untrained.get(k)
            for k in ("simulated_acceptance_length", "acceptance_per_position", "heldout_loss")
        },
        "per_epoch": [
            {k: e.get(k) for k in ("epoch", "simulated_acceptance_length", "heldout_loss")} for e in progress.epochs
        ]
        if plan.heldout
        else [],
        "epochs": progress.epochs,  # every epoch's full held-out evaluation
        "heldout_sequences": plan.heldout_sequences,
        "tokens_trained": progress.tokens,  # real rows processed, summed over epochs (each row runs ttt_steps steps)
        "supervised_tokens": progress.supervised,  # step-0 rows that carried loss
        "train_seconds": progress.train_seconds,
        "seconds": seconds,
        "tokens_per_s": progress.tokens / max(progress.train_seconds, 1e-9),
        "optimizer_steps": progress.step,
        "ttt_steps": run.cfg.ttt_steps,
        "device": str(device),
        "processes": run.dist.world,
        "attention_kernel": run.kernel,
        "windows": plan.windows,
        "memory": {
            "estimated_peak_bytes": estimate.total,  # per process (aerie.drafter.memory)
            "estimated_parts": estimate.parts,
            # what torch allocated at most on this process's GPU (None on the CPU)
            "measured_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        },
    }


def publish(run: TrainingRun, result: dict) -> None:
    """The best epoch's drafter, the log and eval.json into out_dir (rank 0); the resumable state goes."""
    out_dir, state_dir = run.out_dir, run.state_dir
    if run.dist.main:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("model.safetensors", "config.json"):
            copy_atomic(state_dir / "best" / name, out_dir / name)
        check_exported_layer_ids(out_dir, run.aux_layer_ids)
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
