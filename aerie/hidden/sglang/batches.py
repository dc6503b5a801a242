"""The capture's input and output tensors: token sequences in, SGLang's flat hidden states split per sequence."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aerie.hidden.sglang.mapping import SGLangCaptureError


def check_sequences(seqs: Sequence[torch.Tensor], vocab_size: int) -> list[list[int]]:
    """1-D integer tensors of known token ids -> lists of ints (what SGLang's requests take)."""
    out = []
    for s, t in enumerate(seqs):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point() or t.is_complex():
            raise ValueError(
                f"sequence {s}: expected a 1-D integer tensor, got "
                f"{type(t).__name__} {getattr(t, 'dtype', '')} {tuple(getattr(t, 'shape', ()))}"
            )
        if not len(t):
            raise ValueError(f"sequence {s} is empty")
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"sequence {s}: token ids span [{lo}, {hi}], outside the target's vocabulary [0, {vocab_size})"
            )
        out.append(t.tolist())
    return out


def split_capture(
    aux: torch.Tensor | None, final: torch.Tensor | None, lengths: Sequence[int], num_aux: int, hidden_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """SGLang's flat outputs of one extend forward -> per-sequence (aux [T, A*H], final [T, H]).

    SGLang lays the batch's tokens end to end: aux [sum T, A*H] (layers concatenated in layer order),
    final [sum T, H]. Any other shape means the capture is not what was asked for, and says how."""
    total, width = sum(lengths), num_aux * hidden_size
    if aux is None:
        raise SGLangCaptureError("SGLang returned no hidden states: the forward did not run in FULL capture mode")
    if final is None:
        raise SGLangCaptureError(
            "SGLang returned no final (post-norm) hidden states beside the aux ones: "
            "this SGLang keeps last_hidden_states only with --enable-return-aux-hidden-states"
        )
    if aux.dim() != 2 or final.dim() != 2:
        raise SGLangCaptureError(
            f"SGLang returned aux {tuple(aux.shape)}, final {tuple(final.shape)}: expected 2-D [tokens, width]"
        )
    if aux.shape[0] != total or final.shape[0] != total:
        hint = (
            " (one row per sequence: the hidden states were pruned to the last token, capture mode LAST)"
            if aux.shape[0] == len(lengths)
            else ""
        )
        raise SGLangCaptureError(
            f"SGLang returned {aux.shape[0]} aux and {final.shape[0]} final rows for a batch of "
            f"{total} tokens in {len(lengths)} sequences{hint}"
        )
    if final.shape[1] != hidden_size:
        raise SGLangCaptureError(
            f"SGLang's final hidden states are {final.shape[1]} wide, the target's hidden_size is {hidden_size}"
        )
    if aux.shape[1] != width:
        if aux.shape[1] == hidden_size:
            hint = "one hidden state wide: aux capture is off and SGLang returned the final state in its place"
        elif aux.shape[1] % hidden_size == 0:
            hint = f"{aux.shape[1] // hidden_size} layers captured, {num_aux} asked for"
        else:
            hint = "not a multiple of hidden_size"
        raise SGLangCaptureError(
            f"SGLang's aux hidden states are {aux.shape[1]} wide, expected {num_aux} x {hidden_size} = {width} ({hint})"
        )
    return list(zip(aux.split(list(lengths)), final.split(list(lengths))))


DIGEST_ROWS = 4096  # rows converted to fp32 at a time (Kimi: 4096 x 7168 x 4 bytes = 117 MB)


def states_digest(aux: torch.Tensor | None, final: torch.Tensor | None) -> torch.Tensor | None:
    """Per token: the sum and the sum of squares of each aux layer's state and of the final state, fp32 on the
    CPU, [T, 2 * (A + 1)]. Tensor-parallel ranks compare theirs with rank 0's (replicated states agree to
    rounding); None when SGLang returned no states (split_capture says why)."""
    if aux is None or final is None or aux.dim() != 2 or final.dim() != 2 or aux.shape[0] != final.shape[0]:
        return None
    T, H = final.shape
    if aux.shape[1] % H:
        return None
    out = torch.empty(T, 2 * (aux.shape[1] // H + 1))
    for r in range(0, T, DIGEST_ROWS):
        parts = torch.cat(
            [aux[r : r + DIGEST_ROWS].reshape(-1, aux.shape[1] // H, H), final[r : r + DIGEST_ROWS, None]], 1
        )
        parts = parts.float()  # [rows, A + 1, H]
        out[r : r + len(parts)] = torch.cat([parts.sum(-1), parts.square().sum(-1)], -1).cpu()
    return out


def check_replicated(digests: dict[int, torch.Tensor | None], batch: int, tolerance: float = 1e-3) -> float:
    """Refuse a batch whose tensor-parallel ranks hold other states than rank 0 (``digests``: rank -> its
    :func:`states_digest`); returns the largest difference from rank 0's, relative to rank 0's largest value."""
    ref = digests.get(0)
    worst = 0.0
    for rank, d in sorted(digests.items()):
        if rank == 0:
            continue
        if ref is None or d is None or d.shape != ref.shape:
            shapes = (
                f"{None if d is None else tuple(d.shape)} against rank 0's {None if ref is None else tuple(ref.shape)}"
            )
            raise SGLangCaptureError(
                f"batch {batch}: tensor-parallel rank {rank} returned a state digest of shape {shapes}: the ranks "
                f"do not hold the same token rows (SGLang split the batch's rows across ranks; dp attention?)"
            )
        diff = float((d - ref).abs().max() / ref.abs().max().clamp_min(1e-12)) if len(ref) else 0.0
        if not diff <= tolerance:
            raise SGLangCaptureError(
                f"batch {batch}: tensor-parallel rank {rank} holds other hidden states than rank 0 (largest "
                f"difference {diff:.2e} of rank 0's largest value, over {tolerance:g}): SGLang's states are not "
                f"replicated across ranks (a partial sum captured before its all-reduce?), so rank 0's would be "
                f"one rank's share, not the target's states"
            )
        worst = max(worst, diff)
    return worst
