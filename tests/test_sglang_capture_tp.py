"""The first GPU step on Kimi K2.5's own path, on CPU: the K2.5 wrapper, eight tensor-parallel ranks, the lm_head copy.

``aerie-sglang-capture make-tiny kimi`` writes a random target in Kimi K2.5's form (the wrapper, a DeepseekV3
``text_config``, weights under ``language_model.``, its modeling and tiktoken tokenizer code for
``trust_remote_code``). ``check --tp 8`` (the user's host) runs here against tests/sglang_standin.py's
``SGLangTP``: eight worker processes that load the wrapper as SGLang 0.5.23's ``models/kimi_k25.py`` does and run a
real tensor-parallel forward over gloo (row-parallel projections summed by all-reduce). Verified against that
stand-in only, not against SGLang on a GPU: see the stand-in's docstring for what it reproduces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aerie.hidden.sglang.batches import check_replicated, states_digest
from aerie.hidden.sglang.capture import SGLangCapture
from aerie.hidden.sglang.mapping import SGLangCaptureError, SGLangMappingError, target_dims
from aerie.hidden.sglang_check.check import make_tiny_target

REPO = Path(__file__).resolve().parents[1]
TINY_KIMI = dict(  # CPU-sized text model (make-tiny's defaults are sized for SGLang's GPU kernels)
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=8,  # split over 8 tensor-parallel ranks, as K2.5's 64 heads are on the 8-GPU host
    num_key_value_heads=8,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=6,
)


@pytest.fixture(scope="module")
def tiny_kimi(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return make_tiny_target("kimi", tmp_path_factory.mktemp("kimi") / "tiny-kimi", **TINY_KIMI)


def run_tool(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m aerie.hidden.sglang_check ARGS`` with tests/ importable (the stand-in backend lives there)."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "aerie.hidden.sglang_check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


def test_make_tiny_kimi_is_kimis_form(tiny_kimi) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aerie.target_model.heads import read_target_heads

    config = json.loads((tiny_kimi / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"] and config["model_type"] == "kimi_k25"
    assert config["text_config"]["architectures"] == ["DeepseekV3ForCausalLM"]
    assert target_dims(config) == {
        "num_hidden_layers": 6,
        "hidden_size": 64,
        "vocab_size": 163840,
        "architectures": ["KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM"],
    }
    with safe_open(str(tiny_kimi / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert names and all(n.startswith("language_model.") for n in names)  # no vision weights: text never runs them
    assert read_target_heads(tiny_kimi, roles=["lm_head"]).names == {"lm_head": "language_model.lm_head.weight"}
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(str(tiny_kimi))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_kimi), trust_remote_code=True)
    assert type(model).__name__ == "KimiK25ForConditionalGeneration"
    tok = AutoTokenizer.from_pretrained(str(tiny_kimi), trust_remote_code=True)
    assert type(tok).__name__ == "TikTokenTokenizer" and tok.convert_tokens_to_ids("<|im_end|>") == 163586


def test_check_on_the_kimi_wrapper_with_eight_tensor_parallel_ranks(tiny_kimi, tmp_path) -> None:
    """README's first GPU step, Kimi run, at the user's TP 8: PASS, with the layer mapping, every rank agreeing
    and the lm_head copy reported (each rank holds one of the 8 heads; ~1 CPU minute for 8 gloo processes)."""
    out = tmp_path / "report.json"
    args = ["check", "--target", str(tiny_kimi), "--layers", "1", "3", "4", "--tp", "8", "--trust-remote-code"]
    r = run_tool(
        [*args, "--seqs", "2", "--len", "12", "--backend", "sglang_standin:SGLangTP", "--out", str(out)], tmp_path
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert r.stdout.rstrip().endswith("PASS")
    report = json.loads(out.read_text())
    info = report["runner_info"]
    assert info["model_class"] == "KimiK25ForConditionalGeneration" and info["layers_to_capture"] == [2, 4, 5]
    assert info["row_parallel_layers"] == 2 * 6  # o_proj + one down_proj a layer (dense first, shared experts)
    assert [row["closest_hidden_states_index"] for row in report["aux"].values()] == [2, 4, 5]
    assert report["tp"] == 8 and report["tp_rank_agreement"] < 1e-4
    copy = report["lm_head_copy"]  # on a GPU host: cuda:0 (SGLang's rank-0 GPU), with reserved_bytes measured
    assert copy["device"] == "cpu" and copy["shape"] == [163840, 64] and copy["dtype"] == "bfloat16"
    assert copy["weight_bytes"] == 163840 * 64 * 2
    assert report["lm_head_copy_argmax_agreement"] == 1.0 and report["argmax_agreement"] == 1.0
    assert "lm_head copy for the top-k targets: [163840, 64] bfloat16" in r.stdout  # logged before SGLang starts


def test_states_not_replicated_across_ranks_fail_the_batch(tiny_kimi) -> None:
    """A rank that keeps its partial sums (no all-reduce): rank 0 alone would hold half the target's states."""
    from sglang_standin import SGLangTP

    cap = SGLangCapture(str(tiny_kimi), [1, 3, 4], backend=SGLangTP, tp_size=2, fake_skip_all_reduce=True)
    try:
        with pytest.raises(SGLangCaptureError, match="rank 1 holds other hidden states than rank 0"):
            cap.capture([torch.tensor([5, 6, 7, 8, 9])])
    finally:
        cap.close()


def test_kimi_ids_from_zero_are_refused_by_the_loaded_wrapper(tiny_kimi) -> None:
    """The check on the loaded model, reached through the wrapper's own loading (early prediction off)."""
    from sglang_standin import SGLangTP

    with pytest.raises(SGLangMappingError, match=r"outputs \[-1, 1, 3\], not \[0, 2, 4\]"):
        SGLangCapture(str(tiny_kimi), [0, 2, 4], backend=SGLangTP, early_mapping_check=False).close()


def test_rank_digests_tell_replicated_states_from_others() -> None:
    gen = torch.Generator().manual_seed(0)
    aux, final = torch.randn(7, 3 * 16, generator=gen), torch.randn(7, 16, generator=gen)
    d0 = states_digest(aux, final)
    assert d0.shape == (7, 8)
    rounding = states_digest(aux * (1 + 1e-6), final)
    assert check_replicated({0: d0, 1: d0.clone(), 2: rounding}, batch=1) < 1e-4
    half = states_digest(aux / 2, final / 2)  # one of two partial sums
    with pytest.raises(SGLangCaptureError, match="batch 3: tensor-parallel rank 1 holds other hidden states"):
        check_replicated({0: d0, 1: half}, batch=3)
    rows = states_digest(aux[:4], final[:4])  # the rows split across ranks
    with pytest.raises(SGLangCaptureError, match="rank 2 returned a state digest of shape \\(4, 8\\)"):
        check_replicated({0: d0, 1: d0, 2: rows}, batch=1)
    with pytest.raises(SGLangCaptureError, match="do not hold the same token rows"):
        check_replicated({0: d0, 1: None}, batch=1)
    assert states_digest(None, final) is None and states_digest(aux, final[:3]) is None
    # Rows beyond one conversion chunk are digested like the others.
    big_aux, big_final = aux.repeat(700, 1), final.repeat(700, 1)
    torch.testing.assert_close(states_digest(big_aux, big_final), d0.repeat(700, 1))


def test_the_first_gpu_step_runs_kimis_path_with_valid_commands() -> None:
    """The first GPU step (docs/sglang-capture-check.md) lists the Kimi wrapper runs (one GPU, eight-way TP as the
    user's host runs K2.5, the refusal), and every `aerie-sglang-capture` line in it parses with the tool's own
    argument parser."""
    import re
    import shlex

    from aerie.hidden.sglang_check.cli import build_parser

    page = (REPO / "docs" / "sglang-capture-check.md").read_text()
    section = page.split("# The first GPU step", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```bash\n(.*?)^```", section, flags=re.M | re.S).group(1).replace("\\\n", " ")
    runs = [
        shlex.split(line.split("aerie-sglang-capture", 1)[1])
        for line in block.splitlines()
        if "aerie-sglang-capture" in line
    ]
    parsed = [build_parser().parse_args(args) for args in runs]
    kimi = [a for a in parsed if a.cmd == "check" and "kimi" in str(a.target)]
    assert any(a.cmd == "make-tiny" and a.kind == "kimi" for a in parsed)
    assert {(a.tp, a.expect_refusal) for a in kimi} == {(1, False), (8, False), (1, True)}
    assert all(a.trust_remote_code for a in kimi)
    assert [a.layers[0] for a in kimi if a.expect_refusal] == [0]
