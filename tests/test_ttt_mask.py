"""Which rows the TTT loss supervises at each draft step (aerie.drafter_kinds.eagle3.ttt.step_weights), on a hand-built
batch.

Convention (aerie/drafter/data.py): row t carries the target's features at position t; draft step k at row t reads
token t+1+k and predicts token t+2+k against the target distribution ``q[t+1+k]``. A row is supervised at step k
when it is a real row, token t+2+k was generated (loss mask), and - when given - ``target_ok[t+1+k]``. The
expected rows below are written out by hand from that rule, so a mask shifted by one row in either direction fails.
The loss here is the plain composition (tests/ttt_reference.py); tests/test_ttt_kernel.py holds the trainer's
chunked loss equal to it.
"""

from __future__ import annotations

import pytest
import torch
from ttt_reference import naive_loss as ttt_loss

from aerie.drafter_kinds.batch import Batch
from aerie.drafter_kinds.eagle3.ttt import step_weights

STEPS = 3
T = 7  # rows of the window
W = T + STEPS + 2  # tokens the window reads (data.load_batch)


def hand_built_batch() -> Batch:
    """Sequence 0: 7 real rows; tokens 0-4 are the prompt, 5-8 the generated answer, 9-11 the next prompt.
    Sequence 1: 4 real rows (3 rows of padding); tokens 2-5 generated - padding rows must never be supervised,
    even where the loss mask of the tokens they would predict is set."""
    gen = torch.zeros(2, W, dtype=torch.bool)
    gen[0, 5:9] = True
    gen[1, 2:10] = True  # generated tokens beyond the real rows' reach, to catch a mask that ignores padding
    row_valid = torch.zeros(2, T, dtype=torch.bool)
    row_valid[0, :7] = True
    row_valid[1, :4] = True
    ids = torch.arange(2 * W).view(2, W)
    return Batch(
        aux=torch.zeros(2, T, 4),
        position_ids=torch.arange(T).expand(2, T),
        row_valid=row_valid,
        ids=ids,
        have=torch.ones(2, W, dtype=torch.bool),
        gen=gen,
        final=None,
        rows=11,
    )


def supervised(batch: Batch, k: int, target_ok: torch.Tensor | None = None) -> list[list[int]]:
    w = step_weights(batch, k, target_ok)
    assert w.dtype == torch.float32 and w.shape == (2, T)
    assert set(w.unique().tolist()) <= {0.0, 1.0}
    return [torch.nonzero(row).flatten().tolist() for row in w]


# (step, rows of sequence 0, rows of sequence 1), from "token t+2+k generated and t a real row"
EXPECTED = [
    (0, [3, 4, 5, 6], [0, 1, 2, 3]),  # tokens 5..8 are predicted by rows 3..6; sequence 1: tokens 2..5 by rows 0..3
    (1, [2, 3, 4, 5], [0, 1, 2, 3]),  # token t+3: rows 2..5 (token 9 is not generated, so row 6 is not)
    (2, [1, 2, 3, 4], [0, 1, 2, 3]),  # token t+4
]


@pytest.mark.parametrize(("k", "rows0", "rows1"), EXPECTED)
def test_each_step_supervises_the_rows_that_predict_generated_tokens(k: int, rows0: list[int], rows1: list[int]):
    assert supervised(hand_built_batch(), k) == [rows0, rows1]


def test_an_unusable_target_unsupervises_exactly_the_row_that_reads_it() -> None:
    """target_ok[p] says whether q[p] (the distribution predicting token p+1) may carry loss."""
    batch = hand_built_batch()
    ok = torch.ones(2, W, dtype=torch.bool)
    ok[0, 6] = False  # q[6] predicts token 7: row 5 at step 0, row 4 at step 1, row 3 at step 2
    assert supervised(batch, 0, ok)[0] == [3, 4, 6]
    assert supervised(batch, 1, ok)[0] == [2, 3, 5]
    assert supervised(batch, 2, ok)[0] == [1, 2, 4]
    assert supervised(batch, 0, ok)[1] == [0, 1, 2, 3]  # the other sequence is untouched


def test_loss_counts_only_supervised_rows() -> None:
    """ttt_loss normalises by the supervised rows and ignores every other row's logits."""
    torch.manual_seed(0)
    batch = hand_built_batch()
    vd = 5
    q = torch.softmax(torch.randn(2, W, vd), -1)
    logits = [torch.randn(2, T, vd) for _ in range(STEPS)]
    loss, stats = ttt_loss(logits, q, batch, None, decay=0.8)
    for k, (_, w_sum, _) in enumerate(stats):
        assert w_sum.item() == len(EXPECTED[k][1]) + len(EXPECTED[k][2])
    # Garbage in an unsupervised row (sequence 0, row 0 at step 0; padding row 5 of sequence 1) changes nothing.
    changed = [t.clone() for t in logits]
    changed[0][0, 0] = 1e3
    changed[0][1, 5] = -1e3
    assert torch.equal(ttt_loss(changed, q, batch, None, decay=0.8)[0], loss)
    # The same change in a supervised row does.
    changed[0][0, 3] = 1e3
    assert not torch.equal(ttt_loss(changed, q, batch, None, decay=0.8)[0], loss)
    # Each row's target is q[t+1+k]: at step 1, row 2 predicts token 5 from q[4]. Here q[p] peaks at p % vd, so
    # q[3], q[4] and q[5] have different argmaxes.
    q = torch.softmax(10.0 * torch.nn.functional.one_hot(torch.arange(W) % vd, vd).float(), -1).expand(2, W, vd)
    wrong = [torch.full((2, T, vd), -5.0) for _ in range(STEPS)]
    for t in wrong:
        t[..., 0] = 5.0  # argmax 0 everywhere; only q[0], q[5], q[10] peak at 0
    right = [t.clone() for t in wrong]
    right[1][0, 2] = 0.0
    right[1][0, 2, 4] = 5.0  # (step 1, row 2) now predicts q[4]'s argmax
    correct_before = [s[2].item() for s in ttt_loss(wrong, q, batch, None, decay=0.8)[1]]
    correct_after = [s[2].item() for s in ttt_loss(right, q, batch, None, decay=0.8)[1]]
    assert correct_after[1] == correct_before[1] + 1
    assert correct_after[0] == correct_before[0] and correct_after[2] == correct_before[2]
