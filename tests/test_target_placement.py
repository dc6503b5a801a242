"""Where the in-process benchmark puts the target (aerie.target_model.placement): one GPU when it fits, balanced over
the job's GPUs with device_map/max_memory when it does not, refused (naming bench.backend: sglang) when the GPUs
together cannot hold it; the CPU as before. No GPU here: the CUDA branch is checked through what it asks
transformers for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_world import save_random_llama

from aerie.target_model import model as target_model
from aerie.target_model.placement import GPU_WEIGHT_FRACTION, plan_placement, weight_bytes

GIB = 2**30
H200 = 141 * GIB


def test_placement_rule() -> None:
    assert plan_placement(10 * GIB, []).kind == "cpu"
    assert plan_placement(10 * GIB, [H200] * 8).kind == "one_gpu"  # fits the first GPU: no cross-GPU hops
    assert plan_placement(100 * GIB, [H200]).kind == "one_gpu"
    # A 70B bf16 target (~140 GB) on 2 H200s: balanced over both, 85% of each for weights.
    spread = plan_placement(140 * GIB, [H200, H200])
    assert spread.kind == "spread" and spread.max_memory == {0: int(H200 * GPU_WEIGHT_FRACTION)} | {
        1: int(H200 * GPU_WEIGHT_FRACTION)
    }
    assert "spread over 2 GPUs" in spread.describe()
    # Kimi K2.5 (~554 GB int4 as stored, ~2 TB in bf16) on 8 H200s: ~958 GiB for weights.
    assert plan_placement(554 * 10**9, [H200] * 8).kind == "spread"
    with pytest.raises(ValueError, match=r"do not fit the job's 8 GPU\(s\).*set bench.backend: sglang"):
        plan_placement(2 * 10**12, [H200] * 8)
    with pytest.raises(ValueError, match=r"bench.backend: sglang"):
        plan_placement(130 * GIB, [H200])  # one GPU, above its 85%


def test_weight_bytes_scale_to_the_loading_dtype(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {"a": torch.zeros(1000, dtype=torch.bfloat16), "b": torch.zeros(24, dtype=torch.bfloat16)},
        tmp_path / "x.safetensors",
    )
    stored = (1000 + 24) * 2  # the tensors' bytes (the header is not weights)
    assert weight_bytes(tmp_path) == stored == weight_bytes(tmp_path, "bfloat16")
    assert weight_bytes(tmp_path, "float32") == 2 * stored


def test_cpu_load_is_unchanged_by_spread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = save_random_llama(tmp_path / "llama")  # weights only: the tokenizer is not what this checks
    monkeypatch.setattr(target_model, "load_tokenizer", lambda path, trust=False: "tok")
    ids = torch.tensor([[1, 2, 3, 4]])
    outs = []
    for spread in (False, True):
        model, _tok, dev = target_model.load_target(folder, device="cpu", dtype="float32", spread=spread)
        assert dev == torch.device("cpu") and not hasattr(model, "hf_device_map")
        outs.append(model(input_ids=ids).logits)
    assert torch.equal(outs[0], outs[1])


class _Loaded(torch.nn.Module):
    def __init__(self, device_map: dict[str, str]):
        super().__init__()
        self.embed = torch.nn.Embedding(4, 2)
        self.hf_device_map = device_map

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed


def test_cuda_spread_asks_for_device_map_and_max_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two visible 1 GiB GPUs and a folder of 1.5 GiB (in the loading dtype): balanced over both, 85% each; a map
    that still leaves layers on the CPU is refused."""
    import transformers

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    monkeypatch.setattr(target_model, "visible_gpu_memory", lambda: [GIB, GIB])
    monkeypatch.setattr(target_model, "load_tokenizer", lambda path, trust=False: "tok")
    monkeypatch.setattr("aerie.target_model.model.weight_bytes", lambda path, dtype=None: 3 * GIB // 2)
    calls = []

    def from_pretrained(path, **kwargs):
        calls.append(kwargs)
        return _Loaded(calls_map)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(from_pretrained))
    calls_map = {"model.layers.0": 0, "model.layers.1": 1}
    _model, tok, dev = target_model.load_target(tmp_path, device="cuda", dtype="bfloat16", spread=True)
    (kw,) = calls
    budget = int(GIB * GPU_WEIGHT_FRACTION)
    assert kw["device_map"] == "auto" and kw["max_memory"] == {0: budget, 1: budget}
    assert kw["dtype"] == torch.bfloat16 and dev == torch.device("cpu")  # the stand-in's embeddings
    calls_map = {"model.layers.0": 0, "model.layers.1": "cpu"}
    with pytest.raises(ValueError, match=r"left layers on \['cpu'\]; set bench.backend: sglang"):
        target_model.load_target(tmp_path, device="cuda", dtype="bfloat16", spread=True)
