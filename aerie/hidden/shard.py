"""One tokens shard -> one checked hidden shard (format ``aerie.hidden/2``, aerie.formats.hidden).

The session's backend captures the shard's sequences a length-sorted batch at a time; each batch is checked
on the full-precision states (aerie.hidden.checks) and compressed at once to the storage layout, so only the
stored form of the shard is ever held whole. Nothing of one shard carries over to the next: the bytes equal
those of a target loaded for that shard alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aerie.formats.hidden import FP8, quantize_aux, write_hidden_shard
from aerie.formats.tokens import mask_facts, read_tokens_shard
from aerie.hidden.backends import TargetSession, length_batches
from aerie.hidden.checks import CaptureChecks, HiddenStateError, check_agreement
from aerie.hidden.head import lm_head_topk
from aerie.hidden.settings import CaptureSettings
from aerie.target_model.model import set_threads
from aerie.tools.artifacts import split_packed
from aerie.tools.progress import JobProgress, job_progress


def open_session(settings: CaptureSettings, target_path: str, log: Callable[[str], None]) -> TargetSession:
    """Set the capture threads and open a session on the target; nothing loads before the first shard."""
    set_threads(settings.threads)
    return TargetSession(
        target_path,
        aux_layer_ids=settings.aux_layer_ids,
        backend=settings.backend,
        backend_options=settings.backend_options,
        batch_tokens=settings.batch_tokens,
        device=settings.device,
        dtype=settings.dtype,
        trust_remote_code=settings.trust_remote_code,
        log=log,
    )


@torch.no_grad()
def capture_shard(
    tokens_path: Path,
    out_path: Path,
    target_path: str,
    settings: CaptureSettings,
    *,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Capture the aux + final states of every sequence of one tokens shard with a target loaded for it alone,
    check them, write one shard. The pipeline captures all shards with one load: aerie.hidden.run.capture_shards."""
    with open_session(settings, target_path, log) as session:
        return capture_into(session, tokens_path, out_path, settings, log=log)


@dataclass
class _Captured:
    """What capturing a shard's batches gives: each sequence's stored tensors and the next-token tallies."""

    per_seq: list[dict[str, torch.Tensor] | None]
    checks: CaptureChecks
    agree: int = 0  # generated positions whose recorded token is the target's top-1
    in_topk: int = 0  # ... among the target's top k
    total: int = 0  # generated positions judged
    mass_sum: float = 0.0  # compact: the top-k probability mass summed over those positions
    mass_rows: int = 0

    @property
    def agreement(self) -> float:
        return self.agree / self.total if self.total else 1.0

    @property
    def topk_rate(self) -> float:
        return self.in_topk / self.total if self.total else 1.0


@torch.no_grad()
def capture_into(
    session: TargetSession,
    tokens_path: Path,
    out_path: Path,
    settings: CaptureSettings,
    *,
    extra_facts: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Capture one tokens shard with the session's target (loading it if this is the first shard), check it
    on the full-precision states, write it atomically to ``out_path``. Nothing of one shard carries over to
    the next: the bytes equal those of a session opened for this shard alone."""
    tensors, meta = read_tokens_shard(tokens_path)  # a shifted or partial loss mask stops here
    seqs = split_packed(tensors["input_ids"], tensors["seq_offsets"])
    masks = split_packed(tensors["loss_mask"], tensors["seq_offsets"])
    cap, lm_head = session.open()
    started = time.perf_counter()  # after the load: "seconds" is what this shard's capture took
    k = min(settings.target_topk, cap.vocab_size)
    with job_progress(
        f"capture {out_path.name}", len(tensors["input_ids"]), unit="tok", log=log, unit_scale=True
    ) as bar:
        got = _capture_batches(session, cap, lm_head, seqs, masks, settings, k, out_path, bar)
    _check_captured(got, tensors, k, settings, out_path)
    stored = _stored_tensors(got.per_seq, settings, len(session.layer_ids), cap.hidden_size, k)
    facts = _shard_facts(session, cap, settings, meta, got, k, extra_facts)
    write_hidden_shard(
        out_path,
        {
            "input_ids": tensors["input_ids"],
            "loss_mask": tensors["loss_mask"],
            "seq_offsets": tensors["seq_offsets"],
            **stored,
        },
        facts,
    )
    summary = {
        "sequences": len(seqs),
        "tokens": got.checks.rows,
        "layout": settings.layout,
        "aux_layer_ids": session.layer_ids,
        "next_token_agreement": got.agreement,
        "next_token_in_topk": got.topk_rate,
        "bytes": out_path.stat().st_size,
        "seconds": round(time.perf_counter() - started, 2),
    }
    if settings.layout == "compact":
        summary["target_topk_mass"] = facts["target_topk_mass"]
    log(f"{out_path.name}: {summary}")
    return summary


def _capture_batches(
    session: TargetSession,
    cap: Any,
    lm_head: torch.Tensor,
    seqs: list[torch.Tensor],
    masks: list[torch.Tensor],
    settings: CaptureSettings,
    k: int,
    out_path: Path,
    bar: JobProgress,
) -> _Captured:
    """Capture a batch of sequences at a time and compress it at once: only the stored form of the shard is ever
    held whole. Ascending length keeps padding low; outputs go back in the shard's order."""
    A, H = len(session.layer_ids), cap.hidden_size
    got = _Captured(per_seq=[None] * len(seqs), checks=CaptureChecks(session.layer_ids, H, str(out_path)))
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for group in length_batches([len(seqs[i]) for i in order], session.options["batch_tokens"]):
        idx = [order[g] for g in group]
        outs = cap.capture([seqs[s] for s in idx])
        if len(outs) != len(idx):
            raise HiddenStateError(
                f"{out_path}: backend {session.backend_name} returned {len(outs)} results for {len(idx)} sequences"
            )
        for s, (aux, final) in zip(idx, outs):
            n = len(seqs[s])
            if aux.shape != (n, A * H) or final.shape != (n, H):
                raise HiddenStateError(
                    f"{out_path}: sequence {s}: backend returned aux {tuple(aux.shape)}, "
                    f"final {tuple(final.shape)} for {n} tokens (expected ({n}, {A * H}), "
                    f"({n}, {H}))"
                )
            got.checks.update(aux, final)
            got.per_seq[s] = _judge_and_store(got, aux, final, lm_head, seqs[s], masks[s], settings, A, k)
        bar.update(sum(len(seqs[s]) for s in idx))
    if got.checks.rows:  # an empty shard (a dataset that reached its quota) has no states to judge
        got.checks.finish()
    return got


def _judge_and_store(
    got: _Captured,
    aux: torch.Tensor,
    final: torch.Tensor,
    lm_head: torch.Tensor,
    seq: torch.Tensor,
    mask: torch.Tensor,
    settings: CaptureSettings,
    A: int,
    k: int,
) -> dict[str, torch.Tensor]:
    """One sequence: tally its next-token agreement with the recorded tokens, and its tensors in stored form."""
    # Next-token agreement: lm_head(final at t) should give token t+1 wherever t+1 was generated.
    top_ids, top_lp = lm_head_topk(final, lm_head, k)
    gen_next = mask[1:].bool()
    recorded = seq[1:][gen_next].long()
    got.agree += int((top_ids[:-1, 0][gen_next] == recorded).sum())
    # Sampled data (temperature > 0): the sampled token should still be among the target's top k.
    got.in_topk += int((top_ids[:-1][gen_next] == recorded[:, None]).any(-1).sum())
    got.total += int(gen_next.sum())
    if settings.layout == "compact":
        q, scale = quantize_aux(aux, A)
        mass = top_lp[:-1][gen_next].exp().sum(-1)
        got.mass_sum, got.mass_rows = got.mass_sum + float(mass.sum()), got.mass_rows + len(mass)
        return {
            "aux_hidden_states": q,
            "aux_scales": scale,
            "target_topk_ids": top_ids.to(torch.int32),
            "target_topk_logprobs": top_lp.half(),
        }
    store = getattr(torch, settings.storage_dtype)
    return {"aux_hidden_states": aux.to(store), "final_hidden_states": final.to(store)}


def _check_captured(
    got: _Captured, tensors: dict[str, torch.Tensor], k: int, settings: CaptureSettings, out_path: Path
) -> None:
    """Every position captured, and the next-token figures at the configured thresholds (raises otherwise)."""
    if got.checks.rows != tensors["input_ids"].shape[0]:
        raise HiddenStateError(
            f"{out_path}: captured {got.checks.rows} positions, tokens shard has {tensors['input_ids'].shape[0]}"
        )
    check_agreement(
        str(out_path),
        got.agreement,
        got.topk_rate,
        k,
        settings.min_next_token_agreement,
        settings.min_next_token_in_topk,
    )


def _stored_tensors(
    per_seq: list[dict[str, torch.Tensor] | None], settings: CaptureSettings, A: int, H: int, k: int
) -> dict[str, torch.Tensor]:
    """The shard's stored tensors, its sequences' in order; zero sequences: the same tensors with no rows, so
    every reader stays simple."""
    if per_seq:
        return {name: torch.cat([p[name] for p in per_seq]) for name in per_seq[0]}
    if settings.layout == "compact":
        return {
            "aux_hidden_states": torch.zeros(0, A * H, dtype=FP8),
            "aux_scales": torch.zeros(0, A),
            "target_topk_ids": torch.zeros(0, k, dtype=torch.int32),
            "target_topk_logprobs": torch.zeros(0, k, dtype=torch.float16),
        }
    store = getattr(torch, settings.storage_dtype)
    return {
        "aux_hidden_states": torch.zeros(0, A * H, dtype=store),
        "final_hidden_states": torch.zeros(0, H, dtype=store),
    }


def _shard_facts(
    session: TargetSession,
    cap: Any,
    settings: CaptureSettings,
    meta: dict[str, Any],
    got: _Captured,
    k: int,
    extra_facts: dict[str, Any] | None,
) -> dict[str, Any]:
    """The hidden shard's metadata (docs/formats.md, "Hidden shard")."""
    facts: dict[str, Any] = {
        "layout": settings.layout,
        "aux_layer_ids": session.layer_ids,
        "num_hidden_layers": session.num_layers,
        "hidden_size": cap.hidden_size,
        "vocab_size": cap.vocab_size,
        "target": str(session.target_path),
        "backend": session.backend_name,
        "sample_ids": meta.get("sample_ids", []),
        # the tokens shard's mask facts, so readers can check the mask again (aerie.formats.tokens.check_tokens_shard)
        **mask_facts(meta),
        "next_token_agreement": round(got.agreement, 6),
        "next_token_in_topk": round(got.topk_rate, 6),
        "next_token_agreement_positions": got.total,
        **(extra_facts or {}),
    }
    if settings.layout == "compact":
        facts.update(
            aux_dtype="float8_e4m3fn",
            target_topk=k,
            target_topk_mass=round(got.mass_sum / got.mass_rows, 6) if got.mass_rows else None,
        )
    else:
        facts["storage_dtype"] = settings.storage_dtype
    return facts
