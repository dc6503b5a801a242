"""The checks a captured shard must pass, on its full-precision states, before anything is compressed.

Per aux layer: finite values, neither all zero, nor constant over tokens, nor identical to another aux layer
(what a capture that is silently off, or keeps returning one buffer, looks like); per shard: ``lm_head`` of
the final states reproducing the recorded next tokens (``hidden.min_next_token_*``). A failure raises
:class:`HiddenStateError` naming the shard and what is wrong, instead of training a zero-acceptance drafter.
"""

from __future__ import annotations

import torch


class HiddenStateError(ValueError):
    """A captured shard is unusable for training (the message says why)."""


class CaptureChecks:
    """The shard checks, fed batch by batch so the full-precision states never have to be held together."""

    def __init__(self, layer_ids: list[int], hidden_size: int, where: str):
        self.layer_ids, self.hidden, self.where = layer_ids, hidden_size, where
        A = len(layer_ids)
        self.absmax = torch.zeros(A)
        self.first: torch.Tensor | None = None  # [A, H] the shard's first row of each layer
        self.varies = torch.zeros(A, dtype=torch.bool)  # some row differs from the first one
        self.identical = torch.ones(A, A, dtype=torch.bool)  # layers j, k equal on every row so far
        self.rows = 0

    def update(self, aux: torch.Tensor, final: torch.Tensor) -> None:
        layers = aux.reshape(aux.shape[0], len(self.layer_ids), self.hidden)  # [n, A, H]
        # NaN/inf first, per aux layer and with the first bad position: a NaN would otherwise pass the checks
        # below (every comparison with NaN is false) and poison training, or the fp8 scales of the compact layout.
        bad = ~torch.isfinite(layers).all(-1)  # [n, A]
        if bad.any():
            row, j = (int(x) for x in bad.nonzero()[0])
            raise HiddenStateError(
                f"{self.where}: aux_hidden_states of aux layer {self.layer_ids[j]} contain NaN or "
                f"inf ({int(bad[:, j].sum())} of {len(layers)} positions of this batch, the "
                f"first at position {row} of the batch)"
            )
        if not torch.isfinite(final).all():
            row = int((~torch.isfinite(final).all(-1)).nonzero()[0, 0])
            raise HiddenStateError(
                f"{self.where}: final_hidden_states contain NaN or inf (first at position {row} of the batch)"
            )
        if not len(layers):
            return
        if self.first is None:
            self.first = layers[0].clone()
        self.absmax = torch.maximum(self.absmax, layers.abs().amax(dim=(0, 2)).float().cpu())
        self.varies |= (layers != self.first).any(-1).any(0).cpu()
        for j in range(len(self.layer_ids)):
            for k in range(j):
                if self.identical[j, k]:
                    self.identical[j, k] = torch.equal(layers[:, j], layers[:, k])
        self.rows += len(layers)

    def finish(self) -> None:
        for j, lid in enumerate(self.layer_ids):
            # Written so that NaN fails too (were the finiteness check above ever bypassed): "not > 0", not "== 0".
            if not bool(self.absmax[j] > 0):
                raise HiddenStateError(f"{self.where}: aux layer {lid} is all zeros (capture silently off?)")
            if self.rows > 1 and not self.varies[j]:
                raise HiddenStateError(f"{self.where}: aux layer {lid} is constant over tokens (capture silently off?)")
            for k in range(j):
                if self.identical[j, k]:
                    raise HiddenStateError(f"{self.where}: aux layers {self.layer_ids[k]} and {lid} are identical")


def check_captured(aux: torch.Tensor, final: torch.Tensor, layer_ids: list[int], where: str) -> None:
    """Refuse states that betray capture problems instead of training a zero-acceptance drafter."""
    checks = CaptureChecks(layer_ids, final.shape[-1], where)
    checks.update(aux, final)
    checks.finish()


def check_agreement(
    where: str, agreement: float, topk_rate: float, k: int, min_agreement: float, min_in_topk: float
) -> None:
    """Refuse a shard whose final states do not predict its recorded tokens (hidden.min_next_token_*)."""
    if agreement < min_agreement:
        raise HiddenStateError(
            f"{where}: lm_head(final hidden) reproduces only {agreement:.2%} of recorded next tokens "
            f"(< hidden.min_next_token_agreement {min_agreement:.2%}): states and tokens do not belong "
            f"together (tokens shifted, another target or template, or capture broken)"
        )
    if topk_rate < min_in_topk:
        raise HiddenStateError(
            f"{where}: only {topk_rate:.2%} of recorded next tokens are among lm_head(final hidden)'s top {k} "
            f"(< hidden.min_next_token_in_topk {min_in_topk:.2%}): states and tokens do not belong "
            f"together (tokens shifted, another target or template, or capture broken)"
        )
