"""Greedy decoding and lossless speculative decoding (chain drafting, greedy verification), batch size 1.

``greedy_generate`` is the baseline: one target forward per generated token, with a KV cache.
``speculative_generate`` lets a *proposer* guess up to ``num_draft_steps`` tokens, checks them all in
ONE target forward, and commits the longest prefix that equals the target's own argmax plus the
target's next token (the "bonus"). At temperature 0 it must emit exactly the greedy tokens; any
difference comes from numerics (a k+1-token forward vs. 1-token forwards near a logit tie) or a bug,
and the benchmark reports it instead of hiding it.

Proposers are pluggable (see ``Proposer``): each drafter kind drafts through one (its torch side's
``proposer``: EAGLE-3 chains, DFlash blocks, both on the target's captured features); ``NgramProposer`` is prompt
lookup, a drafter-free reference.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from transformers import DynamicCache

from aerie.target_model.capture import AuxHiddenCapture

# ---------------------------------------------------------------------------------------------
# Proposers
# ---------------------------------------------------------------------------------------------


@runtime_checkable
class Proposer(Protocol):
    """Guesses the target's next tokens. One instance serves one sequence at a time.

    ``aux_layer_ids``: target decoder layers whose outputs the proposer consumes (None: it needs none,
    and the target runs without capture hooks).
    """

    aux_layer_ids: Sequence[int] | None

    def reset(self) -> None:
        """Forget the previous sequence."""

    def propose(self, tokens: Sequence[int], aux: torch.Tensor | None, max_drafts: int) -> list[int]:
        """Return at most ``max_drafts`` guesses for the tokens that follow ``tokens``.

        ``tokens``: the committed sequence (prompt + generated so far).
        ``aux``: ``[1, m, A*H]`` target features of the committed positions the proposer has not been
        shown yet, i.e. ``tokens[-1-m:-1]`` (the newest token has no target feature yet); None when
        ``aux_layer_ids`` is None. Every call's features must be consumed, even with ``max_drafts == 0``.
        """
        ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (longest n
    first) and propose what followed it. Needs no drafter and no target features."""

    aux_layer_ids = None

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def reset(self) -> None:
        pass

    def propose(self, tokens: Sequence[int], aux: torch.Tensor | None, max_drafts: int) -> list[int]:
        if max_drafts <= 0:
            return []
        toks = list(tokens)
        for n in range(min(self.max_ngram, len(toks) - 1), self.min_ngram - 1, -1):
            suffix = toks[-n:]
            for start in range(len(toks) - n - 1, -1, -1):
                if toks[start : start + n] == suffix:
                    return toks[start + n : start + n + max_drafts]
        return []


# ---------------------------------------------------------------------------------------------
# Target helpers
# ---------------------------------------------------------------------------------------------


@functools.cache
def _forward_params(model_cls: type) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(model_cls.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _target_forward(
    target: nn.Module,
    ids: torch.Tensor,
    cache: DynamicCache,
    last_only: bool,
    capture: AuxHiddenCapture | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits [1, T or 1, V], aux [1, T, A*H] or None) for ``ids`` appended to ``cache``."""
    params = _forward_params(type(target))
    # transformers >= 5.2x renamed past_key_values to cache; remote-code targets keep the old name.
    kwargs = {"cache" if "cache" in params else "past_key_values": cache}
    if last_only and "logits_to_keep" in params:  # most causal LMs take it; skip the full-vocab matmul
        kwargs["logits_to_keep"] = 1
    logits = target(input_ids=ids, use_cache=True, **kwargs).logits
    aux = capture.aux_hidden_states() if capture is not None else None
    return logits, aux


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of a transformers cache.

    ``crop`` changed meaning across transformers versions (4.x: final length; 5.x: a negative count to
    remove); a negative count means "remove that many" in both, so use only that form.
    """
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if extra > 0:
        cache.crop(-extra)


def _check_input(input_ids: torch.Tensor) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [1, n] with n >= 1, got {tuple(input_ids.shape)}")


def _is_done(generated: Sequence[int], eos: set[int], max_new_tokens: int) -> bool:
    return len(generated) >= max_new_tokens or (bool(generated) and generated[-1] in eos)


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


@torch.inference_mode()
def greedy_generate(
    target: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, eos_token_ids: Iterable[int] = ()
) -> list[int]:
    """Plain greedy decoding (the baseline): generated ids, ending with the eos id if one was emitted."""
    _check_input(input_ids)
    eos = {int(t) for t in eos_token_ids}
    generated: list[int] = []
    if max_new_tokens <= 0:
        return generated
    cache = DynamicCache()
    logits, _ = _target_forward(target, input_ids, cache, last_only=True)
    while True:
        generated.append(int(logits[0, -1].argmax()))
        if _is_done(generated, eos, max_new_tokens):
            return generated
        step = torch.tensor([[generated[-1]]], dtype=torch.long, device=input_ids.device)
        logits, _ = _target_forward(target, step, cache, last_only=True)


@dataclass
class SpecResult:
    """Output and acceptance accounting of one speculative generation.

    A verify step is one target forward over [last committed token, drafts...]; the prefill's token
    is not counted in any step, so ``sum(committed_per_step) == len(tokens) - 1`` when tokens exist.
    """

    tokens: list[int]
    num_draft_steps: int
    finish_reason: str = "length"  # "stop" (eos emitted) or "length" (budget reached)
    drafted_per_step: list[int] = field(default_factory=list)  # drafts proposed
    accepted_per_step: list[int] = field(default_factory=list)  # drafts accepted and emitted
    committed_per_step: list[int] = field(default_factory=list)  # tokens emitted, incl. the bonus
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: steps whose i-th draft was accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [k]: steps that proposed an i-th draft

    def __post_init__(self) -> None:
        k = self.num_draft_steps
        self.accepted_per_position = self.accepted_per_position or [0] * k
        self.drafted_per_position = self.drafted_per_position or [0] * k

    @property
    def verify_steps(self) -> int:
        return len(self.committed_per_step)

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens committed per verify step, bonus included (None without a verify step)."""
        return sum(self.committed_per_step) / self.verify_steps if self.verify_steps else None


@torch.inference_mode()
def speculative_generate(
    target: nn.Module,
    proposer: Proposer,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_ids: Iterable[int] = (),
    num_draft_steps: int = 3,
) -> SpecResult:
    """Lossless greedy speculative decoding with any ``Proposer`` (a drafter kind's in-process drafting, prompt
    lookup ...)."""
    _check_input(input_ids)
    if num_draft_steps < 1:
        raise ValueError(f"num_draft_steps must be >= 1, got {num_draft_steps}")
    proposer.reset()
    eos = {int(t) for t in eos_token_ids}
    device = input_ids.device
    prompt = input_ids[0].tolist()
    result = SpecResult(tokens=[], num_draft_steps=num_draft_steps)
    if max_new_tokens <= 0:
        return result
    generated = result.tokens

    # Capture hooks only when the proposer reads target features (EAGLE); prompt lookup needs none.
    hooks = AuxHiddenCapture(target, proposer.aux_layer_ids) if proposer.aux_layer_ids is not None else nullcontext()
    cache = DynamicCache()
    with hooks as capture:
        logits, new_aux = _target_forward(target, input_ids, cache, last_only=True, capture=capture)
        generated.append(int(logits[0, -1].argmax()))

        while not _is_done(generated, eos, max_new_tokens):
            # Drafts past the budget could never be emitted: don't pay to verify them.
            max_drafts = min(num_draft_steps, max_new_tokens - len(generated) - 1)
            drafts = [int(t) for t in proposer.propose(prompt + generated, new_aux, max_drafts)][:max_drafts]

            # One target forward checks every draft: row i is the target's choice after draft i.
            ids = torch.tensor([[generated[-1], *drafts]], dtype=torch.long, device=device)
            logits, aux = _target_forward(target, ids, cache, last_only=False, capture=capture)
            choice = logits[0].argmax(dim=-1).tolist()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == choice[accepted]:
                accepted += 1
            committed = drafts[:accepted] + [choice[accepted]]  # accepted prefix + bonus token

            emitted = 0
            for tok in committed:  # never emit past eos or the budget
                generated.append(tok)
                emitted += 1
                if _is_done(generated, eos, max_new_tokens):
                    break

            n_acc = min(accepted, emitted)
            result.drafted_per_step.append(len(drafts))
            result.accepted_per_step.append(n_acc)
            result.committed_per_step.append(emitted)
            for i in range(len(drafts)):
                result.drafted_per_position[i] += 1
            for i in range(n_acc):
                result.accepted_per_position[i] += 1

            # The cache keeps every committed token except the newest (not yet run through the
            # target); rejected drafts' entries go. Their features go with them: only the first
            # `emitted` rows of this forward belong to committed positions.
            crop_cache(cache, len(prompt) + len(generated) - 1)
            new_aux = aux[:, :emitted] if aux is not None else None

    result.finish_reason = "stop" if generated and generated[-1] in eos else "length"
    return result


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
