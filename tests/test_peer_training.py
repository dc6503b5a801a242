"""bench/peer_training.py's data conversion: aerie hidden shards -> SpecForge's offline sample layout.

SpecForge itself is not installed in the test environment (it stays out of the default test path); what is
checked is the contract its ``OfflineEagle3Dataset.process_data`` reads: ``input_ids`` and ``loss_mask`` of
shape [T], the target's final hidden state ``hidden_state`` [1, T, H] and the concatenated aux layers
``aux_hidden_state`` [1, T, A*H], row for row the shard's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from conftest import REPO
from safetensors.torch import save_file

sys.path.insert(0, str(REPO / "bench"))

from peer_training import loss_over_supervised_rows, specforge_sample, write_specforge_samples  # noqa: E402

from aerie.formats.hidden import open_hidden_shards  # noqa: E402

H, A, V = 8, 3, 32  # hidden size, aux layers, vocab: the conversion does not depend on the sizes


def write_shard(path: Path, seqs: int, seq_len: int) -> Path:
    """A ``full``-layout hidden shard of random features (what the hidden rule writes, minus the target)."""
    torch.manual_seed(0)
    T = seqs * seq_len
    save_file(
        {
            "input_ids": torch.randint(0, V, (T,), dtype=torch.int32),
            "loss_mask": (torch.rand(T) > 0.4).to(torch.uint8),
            "seq_offsets": torch.arange(seqs + 1, dtype=torch.int64) * seq_len,
            "aux_hidden_states": torch.randn(T, A * H).to(torch.bfloat16),
            "final_hidden_states": torch.randn(T, H).to(torch.bfloat16),
        },
        str(path),
        metadata={
            "format": "aerie.hidden/1",
            "aux_layer_ids": json.dumps([1, 3, 4]),
            "hidden_size": str(H),
            "vocab_size": str(V),
            "num_hidden_layers": "8",
            "target": "t",
            "sample_ids": json.dumps([f"s/{i}" for i in range(seqs)]),
        },
    )
    return path


def test_each_sequence_becomes_one_specforge_sample(tmp_path: Path) -> None:
    (shard,) = open_hidden_shards([write_shard(tmp_path / "shard-00000.safetensors", seqs=3, seq_len=16)])
    sample = specforge_sample(shard, 1)
    assert sample["input_ids"].shape == (16,) and sample["loss_mask"].shape == (16,)
    assert sample["hidden_state"].shape == (1, 16, H) and sample["aux_hidden_state"].shape == (1, 16, A * H)
    assert torch.equal(sample["input_ids"], shard.input_ids[16:32])
    assert torch.equal(sample["loss_mask"].bool(), shard.loss_mask[16:32])
    assert torch.equal(sample["hidden_state"][0], shard.rows("final_hidden_states", 16, 32).to(torch.bfloat16))
    assert torch.equal(sample["aux_hidden_state"][0], shard.aux_rows(16, 32, torch.bfloat16))

    paths = write_specforge_samples([shard], [(0, 2), (0, 0)], tmp_path / "sf")
    assert [p.name for p in paths] == ["data_00000.ckpt", "data_00001.ckpt"]
    first = torch.load(paths[0], weights_only=False)
    assert torch.equal(first["input_ids"], shard.input_ids[32:48])


def test_mask_on_predicted_token_shifts_the_mask_by_two(tmp_path: Path) -> None:
    """SpecForge's row t learns token t+2: aerie's rule (supervised when the predicted token was generated) is
    the mask of token t+2 stored at t, with the last two rows (predicting past the sequence) never supervised."""
    (shard,) = open_hidden_shards([write_shard(tmp_path / "shard-00000.safetensors", seqs=2, seq_len=10)])
    plain = specforge_sample(shard, 1)
    shifted = specforge_sample(shard, 1, mask_on_predicted_token=True)
    mask = shard.loss_mask[10:20].long()
    assert torch.equal(plain["loss_mask"], mask)
    assert torch.equal(shifted["loss_mask"][:8], mask[2:])
    assert shifted["loss_mask"][8:].tolist() == [0, 0]
    for key in ("input_ids", "hidden_state", "aux_hidden_state"):  # only the mask moves
        assert torch.equal(shifted[key], plain[key])
    (path,) = write_specforge_samples([shard], [(0, 1)], tmp_path / "sf", mask_on_predicted_token=True)
    assert torch.equal(torch.load(path, weights_only=False)["loss_mask"], shifted["loss_mask"])


def test_loss_over_supervised_rows_divides_by_the_supervised_rows_only() -> None:
    """The ``+rows`` rung: the same masked soft cross-entropy as SpecForge's, summed over the supervised rows and
    divided by their number (aerie's normalisation), not by every row of the batch."""
    torch.manual_seed(0)
    B, T, Vd = 2, 5, 7
    logits, target_p = torch.randn(B, T, Vd), torch.softmax(torch.randn(B, T, Vd), -1)
    mask = torch.zeros(B, T, 1)
    mask[0, 1:4] = 1  # 3 supervised rows of 10
    ce = -(target_p * torch.log_softmax(logits, -1)).sum(-1)  # [B, T]
    expected = ce[0, 1:4].sum() / 3
    assert torch.allclose(loss_over_supervised_rows(logits, target_p, mask), expected)
    assert float(loss_over_supervised_rows(logits, target_p, torch.zeros(B, T, 1))) == 0.0  # none: no NaN
