"""Train an EAGLE-3 drafter with training-time test (TTT) on captured target hidden states.

Reading guide (top to bottom): config -> data (hidden shards, draft vocab, windows, batches) -> the TTT
unroll and its loss -> held-out evaluation (simulated acceptance) -> the training loop.

TTT in one paragraph: step 0 feeds fc(aux features) with tokens shifted by one, exactly like SGLang's draft
extend. Step k >= 1 feeds each row's own step k-1 ``hidden_out`` with the token one further on, at position
t+k - exactly what chained draft steps see at inference. Attention follows the same rule (TTTCache): step-k
row t sees step-0 keys of rows <= t and its own row's keys from steps 1..k. The loss at every step is the
soft cross-entropy against the target's next-token distribution restricted to the draft vocab.

Index conventions for one sequence window starting at row ``a`` (all arrays are relative to ``a``):
``ids[p]`` token at p; ``q[p]`` target distribution after p (it predicts token p+1); ``gen[p]`` 1 when token p
was generated (loss mask). Step k, row t: input token ``ids[t+1+k]``, target ``q[t+1+k]``, supervised when
``gen[t+2+k]`` (the predicted token is a generated one).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor

from aerie.drafter.model import DrafterConfig, Eagle3Drafter, TTTCache, atomic_write

HIDDEN_FORMAT = "aerie.hidden/1"
VOCAB_FORMAT = "aerie.draft-vocab/1"
EVAL_FORMAT = "aerie.drafter-eval/1"


@dataclass
class TrainConfig:
    ttt_steps: int = 7  # unrolled draft steps per position (EAGLE-3 uses 7)
    step_loss_decay: float = 0.8  # weight of step k is decay**k
    epochs: int = 2
    learning_rate: float = 1e-4
    weight_decay: float = 0.0  # applied to matrices only, never to norms
    warmup_ratio: float = 0.03
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    grad_clip: float = 0.5
    max_seq_len: int = 2048  # longer sequences are cut into windows of this many rows
    batch_size: int = 4  # windows per optimizer step
    max_batch_tokens: int = 0  # optional cap on batch_size * padded length (0 = none)
    eval_fraction: float = 0.05  # held-out share of sequences, chosen by hashing sample ids
    mask_out_of_vocab_targets: bool = True  # skip positions whose target argmax is outside the draft vocab
    init_head_from_target: bool = True  # start lm_head/norm from the target's (draft-vocab rows)
    seed: int = 0
    threads: int = 0  # torch CPU threads (0 = leave as is)
    log_every: int = 10
    device: str = "auto"  # auto | cpu | cuda


# ----------------------------------------------------------------------------------------------------------
# data


class HiddenShard:
    """One aerie.hidden/1 file: small tensors in memory, the big hidden states read lazily per window."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = safe_open(str(self.path), framework="pt")
        meta = self._file.metadata() or {}
        if meta.get("format") != HIDDEN_FORMAT:
            raise ValueError(f"{self.path}: format {meta.get('format')!r}, expected {HIDDEN_FORMAT!r}")
        self.aux_layer_ids: list[int] = [int(i) for i in json.loads(meta["aux_layer_ids"])]
        self.hidden_size = int(meta["hidden_size"])
        self.vocab_size = int(meta["vocab_size"])
        self.sample_ids: list[str] = json.loads(meta.get("sample_ids", "[]"))
        self.input_ids = self._file.get_tensor("input_ids").long()  # [T]
        self.loss_mask = self._file.get_tensor("loss_mask").bool()  # [T]
        self.seq_offsets = self._file.get_tensor("seq_offsets").long()  # [N+1]
        aux_shape = self._file.get_slice("aux_hidden_states").get_shape()
        if aux_shape != [len(self.input_ids), len(self.aux_layer_ids) * self.hidden_size]:
            raise ValueError(f"{self.path}: aux_hidden_states shape {aux_shape} does not match its metadata")
        if len(self.sample_ids) != self.num_seqs:
            self.sample_ids = [f"{self.path.name}#{i}" for i in range(self.num_seqs)]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_offsets) - 1

    def rows(self, name: str, start: int, end: int) -> Tensor:
        return self._file.get_slice(name)[start:end]


def open_hidden_shards(paths: Sequence[Path]) -> list[HiddenShard]:
    if not paths:
        raise ValueError("no hidden shards given")
    shards = [HiddenShard(Path(p)) for p in paths]
    first = shards[0]
    for s in shards[1:]:
        # Mixing layer conventions would silently train on inconsistent features: refuse.
        if s.aux_layer_ids != first.aux_layer_ids:
            raise ValueError(
                f"hidden shards disagree on aux_layer_ids: {first.path} has {first.aux_layer_ids}, "
                f"{s.path} has {s.aux_layer_ids}; recapture them with one setting"
            )
        if (s.hidden_size, s.vocab_size) != (first.hidden_size, first.vocab_size):
            raise ValueError(f"hidden shards disagree on hidden_size/vocab_size: {first.path} vs {s.path}")
    return shards


@dataclass
class DraftVocab:
    d2t: Tensor  # int64 [Vd]
    t2d: Tensor  # bool [V]

    @property
    def target_ids(self) -> Tensor:  # [Vd] target id of each draft id (ascending)
        return torch.arange(len(self.d2t)) + self.d2t


def load_draft_vocab(path: Path) -> DraftVocab:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != VOCAB_FORMAT:
            raise ValueError(f"{path}: format {meta.get('format')!r}, expected {VOCAB_FORMAT!r}")
        return DraftVocab(d2t=f.get_tensor("d2t").long(), t2d=f.get_tensor("t2d").bool())


@dataclass
class Window:
    """Rows [start, end) of one sequence; tokens/targets are read up to look_end (for the unrolled steps)."""

    shard: int
    start: int
    end: int
    look_end: int
    pos0: int  # position id of row `start` within its sequence


def make_windows(shard_idx: int, shard: HiddenShard, seq: int, max_len: int, ttt_steps: int) -> list[Window]:
    s, e = int(shard.seq_offsets[seq]), int(shard.seq_offsets[seq + 1])
    out = []
    for a in range(s, e, max_len):
        b = min(a + max_len, e)
        look_end = min(b + ttt_steps + 1, e)
        # keep windows with at least one supervised prediction (a generated token at a+2 .. look_end-1)
        if a + 2 < look_end and bool(shard.loss_mask[a + 2 : look_end].any()):
            out.append(Window(shard_idx, a, b, look_end, a - s))
    return out


def split_heldout(shards: list[HiddenShard], fraction: float, seed: int) -> set[tuple[int, int]]:
    """Held-out (shard, seq) pairs: a deterministic hash of each sample id, so adding shards keeps the split."""
    if fraction <= 0:
        return set()
    keyed = []
    for si, shard in enumerate(shards):
        for q in range(shard.num_seqs):
            digest = hashlib.sha256(f"{seed}:{shard.sample_ids[q]}".encode()).hexdigest()
            keyed.append((int(digest[:12], 16) / 16**12, si, q))
    held = {(si, q) for u, si, q in keyed if u < fraction}
    if not held and len(keyed) >= 2:  # tiny runs: hold out at least one sequence
        u, si, q = min(keyed)
        held = {(si, q)}
    if len(held) == len(keyed):
        raise ValueError(f"eval_fraction {fraction} holds out every sequence: nothing left to train on")
    return held


def batches(windows: list[Window], cfg: TrainConfig, generator: torch.Generator | None) -> list[list[Window]]:
    """Shuffle (when a generator is given) and group windows under batch_size and max_batch_tokens."""
    order = torch.randperm(len(windows), generator=generator).tolist() if generator is not None else range(len(windows))
    out, cur, cur_len = [], [], 0
    for i in order:
        w = windows[i]
        n = w.end - w.start
        longest = max(cur_len, n)
        over_tokens = cfg.max_batch_tokens and longest * (len(cur) + 1) > cfg.max_batch_tokens
        if cur and (len(cur) >= cfg.batch_size or over_tokens):
            out.append(cur)
            cur, longest = [], n
        cur.append(w)
        cur_len = longest
    if cur:
        out.append(cur)
    return out


@dataclass
class Batch:
    aux: Tensor  # [B, T, A*H]
    position_ids: Tensor  # [B, T]
    row_valid: Tensor  # [B, T] bool: real rows (not padding)
    ids: Tensor  # [B, W] token ids, W = T + ttt_steps + 2
    have: Tensor  # [B, W] bool: a token and target feature exist at p
    gen: Tensor  # [B, W] bool: token p was generated
    final: Tensor  # [B, W, H] target final hidden (after its norm)
    rows: int  # number of real rows


def load_batch(windows: list[Window], shards: list[HiddenShard], ttt_steps: int, device: torch.device, dtype: torch.dtype) -> Batch:
    B = len(windows)
    T = max(w.end - w.start for w in windows)
    W = T + ttt_steps + 2
    first = shards[windows[0].shard]
    A_H, H = len(first.aux_layer_ids) * first.hidden_size, first.hidden_size
    aux = torch.zeros(B, T, A_H, dtype=dtype)
    final = torch.zeros(B, W, H, dtype=dtype)
    ids = torch.zeros(B, W, dtype=torch.long)
    have = torch.zeros(B, W, dtype=torch.bool)
    gen = torch.zeros(B, W, dtype=torch.bool)
    row_valid = torch.zeros(B, T, dtype=torch.bool)
    position_ids = torch.zeros(B, T, dtype=torch.long)
    for i, w in enumerate(windows):
        sh = shards[w.shard]
        n, m = w.end - w.start, w.look_end - w.start
        aux[i, :n] = sh.rows("aux_hidden_states", w.start, w.end).to(dtype)
        final[i, :m] = sh.rows("final_hidden_states", w.start, w.look_end).to(dtype)
        ids[i, :m] = sh.input_ids[w.start : w.look_end]
        gen[i, :m] = sh.loss_mask[w.start : w.look_end]
        have[i, :m] = True
        row_valid[i, :n] = True
        position_ids[i] = w.pos0 + torch.arange(T)
    to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    return Batch(to(aux), to(position_ids), to(row_valid), to(ids), to(have), to(gen), to(final), int(row_valid.sum()))


@dataclass
class TargetHead:
    """The target's frozen lm_head: full [V,H] for greedy tokens, draft rows [Vd,H] for the soft targets."""

    full: Tensor
    draft: Tensor
    t2d: Tensor  # bool [V]

    @torch.no_grad()
    def soft_targets(self, final: Tensor) -> Tensor:
        """[B,W,H] -> [B,W,Vd]: target next-token distribution renormalised over the draft vocab."""
        return torch.softmax((final @ self.draft.T).float(), dim=-1)

    @torch.no_grad()
    def greedy(self, final: Tensor, chunk: int = 512) -> Tensor:
        """[B,W,H] -> [B,W] target argmax over the full vocab, in row chunks to bound memory."""
        flat = final.reshape(-1, final.shape[-1])
        out = torch.cat([(flat[i : i + chunk] @ self.full.T).argmax(-1) for i in range(0, len(flat), chunk)])
        return out.view(final.shape[:-1])


# ----------------------------------------------------------------------------------------------------------
# TTT unroll, loss, evaluation


def ttt_unroll(model: Eagle3Drafter, aux: Tensor, ids: Tensor, position_ids: Tensor, steps: int) -> list[Tensor]:
    """Unrolled chained drafting over every row at once; returns per-step draft logits [B,T,Vd]."""
    T = aux.shape[1]
    cache = TTTCache()
    hidden = model.project_aux(aux)  # [B,T,H] step 0: target features
    logits_per_step = []
    for k in range(steps):
        tokens = ids[:, 1 + k : 1 + k + T]  # token t+1+k at row t
        logits, hidden = model(hidden, tokens, position_ids + k, cache)  # hidden_out feeds step k+1
        logits_per_step.append(logits)
    return logits_per_step


def step_weights(batch: Batch, k: int, in_vocab: Tensor | None) -> Tensor:
    """[B,T] float: rows supervised at step k (real row, predicted token generated, optionally in-vocab target)."""
    T = batch.row_valid.shape[1]
    w = batch.row_valid & batch.gen[:, 2 + k : 2 + k + T]
    if in_vocab is not None:
        w = w & in_vocab[:, 1 + k : 1 + k + T]
    return w.float()


def ttt_loss(logits_per_step: list[Tensor], q: Tensor, batch: Batch, in_vocab: Tensor | None, decay: float):
    """Weighted sum over steps of masked soft cross-entropy; also per-step (ce_sum, weight_sum, correct)."""
    T = batch.row_valid.shape[1]
    total = torch.zeros((), device=q.device)
    stats = []
    for k, logits in enumerate(logits_per_step):
        q_k = q[:, 1 + k : 1 + k + T]  # [B,T,Vd]
        w = step_weights(batch, k, in_vocab)  # [B,T]
        ce = -(q_k * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # [B,T]
        ce_sum, w_sum = (ce * w).sum(), w.sum()
        total = total + decay**k * ce_sum / w_sum.clamp_min(1.0)
        correct = ((logits.argmax(-1) == q_k.argmax(-1)).float() * w).sum()
        stats.append((ce_sum.detach(), w_sum, correct))
    return total, stats


EMPTY_EVAL = {  # what eval.json says when there is nothing held out
    "simulated_acceptance_length": None,
    "acceptance_per_position": [],
    "simulated_acceptance_length_by_steps": [],
    "heldout_loss": None,
    "heldout_loss_per_step": [],
    "heldout_accuracy_per_step": [],
    "heldout_start_positions": 0,
}


@torch.no_grad()
def evaluate(model: Eagle3Drafter, groups: list[list[Window]], shards, head: TargetHead, cfg: TrainConfig, device, dtype) -> dict:
    """Held-out TTT loss plus simulated chain acceptance with greedy verification.

    For every held-out start row t whose first drafted token is a generated one, draft step k is accepted
    when its argmax (mapped to a target id) equals the target's greedy token at t+1+k and all earlier steps
    were accepted; acceptance length = 1 (bonus token) + accepted steps. Later steps are fed the recorded
    tokens, which equal the accepted drafts when the data was generated greedily (exact simulation then).
    """
    model.eval()
    K = cfg.ttt_steps
    ce = torch.zeros(K, dtype=torch.float64)
    wsum = torch.zeros(K, dtype=torch.float64)
    correct = torch.zeros(K, dtype=torch.float64)
    accepted_at = torch.zeros(K, dtype=torch.float64)  # starts whose chain reached step k accepted
    starts = 0
    for group in groups:
        b = load_batch(group, shards, K, device, dtype)
        T = b.row_valid.shape[1]
        q = head.soft_targets(b.final)
        greedy = head.greedy(b.final)  # [B,W]
        in_vocab = head.t2d[greedy] if cfg.mask_out_of_vocab_targets else None
        with _autocast(device):
            steps = ttt_unroll(model, b.aux, b.ids, b.position_ids, K)
        _, stats = ttt_loss(steps, q, b, in_vocab, cfg.step_loss_decay)
        for k, (c, w, r) in enumerate(stats):
            ce[k] += float(c)
            wsum[k] += float(w)
            correct[k] += float(r)
        start = b.row_valid & b.gen[:, 2 : 2 + T]  # [B,T]
        chain = start.clone()
        for k, logits in enumerate(steps):
            draft = model.draft_to_target(logits.argmax(-1))  # [B,T] target ids
            ok = (draft == greedy[:, 1 + k : 1 + k + T]) & b.have[:, 2 + k : 2 + k + T]
            chain = chain & ok
            accepted_at[k] += float(chain.sum())
        starts += int(start.sum())
    model.train()
    if starts == 0:
        return dict(EMPTY_EVAL)
    loss_k = (ce / wsum.clamp_min(1)).tolist()
    per_pos = (accepted_at / starts).tolist()
    return {
        "simulated_acceptance_length": 1.0 + sum(per_pos),
        "acceptance_per_position": per_pos,
        # what a chain of n draft steps would give: 1 + sum of the first n per-position rates
        "simulated_acceptance_length_by_steps": [1.0 + sum(per_pos[:n]) for n in range(1, K + 1)],
        "heldout_loss": sum(cfg.step_loss_decay**k * l for k, l in enumerate(loss_k)),
        "heldout_loss_per_step": loss_k,
        "heldout_accuracy_per_step": (correct / wsum.clamp_min(1)).tolist(),
        "heldout_start_positions": starts,
    }


# ----------------------------------------------------------------------------------------------------------
# training loop


def _autocast(device: torch.device):
    # bf16 autocast on GPU; exact fp32 on CPU (deterministic, and CPU bf16 is slow).
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warmup = max(1, math.ceil(cfg.warmup_ratio * total))
    if step < warmup:
        return cfg.learning_rate * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.learning_rate * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _load_target_heads(target_path: Path, vocab: DraftVocab, aux_layer_ids: list[int], cfg: TrainConfig):
    """Load the target once: a drafter with its embeddings, and its frozen lm_head. The target is then freed."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=torch.float32)
    dcfg = DrafterConfig.from_target(target.config, len(vocab.d2t), aux_layer_ids)
    torch.manual_seed(cfg.seed)  # deterministic drafter init
    model = Eagle3Drafter.from_target(target, dcfg, vocab.d2t, vocab.t2d, init_head_from_target=cfg.init_head_from_target)
    lm_head = target.get_output_embeddings().weight.detach().float().clone()  # [V,H]
    del target
    return model, dcfg, lm_head


def train_drafter(
    hidden_shards: Sequence[Path],
    vocab_path: Path,
    target_path: Path,
    out_dir: Path,
    cfg: TrainConfig,
    log: Callable[[str], None] = print,
) -> dict:
    """Train a drafter on hidden shards; write out_dir (drafter folder, train_log.jsonl, eval.json); return eval."""
    t_start = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    dtype = torch.float32  # master weights and batch tensors; autocast handles bf16 on GPU
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    shards = open_hidden_shards(hidden_shards)
    aux_layer_ids = shards[0].aux_layer_ids
    vocab = load_draft_vocab(Path(vocab_path))
    model, dcfg, lm_head = _load_target_heads(Path(target_path), vocab, aux_layer_ids, cfg)
    if (shards[0].hidden_size, shards[0].vocab_size) != (dcfg.hidden_size, dcfg.vocab_size):
        raise ValueError(
            f"hidden shards were captured from a target with hidden {shards[0].hidden_size}, vocab "
            f"{shards[0].vocab_size}; {target_path} has hidden {dcfg.hidden_size}, vocab {dcfg.vocab_size}"
        )
    model = model.to(device)
    head = TargetHead(full=lm_head.to(device), draft=lm_head[vocab.target_ids].to(device), t2d=vocab.t2d.to(device))

    # windows and the held-out split (by sequence)
    held = split_heldout(shards, cfg.eval_fraction, cfg.seed)
    train_w, eval_w = [], []
    for si, sh in enumerate(shards):
        for seq in range(sh.num_seqs):
            (eval_w if (si, seq) in held else train_w).extend(make_windows(si, sh, seq, cfg.max_seq_len, cfg.ttt_steps))
    if not train_w:
        raise ValueError("no training windows: the shards hold no generated (loss-masked) tokens")
    eval_groups = batches(eval_w, cfg, None)

    decay_params = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other_params = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay_params, "weight_decay": cfg.weight_decay}, {"params": other_params, "weight_decay": 0.0}],
        lr=cfg.learning_rate,
        betas=(0.9, 0.95),
    )
    shuffle = torch.Generator().manual_seed(cfg.seed)
    steps_per_epoch = len(batches(train_w, cfg, torch.Generator().manual_seed(cfg.seed)))
    total_steps = cfg.epochs * steps_per_epoch

    log_path = out_dir / "train_log.jsonl"
    log_tmp = out_dir / ".train_log.jsonl.partial"
    log_file = log_tmp.open("w")

    def record(event: dict) -> None:
        log_file.write(json.dumps(event) + "\n")
        log_file.flush()

    log(
        f"drafter: {sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6:.2f}M trainable params, "
        f"{len(train_w)} train / {len(eval_w)} held-out windows, {total_steps} steps, device {device}"
    )
    untrained = evaluate(model, eval_groups, shards, head, cfg, device, dtype) if eval_groups else dict(EMPTY_EVAL)
    record({"event": "eval", "epoch": 0, **untrained})
    if untrained.get("heldout_start_positions"):
        log(f"untrained: acceptance {untrained['simulated_acceptance_length']:.3f}, loss {untrained['heldout_loss']:.4f}")

    model.train()
    step, tokens, supervised, train_seconds = 0, 0, 0, 0.0
    per_epoch = []
    evaluation = untrained
    for epoch in range(1, cfg.epochs + 1):
        for group in batches(train_w, cfg, shuffle):
            t0 = time.time()
            b = load_batch(group, shards, cfg.ttt_steps, device, dtype)
            q = head.soft_targets(b.final)
            in_vocab = head.t2d[head.greedy(b.final)] if cfg.mask_out_of_vocab_targets else None
            lr = lr_at(step, total_steps, cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            with _autocast(device):
                steps = ttt_unroll(model, b.aux, b.ids, b.position_ids, cfg.ttt_steps)
            loss, stats = ttt_loss(steps, q, b, in_vocab, cfg.step_loss_decay)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip) if cfg.grad_clip > 0 else None
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            train_seconds += time.time() - t0
            step += 1
            tokens += b.rows
            supervised += int(stats[0][1])
            if step % cfg.log_every == 0 or step == total_steps:
                event = {
                    "event": "train",
                    "epoch": epoch,
                    "step": step,
                    "lr": lr,
                    "loss": float(loss.detach()),
                    "loss_per_step": [float(c / max(float(w), 1.0)) for c, w, _ in stats],
                    "acc_per_step": [float(r / max(float(w), 1.0)) for _, w, r in stats],
                    "grad_norm": float(grad_norm) if grad_norm is not None else None,
                    "tokens": tokens,
                    "tokens_per_s": tokens / max(train_seconds, 1e-9),
                }
                record(event)
                log(f"step {step}/{total_steps} loss {event['loss']:.4f} acc0 {event['acc_per_step'][0]:.3f} {event['tokens_per_s']:.0f} tok/s")
        if eval_groups:
            evaluation = evaluate(model, eval_groups, shards, head, cfg, device, dtype)
            record({"event": "eval", "epoch": epoch, **evaluation})
            per_epoch.append({"epoch": epoch, **{k: evaluation.get(k) for k in ("simulated_acceptance_length", "heldout_loss")}})
            if evaluation.get("heldout_start_positions"):
                log(f"epoch {epoch}: acceptance {evaluation['simulated_acceptance_length']:.3f}, loss {evaluation['heldout_loss']:.4f}")

    seconds = time.time() - t_start
    result = {
        "format": EVAL_FORMAT,
        **evaluation,
        "untrained": {k: untrained.get(k) for k in ("simulated_acceptance_length", "acceptance_per_position", "heldout_loss")},
        "per_epoch": per_epoch,
        "heldout_sequences": len(held),
        "tokens_trained": tokens,  # real rows processed, summed over epochs (each row runs ttt_steps steps)
        "supervised_tokens": supervised,  # step-0 rows that carried loss
        "train_seconds": train_seconds,
        "seconds": seconds,
        "tokens_per_s": tokens / max(train_seconds, 1e-9),
        "optimizer_steps": step,
        "ttt_steps": cfg.ttt_steps,
        "device": str(device),
    }
    facts = {
        "target": str(target_path),
        "hidden_shards": [str(p) for p in hidden_shards],
        "draft_vocab": str(vocab_path),
        "train_config": asdict(cfg),
        "tokens_trained": tokens,
        "seconds": round(seconds, 3),
        "simulated_acceptance_length": evaluation.get("simulated_acceptance_length"),
        "heldout_loss": evaluation.get("heldout_loss"),
    }
    model.save_pretrained(out_dir, extra=facts)
    log_file.close()
    os.replace(log_tmp, log_path)
    atomic_write(out_dir / "eval.json", lambda p: Path(p).write_text(json.dumps(result, indent=2) + "\n"))
    log(f"drafter written to {out_dir} in {seconds:.1f}s ({result['tokens_per_s']:.0f} tok/s)")
    return result
