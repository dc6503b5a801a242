"""The capture's input and output tensors: token sequences in, SGLang's flat hidden states split per sequence."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aerie.sglang_capture.mapping import SGLangCaptureError


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
