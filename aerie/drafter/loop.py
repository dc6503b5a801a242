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
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from aerie.artifacts import atomic_publish
from aerie.drafter.config import TrainConfig
from aerie.drafter.curves import open_curves, publish_curves
from aerie.drafter.data import Window, batches, epoch_batches, load_batch, padded_tokens, plan_windows, split_heldout
from aerie.drafter.distributed import setup_distributed, shard_for_rank
from aerie.drafter.evaluate import EMPTY_EVAL, evaluate
from aerie.drafter.memory import estimate_training_memory
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
    t_start = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dist = setup_distributed(cfg)
    if not dist.main:
        log = lambda _msg: None  # noqa: E731 - rank 0 speaks for the job
    device = dist.device
    dtype = torch.float32  # master weights and batch tensors; autocast handles bf16 on GPU
    out_dir = Path(out_dir)
    state_dir = train_state_dir(out_dir)
    state_path, log_tmp = state_dir / "state.pt", state_dir / "train_log.jsonl.partial"

    # data and the target's heads
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
    pull = StartPull(model, cfg.init_pull) if cfg.init_pull else None  # L2-SP toward the start weights
    if shards[0].layout == "full":
        head = TargetHead(
            full=lm_head.to(device).float(),
            draft=lm_head[vocab.target_ids].to(device).float(),
            t2d=vocab.t2d.to(device),
        )
    else:  # compact shards carry the target's top-k: no [V, H] head on the device (4.7 GB fp32 for Kimi)
        head = TargetHead(full=None, draft=None, t2d=vocab.t2d.to(device))
    del lm_head

    # windows, the held-out split (by sequence), and each epoch's batch order (this rank's share of it)
    held = split_heldout(shards, cfg.eval_fraction, cfg.seed)
    plan = plan_windows(shards, held, cfg.max_seq_len, cfg.ttt_steps)
    train_w, eval_w = plan.train, plan.heldout
    if not train_w:
        raise ValueError("no training windows: the shards hold no generated (loss-masked) tokens")
    eval_groups = batches(eval_w, cfg, None)[dist.rank :: dist.world]

    def epoch_order(epoch: int) -> list[list[Window]]:
        return shard_for_rank(epoch_batches(train_w, cfg, epoch), dist.rank, dist.world)

    total_steps = sum(len(epoch_order(e)) for e in range(1, cfg.epochs + 1))
    # what the windows and batches are (train log and eval.json): long sequences are cut, never dropped
    windows = {
        **plan.stats,
        "batch_size": cfg.batch_size,
        "max_batch_tokens": cfg.max_batch_tokens,
        "batch_token_limit": cfg.largest_batch_tokens,
        "largest_batch_tokens": max(
            padded_tokens(g)
            for g in [
                *batches(eval_w, cfg, None),
                *(g for e in range(1, cfg.epochs + 1) for g in epoch_batches(train_w, cfg, e)),
            ]
        ),
    }
    estimate = estimate_training_memory(
        cfg,
        read_text_config(Path(target_path)),
        dcfg.draft_vocab_size,
        1 if device.type == "cuda" else 0,
        num_aux_layers=len(aux_layer_ids),
        hidden_layout=shards[0].layout,
        target_topk=shards[0].topk or 32,
    )

    def held_out_eval() -> dict:
        if not eval_w:
            return dict(EMPTY_EVAL)
        return evaluate(
            model, eval_groups, shards, head, cfg, device, dtype, all_reduce=dist.sum if dist.world > 1 else None
        )

    # optimizer: AdamW; the LR is set from lr_at(step) before every step
    decay_params = [w for w in model.parameters() if w.requires_grad and w.dim() >= 2]
    other_params = [w for w in model.parameters() if w.requires_grad and w.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay_params, "weight_decay": cfg.weight_decay}, {"params": other_params, "weight_decay": 0.0}],
        lr=cfg.learning_rate,
        betas=(0.9, 0.95),
    )

    # resume from a compatible training state, or start over
    fingerprint = data_fingerprint(hidden_shards, vocab_path, target_path, aux_layer_ids)
    state = load_train_state(state_path, cfg, fingerprint, dist.world) if cfg.resume else None
    dist.barrier()  # every rank has read the state before rank 0 may clear it
    if state is not None:
        missing, unexpected = model.load_state_dict(state["model"], strict=False)
        if set(missing) != {"embed_tokens.weight"} or unexpected:
            raise ValueError(
                f"{state_path}: drafter tensors missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
        opt.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        progress = Progress(**state["progress"])
        log(
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
    resumed = state is not None
    elapsed_before = progress.seconds  # wall time of earlier attempts
    del state

    unroll: nn.Module = TTTUnroll(model, cfg.ttt_steps, cfg.step_loss_decay)
    if dist.world > 1:
        # gradients live in DDP's all-reduce buckets (no second gradient-sized copy: 3.6 GB for Kimi's drafter)
        unroll = nn.parallel.DistributedDataParallel(
            unroll, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True
        )

    # the train log, kept beside out_dir until the end; a resumed run cuts it back to its checkpoint
    train_log = TrainLog(
        log_tmp,
        enabled=dist.main,
        resume_at=progress.log_bytes if resumed else None,
        curves=open_curves(state_dir, cfg, enabled=dist.main, resume_step=progress.step if resumed else None),
        progress=job_progress("training", total_steps, unit="step", log=log, initial=progress.step)
        if dist.main
        else None,
    )

    def checkpoint() -> None:  # the one place a training state is written
        progress.seconds = elapsed_before + time.time() - t_start
        if dist.main:
            progress.log_bytes = train_log.tell()
            save_train_state(state_path, model, opt, progress, cfg, fingerprint, dist.world, total_steps)

    try:
        log(
            f"drafter: {sum(x.numel() for x in model.parameters() if x.requires_grad) / 1e6:.2f}M trainable params, "
            f"{len(train_w)} train / {len(eval_w)} held-out windows ({windows['sequences_cut_into_windows']} "
            f"sequences longer than {cfg.max_seq_len} rows cut into windows, {windows['window_rows']} rows), "
            f"{total_steps} steps, device {device}" + (f", {dist.world} processes" if dist.world > 1 else "")
        )
        log(estimate.describe() + " (estimate: aerie.drafter.memory)")
        if not resumed:
            train_log.write({"event": "data", "windows": windows, "estimated_peak_bytes": estimate.total})
            progress.untrained = held_out_eval()
            train_log.write({"event": "eval", "epoch": 0, **progress.untrained})
            untrained = progress.untrained
            if untrained.get("heldout_start_positions"):
                acceptance, loss = untrained["simulated_acceptance_length"], untrained["heldout_loss"]
                log(f"untrained: acceptance {acceptance:.3f}, loss {loss:.4f}")
                if cfg.init:  # warm start: the start folder competes; an epoch is exported only when it beats it
                    progress.best_epoch, progress.best_acceptance = 0, acceptance
                    if dist.main:
                        export_drafter(model, state_dir / "best", aux_layer_ids, {"epoch": 0, "init": cfg.init})
        else:
            train_log.write(
                {"event": "resume", "epoch": progress.epoch, "position": progress.position, "step": progress.step}
            )

        model.train()
        for epoch in range(progress.epoch, cfg.epochs + 1):
            order = epoch_order(epoch)
            for group in order[progress.position :]:
                t0 = time.time()
                b = load_batch(group, shards, cfg.ttt_steps, device, dtype)
                targets = head.prepare(b, cfg)
                lr = lr_at(progress.step, total_steps, cfg)
                for g in opt.param_groups:
                    g["lr"] = lr
                with autocast(device):
                    loss, stats, _ = unroll(b, targets)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = (
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip) if cfg.grad_clip > 0 else None
                )
                opt.step()
                if pull is not None:
                    pull.step(lr)
                # rows, supervised rows and loss of all ranks (one small all-reduce; a no-op in one process)
                counts = dist.sum(torch.tensor([b.rows, float(stats[0][1]), float(loss.detach())], dtype=torch.float64))
                progress.train_seconds += time.time() - t0
                progress.step += 1
                progress.position += 1
                progress.tokens += int(counts[0])
                progress.supervised += int(counts[1])
                if progress.step % cfg.log_every == 0 or progress.step == total_steps:
                    event = {
                        "event": "train",
                        "epoch": epoch,
                        "step": progress.step,
                        "lr": lr,
                        "loss": float(counts[2]) / dist.world,
                        "loss_per_step": [float(c / max(float(w), 1.0)) for c, w, _ in stats],  # rank 0's
                        "acc_per_step": [float(r / max(float(w), 1.0)) for _, w, r in stats],
                        "grad_norm": float(grad_norm) if grad_norm is not None else None,
                        "tokens": progress.tokens,
                        "tokens_per_s": progress.tokens / max(progress.train_seconds, 1e-9),
                    }
                    train_log.write(event)
                    log(
                        f"step {progress.step}/{total_steps} loss {event['loss']:.4f} "
                        f"acc0 {event['acc_per_step'][0]:.3f} {event['tokens_per_s']:.0f} tok/s"
                    )
                if (
                    cfg.checkpoint_every
                    and progress.step % cfg.checkpoint_every == 0
                    and progress.position < len(order)
                ):
                    checkpoint()  # (the epoch's last batch is checkpointed after its evaluation)
                if on_step is not None:
                    on_step(progress.step)

            # end of epoch: evaluate, export `last` (and `best` when held-out acceptance improved), checkpoint
            evaluation = held_out_eval()
            train_log.write({"event": "eval", "epoch": epoch, **evaluation})
            progress.epochs.append({"epoch": epoch, **evaluation})
            acceptance = evaluation.get("simulated_acceptance_length")
            # the first epoch, a better held-out acceptance, or every epoch when nothing is held out
            improved = acceptance is None or progress.best_acceptance is None or acceptance > progress.best_acceptance
            if dist.main:
                facts = {
                    "target": str(target_path),
                    "hidden_shards": [str(x) for x in hidden_shards],
                    "draft_vocab": str(vocab_path),
                    "train_config": asdict(cfg),
                    "epoch": epoch,
                    "tokens_trained": progress.tokens,
                    # no wall-clock figure here (eval.json has them): a deterministic run exports identical bytes
                    "simulated_acceptance_length": evaluation.get("simulated_acceptance_length"),
                    "heldout_loss": evaluation.get("heldout_loss"),
                }
                export_drafter(model, state_dir / "last", aux_layer_ids, facts)
                if improved:
                    for name in ("model.safetensors", "config.json"):
                        copy_atomic(state_dir / "last" / name, state_dir / "best" / name)
            if improved:
                progress.best_epoch, progress.best_acceptance = epoch, acceptance
            if evaluation.get("heldout_start_positions"):
                log(
                    f"epoch {epoch}: acceptance {acceptance:.3f}, loss {evaluation['heldout_loss']:.4f}"
                    + (" (best so far)" if improved else f" (best: epoch {progress.best_epoch})")
                )
            progress.epoch, progress.position = epoch + 1, 0
            checkpoint()
    finally:
        train_log.close()

    # finished: the best epoch's drafter, the log and eval.json go into out_dir; the resumable state goes
    chosen = progress.epochs[progress.best_epoch - 1] if progress.best_epoch else progress.untrained  # 0: the start
    best = {k: v for k, v in chosen.items() if k != "epoch"}
    seconds = elapsed_before + time.time() - t_start
    result = {
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
        if eval_w
        else [],
        "epochs": progress.epochs,  # every epoch's full held-out evaluation
        "heldout_sequences": len(held),
        "tokens_trained": progress.tokens,  # real rows processed, summed over epochs (each row runs ttt_steps steps)
        "supervised_tokens": progress.supervised,  # step-0 rows that carried loss
        "train_seconds": progress.train_seconds,
        "seconds": seconds,
        "tokens_per_s": progress.tokens / max(progress.train_seconds, 1e-9),
        "optimizer_steps": progress.step,
        "ttt_steps": cfg.ttt_steps,
        "device": str(device),
        "processes": dist.world,
        "windows": windows,
        "memory": {
            "estimated_peak_bytes": estimate.total,  # per process (aerie.drafter.memory)
            "estimated_parts": estimate.parts,
            # what torch allocated at most on this process's GPU (None on the CPU)
            "measured_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        },
    }
    if dist.main:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("model.safetensors", "config.json"):
            copy_atomic(state_dir / "best" / name, out_dir / name)
        check_exported_layer_ids(out_dir, aux_layer_ids)
        copy_atomic(log_tmp, out_dir / "train_log.jsonl")
        publish_curves(state_dir, out_dir)  # tensorboard/: the curves beside the drafter
        atomic_publish(out_dir / "eval.json", lambda path: Path(path).write_text(json.dumps(result, indent=2) + "\n"))
        state_path.unlink(missing_ok=True)  # nothing left to resume; last/ and best/ stay
        log_tmp.unlink(missing_ok=True)
        log(
            f"drafter (epoch {progress.best_epoch} of {cfg.epochs}) written to {out_dir} in {seconds:.1f}s "
            f"({result['tokens_per_s']:.0f} tok/s)"
        )
    dist.barrier()
    return result
