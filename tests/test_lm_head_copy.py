"""The SGLang capture's copy of the target's lm_head: where it lives, how much it holds, when it is placed.

SGLang keeps its (vocab-parallel) lm_head to itself, so for the compact layout's top-k targets the capture reads
``lm_head.weight`` from the target's safetensors onto SGLang's rank-0 GPU (``aerie.hidden.sglang.lm_head_copy``,
torch-free, what the fit plan counts), with its top-k workspace, before SGLang's workers start and size their
memory pools. No GPU here: the placement runs on the CPU; on a GPU host ``aerie-sglang-capture check`` reports the
bytes the allocator reserved.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tiny_world import save_random_llama

from aerie.hidden.backends import open_sglang_capture
from aerie.hidden.head import lm_head_topk, place_lm_head
from aerie.hidden.sglang.mapping import TOPK_CHUNK_ELEMENTS, SGLangMappingError, lm_head_copy

REPO = Path(__file__).resolve().parents[1]


def test_where_the_copy_lives_and_what_it_holds() -> None:
    kimi = lm_head_copy(163840, 7168, {"tp_size": 8, "mem_fraction_static": 0.85})
    assert (kimi.gpu, kimi.device) == (0, "cuda:0")  # SGLang's rank 0
    assert kimi.weight_bytes == 163840 * 7168 * 2 == 2_348_810_240
    assert kimi.workspace_bytes == 4 * TOPK_CHUNK_ELEMENTS * 4 and kimi.bytes == kimi.weight_bytes + (1 << 30)
    assert kimi.describe() == (
        "lm_head copy for the top-k targets: [163840, 7168] x 2 bytes = 2.35 GB + 1.07 GB top-k workspace on GPU 0"
    )
    assert lm_head_copy(163840, 7168, {"tp_size": 4, "base_gpu_id": 4}).gpu == 4  # follows SGLang's ranks
    assert lm_head_copy(163840, 7168, {"tp_size": 8}, device="cuda").gpu == 0
    assert lm_head_copy(163840, 7168, {"tp_size": 8}, device="cuda:7").gpu == 7  # target.device names one
    assert lm_head_copy(163840, 7168, None, device="cpu").device == "cpu"
    assert lm_head_copy(100, 8, dtype_bytes=4).weight_bytes == 3200
    with pytest.raises(ValueError, match="target.device: 'tpu'"):
        lm_head_copy(100, 8, device="tpu")


def test_the_plan_is_torch_free() -> None:
    import subprocess

    code = (
        "import sys; from aerie.hidden.sglang.mapping import lm_head_copy\n"
        "from aerie.target_model.config import weight_dtype_bytes\n"
        "c = lm_head_copy(163840, 7168, {'tp_size': 8}, 'auto', weight_dtype_bytes({'torch_dtype': 'bfloat16'}))\n"
        "print(c.bytes, 'torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(2_348_810_240 + (1 << 30)), "False"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_topk_in_blocks_equals_the_whole_logits(dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    head = (torch.randn(300, 16, generator=gen) * 0.5).to(dtype)
    final = torch.randn(37, 16, generator=gen)
    logits = final @ head.float().T
    want = logits.topk(5, -1)
    for max_elements in (1 << 20, 1000, 301):  # one block; several row blocks and vocab chunks; one row a block
        ids, lp = lm_head_topk(final, head, 5, max_elements=max_elements)
        assert torch.equal(ids, want.indices)
        torch.testing.assert_close(lp, want.values - logits.logsumexp(-1, keepdim=True), rtol=1e-5, atol=1e-5)


def test_place_reads_the_head_as_stored(tmp_path) -> None:
    target = save_random_llama(tmp_path / "t")
    config = json.loads((target / "config.json").read_text())
    copy = lm_head_copy(config["vocab_size"], config["hidden_size"], device="cpu", dtype_bytes=4)
    lines: list[str] = []
    head, facts = place_lm_head(target, copy, lines.append)
    from transformers import AutoModelForCausalLM

    assert torch.equal(head, AutoModelForCausalLM.from_pretrained(target).lm_head.weight.detach())
    assert facts["device"] == "cpu" and facts["shape"] == [200, 64] and facts["weight_bytes"] == 200 * 64 * 4
    assert facts["plan"] == copy.describe() and "reserved_bytes" not in facts  # measured on a GPU only
    assert lines == [
        "lm_head copy for the top-k targets: [200, 64] float32 = 0.00 GB on cpu (placed before SGLang sizes its "
        "memory pools)"
    ]
    with pytest.raises(ValueError, match=r"lm_head is \[200, 64\], its config.json says \[201, 64\]"):
        place_lm_head(target, lm_head_copy(201, 64, device="cpu"), lines.append)


def test_the_copy_is_placed_after_the_checks_and_before_sglang_starts(tmp_path) -> None:
    """The workers of the stand-in refuse to load unless the copy is already placed (the parent's log line is
    their signal); ids SGLang would map differently are refused before anything is read."""
    target = save_random_llama(tmp_path / "t")
    marker = tmp_path / "placed.txt"

    def log(line: str) -> None:
        marker.write_text(line)

    options = {"backend": "sglang_standin:WaitsForTheCopy", "fake_marker": str(marker)}
    cap, head, facts = open_sglang_capture(str(target), [1, 3, 4], device="cpu", options=options, log=log)
    try:
        assert cap.info["layers_to_capture"] == [2, 4, 5] and head.shape == (200, 64) and facts["device"] == "cpu"
    finally:
        cap.close()

    marker.unlink()
    (tmp_path / "ds").mkdir()
    config = json.loads((target / "config.json").read_text())
    (tmp_path / "ds" / "config.json").write_text(json.dumps({**config, "architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(SGLangMappingError, match="add 1 only when the first id is 1"):
        open_sglang_capture(str(tmp_path / "ds"), [2, 3, 4], device="cpu", options=options, log=log)
    assert not marker.exists()
