"""SGLang capture backend without SGLang: the layer-id convention (against a real transformers forward), the
arguments it hands SGLang, batching, splitting SGLang's flat outputs in recorded shapes, the worker processes
(spawned for real, tensor-parallel ranks included) with a CPU stand-in for the SGLang-specific part, and the
GPU-host check tool started as `python -m aerie.hidden.sglang_check` (the module form of the README's
`aerie-sglang-capture`; tests/test_entry_points.py starts the console script)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from aerie.hidden.sglang.batches import check_sequences, split_capture
from aerie.hidden.sglang.capture import SGLangCapture
from aerie.hidden.sglang.mapping import (
    ANY_VERSION_ENV,
    TESTED_SGLANG_VERSION,
    SGLangCaptureError,
    SGLangUnavailableError,
    capture_layers_of,
    check_capture_mapping,
    gpu_ids,
    plan_forwards,
    sglang_server_kwargs,
    target_dims,
)
from aerie.hidden.sglang.sglang_0523 import SGLang0523, request_capacity
from aerie.hidden.sglang.worker import backend_reference, resolve_backend
from aerie.hidden.sglang_check.check import compare_with_transformers
from aerie.target_model.capture import AuxHiddenCapture
from aerie.target_model.config import (
    captured_output_ids,
    check_servable_aux_layer_ids,
    predicted_capture_inputs,
    sglang_capture_inputs,
)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "sglang_capture"
TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
FAIL_ID, DIE_ID = 62, 63  # a sequence starting with two of these makes the stand-in's rank 1 raise / exit


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False)).eval()


def write_target(path: Path, architectures: list[str], **dims) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": architectures, **{**TINY, **dims}}))
    return path


# ---- stand-ins for SGLang's model classes (their set_eagle3_layers_to_capture as in sglang 0.5.23) ----------


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers_to_capture: list[int] = []


class LlamaLike(nn.Module):
    """models/llama.py LlamaForCausalLM.set_eagle3_layers_to_capture: inputs of id + 1."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Stack()

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.model.layers_to_capture = [v + 1 for v in layer_ids]


class DeepseekLike(LlamaLike):
    """models/deepseek_v2.py DeepseekV2ForCausalLM.set_eagle3_layers_to_capture: + 1 only if ids[0] == 1."""

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.model.layers_to_capture = [v + 1 for v in layer_ids] if layer_ids[0] == 1 else list(layer_ids)


class KimiLike(nn.Module):
    """models/kimi_k25.py: forwards to its DeepseekV3 language model."""

    def __init__(self) -> None:
        super().__init__()
        self.language_model = DeepseekLike()

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.language_model.set_eagle3_layers_to_capture(layer_ids)


class NoEagle3(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Stack()


class FakeBackend:
    """Stands in for SGLang0523 in the worker processes, on CPU: the same protocol, and SGLang's capture
    emulated on a transformers Llama (the residual stream at the input of each layer in layers_to_capture,
    the post-norm final state, all tokens of the batch end to end)."""

    @staticmethod
    def installed_version() -> str:
        return TESTED_SGLANG_VERSION

    @staticmethod
    def prepare(server_kwargs: dict) -> dict:
        return dict(server_kwargs)

    @staticmethod
    def load(payload: dict, rank: int, gpu_id: int):
        torch.set_num_threads(1)
        if payload.get("fake_crash") == "segv" and rank == 1:  # a kernel crash: no Python error reaches the queue
            os.kill(os.getpid(), signal.SIGSEGV)
        kind = payload.get("fake_model", "llama")
        # "light": SGLang's llama mapping without a forward (tests that never capture need no transformers model)
        model = {
            "llama": LlamaLike,
            "light": LlamaLike,
            "deepseek": DeepseekLike,
            "kimi": KimiLike,
            "no-eagle3": NoEagle3,
        }[kind]()
        if hasattr(model, "set_eagle3_layers_to_capture"):  # what SGLang's ModelRunner does at load
            model.set_eagle3_layers_to_capture(payload["return_aux_hidden_state_layer_ids"])
        hf = tiny_llama() if kind == "llama" else None
        return SimpleNamespace(model=model, hf=hf, payload=payload, rank=rank)

    @staticmethod
    def runner_info(runner) -> dict:
        return {
            "layers_to_capture": capture_layers_of(runner.model),
            "model_class": type(runner.model).__name__,
            "max_tokens": runner.payload.get("fake_max_tokens", 4096),
            "max_requests": 8,
            "context_len": 256,
            "chunk_tokens": None,
            "hidden_size": TINY["hidden_size"],
            "num_hidden_layers": TINY["num_hidden_layers"],
        }

    @staticmethod
    @torch.no_grad()
    def extend(runner, seqs):
        if runner.payload.get("fake_log"):
            with open(runner.payload["fake_log"], "a") as f:
                f.write(json.dumps([runner.rank, [len(s) for s in seqs]]) + "\n")
        if any(s[:2] in ([FAIL_ID] * 2, [DIE_ID] * 2) for s in seqs):
            if runner.rank == 0:
                time.sleep(60)  # as in a real forward, rank 0 waits in a collective for its failed peer
            if any(s[:2] == [FAIL_ID] * 2 for s in seqs):
                raise ValueError("boom on rank 1")
            os._exit(7)
        hf, capture = runner.hf, runner.model.model.layers_to_capture
        aux, final = [], []
        for ids in seqs:
            seen: dict[int, torch.Tensor] = {}
            hooks = [
                hf.model.layers[j].register_forward_pre_hook(
                    lambda _m, args, kwargs, j=j, seen=seen: seen.__setitem__(
                        j, kwargs.get("hidden_states", args[0] if args else None)
                    ),
                    with_kwargs=True,
                )
                for j in capture
            ]
            try:
                final.append(hf.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state[0])
            finally:
                for h in hooks:
                    h.remove()
            aux.append(torch.cat([seen[j][0] for j in capture], -1))
        return torch.cat(aux), torch.cat(final)

    @staticmethod
    def release(runner) -> None:
        pass


class FakeDeepseekBackend(FakeBackend):
    """The stand-in with SGLang's DeepseekV2 id mapping and no forward (for --expect-refusal runs of the tool)."""

    @staticmethod
    def load(payload: dict, rank: int, gpu_id: int):
        return FakeBackend.load({**payload, "fake_model": "deepseek"}, rank, gpu_id)


class FakeCapture(SGLangCapture):
    backend = FakeBackend
    startup_timeout_s = 120.0
    batch_timeout_s = 120.0
    stop_grace_s = 3.0


# ---- SGLang missing, or another version ---------------------------------------------------------------


def test_module_imports_without_sglang() -> None:
    code = (
        "import sys; sys.modules['sglang'] = None\n"
        "from aerie.hidden.sglang.capture import SGLangCapture as C; print(C.__name__)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "SGLangCapture"


def test_construction_without_sglang_says_to_use_its_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang` raises ImportError, installed or not
    target = write_target(tmp_path / "t", ["LlamaForCausalLM"])
    with pytest.raises(SGLangUnavailableError, match=r"envs/sglang\.yaml"):
        SGLangCapture(str(target), [1, 3, 4])


def test_another_sglang_version_is_refused_unless_allowed(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "sglang", SimpleNamespace(__version__="0.5.9"))
    monkeypatch.delenv(ANY_VERSION_ENV, raising=False)
    with pytest.raises(SGLangUnavailableError, match=r"SGLang 0\.5\.9 is installed.*0\.5\.23"):
        SGLangCapture(str(tmp_path / "missing"), [1])
    monkeypatch.setenv(ANY_VERSION_ENV, "1")  # allowed: construction goes on, to the target's config
    with pytest.raises(FileNotFoundError, match="config.json"):
        SGLangCapture(str(tmp_path / "missing"), [1])


# ---- the layer-id convention --------------------------------------------------------------------------


def test_sglang_capture_points_are_transformers_hidden_states_id_plus_one() -> None:
    """SGLang captures the residual stream entering each layer in layers_to_capture; for aerie id i that
    must be layer i + 1's input = output_hidden_states[i + 1] = what aerie's hf backend hooks."""
    model = tiny_llama()
    layers = model.model.layers
    ids = torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(3))
    layer_ids = [0, 2, 4]
    inputs = sglang_capture_inputs(layer_ids)
    assert inputs == [1, 3, 5] and captured_output_ids(inputs) == layer_ids
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        layers[j].register_forward_pre_hook(
            lambda _m, args, kwargs, j=j: seen.__setitem__(j, kwargs.get("hidden_states", args[0] if args else None)),
            with_kwargs=True,
        )
        for j in range(len(layers))
    ]
    with torch.no_grad(), AuxHiddenCapture(model, layer_ids) as cap:
        hs = model(ids, output_hidden_states=True).hidden_states  # [0] embeddings, [k] = output of layer k - 1
        ours = cap.aux_hidden_states()
    for h in hooks:
        h.remove()
    sglang_like = torch.cat([seen[j] for j in inputs], -1)
    torch.testing.assert_close(sglang_like, torch.cat([hs[i + 1] for i in layer_ids], -1), atol=0, rtol=0)
    torch.testing.assert_close(sglang_like, ours, atol=0, rtol=0)
    # Without the + 1 (SGLang's DeepseekV2 when ids[0] != 1) the tensors are one layer early: clearly different.
    unshifted = torch.cat([seen[j] for j in layer_ids], -1)
    assert (unshifted - sglang_like).abs().max() > 1e-3


def test_last_layer_output_cannot_be_captured_and_aerie_id_checks_apply() -> None:
    # The SGLang capture checks its ids with check_servable_aux_layer_ids (shared with the hf capture).
    assert check_servable_aux_layer_ids([1, 3, 6], 8) == [1, 3, 6]
    with pytest.raises(ValueError, match="last decoder layer"):
        check_servable_aux_layer_ids([1, 3, 7], 8)
    for bad in ([1, 1, 3], [3, 1, 4], [1, 3, 8], [-1, 2, 3]):
        with pytest.raises(ValueError):
            check_servable_aux_layer_ids(bad, 8)


def test_loaded_model_mapping_is_checked_llama_and_deepseek_styles() -> None:
    llama, kimi = LlamaLike(), KimiLike()
    for ids in ([1, 3, 4], [2, 3, 5], [0, 29, 57]):
        llama.set_eagle3_layers_to_capture(ids)
        check_capture_mapping(ids, capture_layers_of(llama))  # always id + 1
    kimi.set_eagle3_layers_to_capture([1, 29, 57])  # Kimi's default: first id 1, so SGLang adds 1
    assert capture_layers_of(kimi) == [2, 30, 58]
    check_capture_mapping([1, 29, 57], capture_layers_of(kimi))
    kimi.set_eagle3_layers_to_capture([2, 30, 58])  # taken as layer inputs: outputs 1, 29, 57
    with pytest.raises(SGLangCaptureError, match=r"outputs \[1, 29, 57\], not \[2, 30, 58\]"):
        check_capture_mapping([2, 30, 58], capture_layers_of(kimi), "KimiK25ForConditionalGeneration")


def test_models_that_would_capture_nothing_are_refused() -> None:
    with pytest.raises(SGLangCaptureError, match="has no set_eagle3_layers_to_capture"):
        capture_layers_of(NoEagle3())
    with pytest.raises(SGLangCaptureError, match="capture nothing"):
        capture_layers_of(LlamaLike())  # set_eagle3_layers_to_capture never called (e.g. not the last PP rank)
    two = KimiLike()
    two.extra = LlamaLike()
    two.set_eagle3_layers_to_capture([1, 2, 3])
    two.extra.set_eagle3_layers_to_capture([2, 3, 4])
    with pytest.raises(SGLangCaptureError, match="several decoder stacks"):
        capture_layers_of(two)


def test_prediction_before_loading_matches_sglang_models() -> None:
    for archs, ids in (
        (["LlamaForCausalLM"], [2, 3, 5]),
        (["KimiK25ForConditionalGeneration"], [1, 29, 57]),
        (["KimiK25ForConditionalGeneration"], [2, 30, 58]),
        (["DeepseekV3ForCausalLM"], [0, 3, 4]),
    ):
        model = DeepseekLike() if "Llama" not in archs[0] else LlamaLike()
        model.set_eagle3_layers_to_capture(ids)
        assert predicted_capture_inputs(archs, ids) == capture_layers_of(model), (archs, ids)


# ---- target config and SGLang arguments ---------------------------------------------------------------


def test_target_dims_read_kimi_nested_text_config() -> None:
    kimi = target_dims(json.loads((FIXTURES / "kimi_k25_config.json").read_text()))
    assert kimi == {
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "vocab_size": 163840,
        "architectures": ["KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM"],
    }
    assert target_dims({"architectures": ["LlamaForCausalLM"], **TINY})["num_hidden_layers"] == 6
    with pytest.raises(ValueError, match="vocab_size"):
        target_dims({"num_hidden_layers": 2, "hidden_size": 8})


def test_kimi_ids_not_starting_at_one_are_refused_before_any_model_load(tmp_path) -> None:
    class NeverLoads(FakeBackend):
        @staticmethod
        def prepare(server_kwargs):
            raise AssertionError("must be refused before SGLang is set up")

    class Cap(SGLangCapture):
        backend = NeverLoads

    target = tmp_path / "kimi"
    target.mkdir()
    (target / "config.json").write_text((FIXTURES / "kimi_k25_config.json").read_text())
    for ids in ([0, 29, 57], [2, 30, 58]):  # SGLang would capture the inputs of these layers: one layer early
        with pytest.raises(SGLangCaptureError, match="add 1 only when the first id is 1"):
            Cap(str(target), ids, tp_size=8)
    with pytest.raises(ValueError, match="last decoder layer"):
        Cap(str(target), [1, 29, 60], tp_size=8)


def test_server_kwargs_capture_mode_and_user_settings() -> None:
    kw = sglang_server_kwargs(
        "/m/K", [1, 29, 57], torch.bfloat16, {"tp_size": 8, "mem_fraction_static": 0.85, "trust_remote_code": True}
    )
    assert kw["model_path"] == "/m/K" and kw["dtype"] == "bfloat16"
    assert kw["enable_return_aux_hidden_states"] is True and kw["speculative_algorithm"] == "EAGLE3"
    assert kw["return_aux_hidden_state_layer_ids"] == [1, 29, 57]  # passed as is: SGLang maps them like a drafter's
    assert kw["disable_cuda_graph"] and kw["disable_radix_cache"] and kw["skip_tokenizer_init"]
    assert (kw["tp_size"], kw["mem_fraction_static"], kw["trust_remote_code"]) == (8, 0.85, True)
    assert sglang_server_kwargs("/m", [1], user_kwargs={"disable_cuda_graph": False})["disable_cuda_graph"] is False
    for bad in (
        {"return_aux_hidden_state_layer_ids": [2]},
        {"speculative_algorithm": "EAGLE"},
        {"model_path": "x"},
        {"pp_size": 2},
        {"enable_dp_attention": True},
        {"dp_size": 2},
        {"attn_dp_size": 2},
        {"attn_cp_size": 2},
        {"dcp_size": 2},
        {"enable_prefill_cp": True},
        {"tp_size": 0},
        {"tp_size": "8"},
    ):
        with pytest.raises(ValueError):
            sglang_server_kwargs("/m", [1], user_kwargs=bad)
    assert gpu_ids({"tp_size": 4}) == [0, 1, 2, 3]
    assert gpu_ids({"tp_size": 2, "base_gpu_id": 4, "gpu_id_step": 2}) == [4, 6]


# ---- batches, and SGLang's flat outputs -> per-sequence states --------------------------------------------


def test_sequences_are_checked() -> None:
    assert check_sequences([torch.tensor([1, 2, 3], dtype=torch.int32)], 10) == [[1, 2, 3]]
    for bad in (
        [torch.zeros(2, 3, dtype=torch.long)],
        [torch.tensor([1.0, 2.0])],
        [torch.tensor([], dtype=torch.long)],
        [torch.tensor([1, 10])],
        [torch.tensor([-1, 2])],
        [[1, 2]],
    ):
        with pytest.raises(ValueError):
            check_sequences(bad, 10)


def test_forwards_fit_sglang_pools_in_order() -> None:
    assert plan_forwards([5, 3, 7, 2], max_tokens=100, max_requests=8) == [[0, 1, 2, 3]]
    assert plan_forwards([5, 3, 7, 2], max_tokens=10, max_requests=8) == [[0, 1], [2, 3]]
    assert plan_forwards([5, 3, 7, 2], max_tokens=100, max_requests=3) == [[0, 1, 2], [3]]
    # chunked_prefill_size bounds a forward; a longer sequence runs alone
    assert plan_forwards([4, 4, 9, 1], max_tokens=100, max_requests=8, chunk_tokens=8) == [[0, 1], [2], [3]]
    assert plan_forwards([4, 4], max_tokens=100, max_requests=8, chunk_tokens=-1) == [[0, 1]]
    with pytest.raises(ValueError, match="KV pool"):
        plan_forwards([5, 11], max_tokens=10, max_requests=8)
    with pytest.raises(ValueError, match="context length"):
        plan_forwards([5, 11], max_tokens=100, max_requests=8, context_len=10)


@pytest.fixture(scope="module")
def shapes() -> dict:
    return json.loads((FIXTURES / "logits_output_shapes.json").read_text())


def test_flat_batch_outputs_split_into_sequences(shapes) -> None:
    b, full = shapes["batch"], shapes["modes"]["full_with_aux"]
    lengths, A, H = b["lengths"], b["num_aux"], b["hidden_size"]
    aux = torch.arange(torch.Size(full["hidden_states"]).numel(), dtype=torch.float32).reshape(full["hidden_states"])
    final = -torch.arange(torch.Size(full["last_hidden_states"]).numel(), dtype=torch.float32).reshape(
        full["last_hidden_states"]
    )
    pieces = split_capture(aux, final, lengths, A, H)
    assert [(tuple(a.shape), tuple(f.shape)) for a, f in pieces] == [((n, A * H), (n, H)) for n in lengths]
    start = 0
    for (a, f), n in zip(pieces, lengths):  # rows in order, nothing dropped or shifted
        assert torch.equal(a, aux[start : start + n]) and torch.equal(f, final[start : start + n])
        start += n


@pytest.mark.parametrize(
    "mode, message",
    [
        ("last_with_aux", "pruned to the last token"),
        ("full_without_aux", "aux capture is off"),
        ("full_two_of_three_layers", "2 layers captured, 3 asked for"),
    ],
)
def test_wrong_capture_shapes_are_explained(shapes, mode, message) -> None:
    b, m = shapes["batch"], shapes["modes"][mode]
    aux = torch.randn(m["hidden_states"])
    final = (
        torch.randn(m["last_hidden_states"]) if m["last_hidden_states"] else torch.randn(aux.shape[0], b["hidden_size"])
    )
    with pytest.raises(SGLangCaptureError, match=message):
        split_capture(aux, final, b["lengths"], b["num_aux"], b["hidden_size"])


def test_missing_or_malformed_outputs_are_refused() -> None:
    aux, final = torch.randn(8, 48), torch.randn(8, 16)
    split_capture(aux, final, [5, 3], 3, 16)
    for a, f, msg in (
        (None, final, "no hidden states"),
        (aux, None, "no final"),
        (aux[None], final, "2-D"),
        (aux, torch.randn(8, 17), "17 wide"),
        (torch.randn(8, 50), final, "not a multiple"),
        (torch.randn(7, 48), torch.randn(7, 16), "7 aux and 7 final rows for a batch of 8"),
    ):
        with pytest.raises(SGLangCaptureError, match=msg):
            split_capture(a, f, [5, 3], 3, 16)


# ---- worker processes (spawned for real) ----------------------------------------------------------------


def test_tensor_parallel_workers_capture_then_fail_cleanly(tmp_path) -> None:
    target = write_target(tmp_path / "t", ["LlamaForCausalLM"])
    log = tmp_path / "ranks.jsonl"
    layer_ids = [0, 2, 4]
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 60, (n,), generator=gen) for n in (9, 4, 12, 7)]
    cap = FakeCapture(str(target), layer_ids, tp_size=2, fake_log=str(log), fake_max_tokens=20)
    try:
        assert (cap.num_hidden_layers, cap.hidden_size, cap.vocab_size) == (6, 32, 64)
        assert cap.info["layers_to_capture"] == [1, 3, 5]
        out = cap.capture(seqs)
        model = tiny_llama()
        with torch.no_grad(), AuxHiddenCapture(model, layer_ids) as ref:
            for s, (aux, final) in zip(seqs, out):
                want_final = model.get_decoder()(input_ids=s[None]).last_hidden_state[0]
                torch.testing.assert_close(aux, ref.aux_hidden_states()[0])
                torch.testing.assert_close(final, want_final)
        # Both ranks ran every forward, the same ones, split to fit the 20-token pool.
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        assert sorted(calls) == sorted([[r, b] for r in (0, 1) for b in ([9, 4], [12, 7])])
        # A rank that fails reports its error; the capture is closed afterwards.
        with pytest.raises(SGLangCaptureError, match=r"rank 1 failed while capturing:(.|\n)*boom on rank 1"):
            cap.capture([torch.tensor([FAIL_ID, FAIL_ID, 2])])
        assert cap._procs == []
        with pytest.raises(SGLangCaptureError, match="closed"):
            cap.capture(seqs)
    finally:
        cap.close()


def test_a_dead_worker_is_detected(tmp_path) -> None:
    target = write_target(tmp_path / "t", ["LlamaForCausalLM"])
    with FakeCapture(str(target), [0, 2, 4], tp_size=2, fake_model="light") as cap:
        procs = list(cap._procs)
        with pytest.raises(
            SGLangCaptureError, match=r"while capturing without reporting an error:\nrank 1: exit code 7\n"
        ):
            cap.capture([torch.tensor([DIE_ID, DIE_ID])])
    assert not any(p.is_alive() for p in procs)


@pytest.mark.parametrize(
    "model, ids, message",
    [
        ("no-eagle3", [0, 2, 4], "has no set_eagle3_layers_to_capture"),
        ("deepseek", [2, 3, 4], r"outputs \[1, 2, 3\], not \[2, 3, 4\]"),
        ("deepseek", [0, 2, 4], r"outputs \[-1, 1, 3\], not \[0, 2, 4\]"),  # -1: the embeddings
        ("kimi", [0, 2, 4], r"outputs \[-1, 1, 3\], not \[0, 2, 4\]"),
    ],
)
def test_loaded_model_that_would_capture_wrong_layers_fails_construction(tmp_path, model, ids, message) -> None:
    class Unpredicted(FakeCapture):
        early_mapping_check = False  # only the check on the loaded model can catch it

    target = write_target(tmp_path / "t", ["SomeNewForCausalLM"])
    with pytest.raises(SGLangCaptureError, match=message):
        Unpredicted(str(target), ids, fake_model=model)


def test_workers_do_not_rerun_the_main_script(tmp_path) -> None:
    """The hidden rule runs a Snakemake script with top-level code: spawned ranks must not execute it again."""
    target = write_target(tmp_path / "t", ["LlamaForCausalLM"])
    marker = tmp_path / "runs.txt"
    script = tmp_path / "rule_script.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path[:0] = [{str(REPO)!r}, {str(Path(__file__).parent)!r}]\n"
        f"open({str(marker)!r}, 'a').write('run\\n')\n"
        "from test_sglang_capture import FakeCapture\n"
        f"with FakeCapture({str(target)!r}, [0, 2, 4], tp_size=2, fake_model='light') as cap:\n"
        "    print(cap.info['layers_to_capture'])\n"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert marker.read_text() == "run\n", r.stderr
    assert r.returncode == 0, r.stderr


def test_a_worker_killed_by_a_signal_says_how_it_died(tmp_path) -> None:
    """A crash inside a kernel sends no Python error: the message names the signal and the stack it hit."""
    target = write_target(tmp_path / "t", ["LlamaForCausalLM"])
    with pytest.raises(
        SGLangCaptureError,
        match=r"(?s)while loading the target without reporting an error:\n"
        r"rank 1: killed by SIGSEGV; its fatal-error stack:.*Segmentation fault.*in load",
    ):
        FakeCapture(str(target), [0, 2, 4], tp_size=2, fake_model="light", fake_crash="segv")


def test_backends_must_be_importable_by_name() -> None:
    """Workers import the backend by name: a class in __main__ or in a function would die unpickled in them."""
    ref = backend_reference(FakeBackend)
    assert ref == f"{FakeBackend.__module__}:FakeBackend" and resolve_backend(ref) is FakeBackend
    assert backend_reference(SGLang0523) == "aerie.hidden.sglang.sglang_0523:SGLang0523"

    class Local(FakeBackend):
        pass

    with pytest.raises(SGLangCaptureError, match="defined in a function"):
        backend_reference(Local)
    with pytest.raises(SGLangCaptureError, match="defined in __main__"):
        backend_reference(type("InMain", (FakeBackend,), {"__module__": "__main__"}))
    for bad, message in (("FakeBackend", "expected MODULE:CLASS"), ("aerie.hidden.sglang:Nope", "has no Nope")):
        with pytest.raises(ValueError, match=message):
            resolve_backend(bad)


def test_a_worker_reports_a_backend_it_cannot_import(tmp_path) -> None:
    """The worker resolves the backend and unpickles the payload inside its error handling: the parent gets the
    traceback, not only an exit code."""
    import faulthandler
    import pickle
    import queue

    from aerie.hidden.sglang.worker import run_rank

    outbox: queue.Queue = queue.Queue()
    was_enabled = faulthandler.is_enabled()  # run_rank points faulthandler at its file: pytest's is restored below
    try:
        run_rank(
            "aerie_no_such_module:Backend", pickle.dumps({}), 0, 1, 0, queue.Queue(), outbox, os.getpid(), str(tmp_path)
        )
        run_rank(
            f"{FakeBackend.__module__}:FakeBackend",
            b"not a pickle",
            1,
            2,
            0,
            queue.Queue(),
            outbox,
            os.getpid(),
            str(tmp_path),
        )
    finally:
        if was_enabled:
            faulthandler.enable(file=sys.stderr)
    kind, rank, text = outbox.get_nowait()
    assert (kind, rank) == ("error", 0) and "No module named 'aerie_no_such_module'" in text
    kind, rank, text = outbox.get_nowait()
    assert (kind, rank) == ("error", 1) and "UnpicklingError" in text


class ReqToTokenPool0523:
    """The row bookkeeping of sglang 0.5.23's ReqToTokenPool (srt/mem_cache/memory_pool.py): ``size + 1`` rows,
    row 0 kept as padding for CUDA-graph batches, ``free_slots = range(1, size + 1)``."""

    def __init__(self, size: int) -> None:
        self.size, self._alloc_size = size, size + 1
        self.free_slots = list(range(1, self._alloc_size))

    def alloc_rows(self, need: int) -> list[int] | None:
        if need > len(self.free_slots):
            return None
        rows, self.free_slots = self.free_slots[-need:], self.free_slots[:-need]
        return rows

    def available_size(self) -> int:
        return len(self.free_slots)

    def clear(self) -> None:
        self.free_slots = list(range(1, self._alloc_size))


def test_request_pool_capacity_is_every_row_but_the_padding_row() -> None:
    pool = ReqToTokenPool0523(8)
    pool.alloc_rows(3)  # left over from an earlier forward: the capture empties the pool first
    assert request_capacity(pool) == 8 == pool.size  # `size` already excludes the padding row
    assert pool.alloc_rows(8) is not None and pool.alloc_rows(1) is None
    assert plan_forwards([4] * 9, max_tokens=100, max_requests=request_capacity(pool)) == [list(range(8)), [8]]
    with pytest.raises(ValueError, match="request pool"):
        plan_forwards([4], max_tokens=100, max_requests=0)


# ---- the environment and the GPU-host check tool ---------------------------------------------------------


def test_sglang_environment_pins_the_version_the_glue_was_written_for() -> None:
    import yaml

    env = yaml.safe_load((REPO / "envs" / "sglang.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    names = {p.split("=")[0].split(">")[0].strip() for p in pip}
    assert f"sglang=={TESTED_SGLANG_VERSION}" in pip
    assert {"safetensors", "numpy", "aiohttp", "requests", "pyyaml"} <= names


def test_gpu_check_tool_tells_right_from_off_by_one(tmp_path) -> None:
    """`python -m aerie.hidden.sglang_check check` judges SGLang's states with compare_with_transformers: it must
    pass the right tensors and name the neighbour an off-by-one capture matches."""
    model = tiny_llama()
    model.save_pretrained(tmp_path / "t")
    layer_ids = [0, 2, 4]
    seqs = [torch.randint(0, 60, (n,), generator=torch.Generator().manual_seed(n)) for n in (6, 9)]
    right, early = [], []
    with torch.no_grad(), AuxHiddenCapture(model, layer_ids) as cap:
        for s in seqs:
            out = model(s[None], output_hidden_states=True)
            final = model.get_decoder()(input_ids=s[None]).last_hidden_state[0]
            right.append((cap.aux_hidden_states()[0], final))
            early.append((torch.cat([out.hidden_states[i][0] for i in layer_ids], -1), final))
    good = compare_with_transformers(tmp_path / "t", layer_ids, right, seqs)
    assert good["ok"] and good["argmax_agreement"] == 1.0
    assert [good["aux"][i]["closest_hidden_states_index"] for i in layer_ids] == [1, 3, 5]
    bad = compare_with_transformers(tmp_path / "t", layer_ids, early, seqs)
    assert not bad["ok"]
    assert [bad["aux"][i]["closest_hidden_states_index"] for i in layer_ids] == [0, 2, 4]


def run_tool(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m aerie.hidden.sglang_check ARGS``, with this test module importable (it holds the
    stand-in backend)."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "aerie.hidden.sglang_check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


def test_check_tool_started_with_python_m_runs_its_workers(tmp_path) -> None:
    """`python -m aerie.hidden.sglang_check check` (the README's first GPU step) on CPU with the stand-in backend: the
    tool's own module is __main__, and its spawned worker must still start, load, capture, and match transformers
    (before the fix the worker died unpickling `__main__._worker_main`)."""
    tiny_llama().save_pretrained(tmp_path / "t")  # the same weights the stand-in's worker builds
    report_path = tmp_path / "report.json"
    r = run_tool(
        [
            "check",
            "--target",
            str(tmp_path / "t"),
            "--layers",
            "0",
            "2",
            "4",
            "--seqs",
            "2",
            "--len",
            "12",
            "--backend",
            f"{FakeBackend.__module__}:FakeBackend",
            "--out",
            str(report_path),
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.rstrip().endswith("PASS")
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["runner_info"]["layers_to_capture"] == [1, 3, 5]
    assert [row["closest_hidden_states_index"] for row in report["aux"].values()] == [1, 3, 5]
    assert [s["aux"] for s in report["shapes"]] == [[n, 3 * TINY["hidden_size"]] for n in report["lengths"]]
