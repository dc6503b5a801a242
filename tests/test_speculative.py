"""Speculative decoding: lossless vs. greedy, eos/budget handling, acceptance accounting, the benchmark JSON.

Everything runs on a tiny random Llama built in-test (fp32, CPU), so it is fast and needs no files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from tiny_world import char_chat_tokenizer, write_prompts
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from aerie.benchmark.speculative import (
    NgramProposer,
    SpecResult,
    _target_forward,
    crop_cache,
    first_mismatch,
    greedy_generate,
    speculative_generate,
)
from aerie.drafter_kinds.eagle3.drafting import EagleProposer
from aerie.drafter_kinds.eagle3.model import DrafterConfig, Eagle3Drafter
from aerie.target_model.capture import AuxHiddenCapture

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 300
AUX_IDS = [1, 3, 4]
MAX_NEW = 40


def _tiny_llama(seed: int = 0, eos_token_id: int | None = None) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=eos_token_id,
    )
    return LlamaForCausalLM(cfg).eval()


def _tiny_drafter(target: LlamaForCausalLM, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    draft_vocab = 200
    ids = torch.randperm(VOCAB)[:draft_vocab].sort().values  # a random, ascending draft vocab
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    d2t = ids - torch.arange(draft_vocab)
    cfg = DrafterConfig.from_target(target.config, draft_vocab_size=draft_vocab, aux_layer_ids=AUX_IDS)
    return Eagle3Drafter.from_target(target, cfg, d2t, t2d).eval()


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return _tiny_llama()


@pytest.fixture(scope="module")
def drafter(target) -> Eagle3Drafter:
    return _tiny_drafter(target)


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, VOCAB, (1, n), generator=g) for n in (1, 7, 19)]


@pytest.fixture(scope="module")
def refs(target, prompts) -> list[list[int]]:
    """Greedy continuations without eos: the ground truth every speculative run must reproduce."""
    return [greedy_generate(target, p, MAX_NEW) for p in prompts]


class ScriptedProposer:
    """Proposes the target's true greedy continuation, with only the first ``pattern[call]`` drafts
    right and the rest wrong: exercises full acceptance (+bonus), rejection at every position, and crops."""

    aux_layer_ids = None

    def __init__(self, full: Sequence[int], pattern: Sequence[int]):
        self.full, self.pattern = list(full), list(pattern)
        self.expected_accepts: list[int] = []

    def reset(self) -> None:
        self.calls = 0
        self.expected_accepts = []

    def scripted(self, tokens: Sequence[int], max_drafts: int) -> list[int]:
        truth = self.full[len(tokens) : len(tokens) + max_drafts]
        assert len(truth) == max_drafts, "the engine asked for drafts past its budget"
        n_ok = min(self.pattern[self.calls % len(self.pattern)], max_drafts)
        self.calls += 1
        self.expected_accepts.append(n_ok)
        return truth[:n_ok] + [(t + 1) % VOCAB for t in truth[n_ok:]]

    def propose(self, tokens, aux, max_drafts):
        return self.scripted(tokens, max_drafts)


class ScriptedEagleProposer(EagleProposer):
    """The real EAGLE proposer (drafter forwards, cache crops, catch-up) with scripted drafts on top,
    so long accepted prefixes reach the drafter's catch-up path. It also checks that the incremental
    drafter state equals a fresh forward over all TRUE target features."""

    def __init__(self, drafter: Eagle3Drafter, target, script: ScriptedProposer):
        self.target, self.script = target, script
        super().__init__(drafter)

    def reset(self) -> None:
        super().reset()
        self.script.reset()
        self.seen: list[torch.Tensor] = []

    def _forward(self, hidden, ids, start):
        logits, h = super()._forward(hidden, ids, start)
        self.step_logits.append(logits[:, -1])  # [0]: the catch-up forward, then one per chained draft
        return logits, h

    def propose(self, tokens, aux, max_drafts):
        self.seen.append(aux)
        self.step_logits: list[torch.Tensor] = []
        own = super().propose(tokens, aux, max_drafts)
        if max_drafts == 0:
            return own
        assert len(own) == max_drafts
        assert self.true_len == len(tokens) - 1
        assert len(self.cache) == self.true_len + max_drafts - 1  # true positions + chained drafts
        feats = torch.cat(self.seen, dim=1)
        # The engine handed over exactly the target's features of the committed positions...
        with AuxHiddenCapture(self.target, self.aux_layer_ids) as cap:
            self.target(input_ids=torch.tensor([list(tokens[:-1])]))
            fresh = cap.aux_hidden_states()
        torch.testing.assert_close(feats, fresh, atol=1e-4, rtol=1e-4)
        # ...the cropped, caught-up drafter cache equals a fresh uncached forward over them, and the
        # cached draft chain equals re-running everything uncached, one more row per draft
        # (row j: the previous row's hidden_out, the previous draft, the next position).
        hidden, ids, pos = self.drafter.project_aux(fresh), list(tokens[1:]), list(range(len(tokens) - 1))
        chain: list[int] = []
        while True:
            logits, out = self.drafter(hidden, torch.tensor([ids]), torch.tensor([pos]))
            torch.testing.assert_close(self.step_logits[len(chain)], logits[:, -1], atol=1e-4, rtol=1e-4)
            chain.append(int(self.drafter.draft_to_target(logits[:, -1].argmax(-1))))
            if len(chain) == max_drafts:
                break
            hidden = torch.cat([hidden, out[:, -1:]], dim=1)
            ids.append(chain[-1])
            pos.append(pos[-1] + 1)
        assert own == chain
        return self.script.scripted(tokens, max_drafts)


def check_accounting(res: SpecResult) -> None:
    """Invariants of SpecResult that the benchmark's acceptance figures rely on."""
    k = res.num_draft_steps
    steps = res.verify_steps
    assert len(res.drafted_per_step) == len(res.accepted_per_step) == steps
    if res.tokens:
        # The prefill's token belongs to no verify step; every other token to exactly one.
        assert sum(res.committed_per_step) == len(res.tokens) - 1
    if steps:
        assert res.acceptance_length == pytest.approx((len(res.tokens) - 1) / steps)
        assert 1 <= res.acceptance_length <= k + 1
    else:
        assert res.acceptance_length is None
    for i, (d, a, c) in enumerate(zip(res.drafted_per_step, res.accepted_per_step, res.committed_per_step)):
        assert 0 <= a <= d <= k
        last = i == steps - 1
        assert c == a + 1 or (last and a <= c <= a + 1)  # only the final step may lose its bonus
    for i in range(k):
        assert res.drafted_per_position[i] == sum(d > i for d in res.drafted_per_step)
        assert res.accepted_per_position[i] == sum(a > i for a in res.accepted_per_step)
    # Chain drafting: position i is accepted only if every earlier position was.
    assert all(x >= y for x, y in zip(res.accepted_per_position, res.accepted_per_position[1:]))


# ---------------------------------------------------------------------------------------------------------
# lossless


@pytest.mark.parametrize("k", [1, 3, 5])
def test_lossless_with_untrained_drafter(target, drafter, prompts, refs, k):
    for p, ref in zip(prompts, refs):
        res = speculative_generate(target, EagleProposer(drafter), p, MAX_NEW, [], num_draft_steps=k)
        assert res.tokens == ref, f"diverges at {first_mismatch(res.tokens, ref)}"
        assert res.finish_reason == "length"
        check_accounting(res)


@pytest.mark.parametrize("k", [1, 4])
def test_lossless_with_scripted_eagle_proposer(target, drafter, prompts, refs, k):
    """Long accepted prefixes through the real drafter: its cache crop and catch-up stay exact."""
    pattern = [k, 0, k, 1, 2, k, k]
    for p, ref in zip(prompts, refs):
        script = ScriptedProposer(p[0].tolist() + ref, pattern)
        res = speculative_generate(target, ScriptedEagleProposer(drafter, target, script), p, MAX_NEW, [], k)
        assert res.tokens == ref
        assert res.accepted_per_step == script.expected_accepts
        check_accounting(res)


def test_perfect_proposer_commits_k_plus_one(target, prompts, refs):
    k = 4
    p, ref = prompts[1], refs[1]
    res = speculative_generate(target, ScriptedProposer(p[0].tolist() + ref, [k]), p, MAX_NEW, [], k)
    assert res.tokens == ref
    # 39 tokens after the prefill: 7 full steps of k+1 = 35, then the budget caps the drafts (3 -> 4 tokens).
    assert res.committed_per_step == [5] * 7 + [4]
    assert res.drafted_per_step == [4] * 7 + [3]
    assert res.acceptance_length == pytest.approx(39 / 8)
    check_accounting(res)


def test_lossless_with_ngram_proposer(target, prompts, refs):
    for p, ref in zip(prompts, refs):
        res = speculative_generate(target, NgramProposer(max_ngram=3), p, MAX_NEW, [], 3)
        assert res.tokens == ref
        check_accounting(res)


def test_ngram_proposer_lookup():
    ng = NgramProposer(max_ngram=3)
    assert ng.propose([1, 2, 3, 9, 8, 1, 2], None, 3) == [3, 9, 8]  # longest suffix "1 2" matched
    assert ng.propose([5, 1, 7, 1], None, 2) == [7, 1]  # latest earlier "1"
    assert ng.propose([1, 2, 3], None, 4) == []  # no repeat: no guess
    assert ng.propose([4, 4], None, 0) == []


# ---------------------------------------------------------------------------------------------------------
# eos and budget


def test_eos_stops_exactly(target, drafter, prompts, refs):
    p, ref = prompts[2], refs[2]
    k = 4
    # A perfect proposer commits tokens 1+5s .. 5+5s in step s; pick an eos that first appears at a
    # draft position (not a bonus), so the engine must cut an accepted run short.
    j = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i] and (i - 1) % (k + 1) != k)
    eos = ref[j]
    expected = ref[: j + 1]
    assert greedy_generate(target, p, MAX_NEW, [eos]) == expected
    for proposer in (EagleProposer(drafter), ScriptedProposer(p[0].tolist() + ref, [k])):
        res = speculative_generate(target, proposer, p, MAX_NEW, [eos, VOCAB + 5], k)
        assert res.tokens == expected
        assert res.finish_reason == "stop"
        check_accounting(res)
    assert res.accepted_per_step[-1] == res.committed_per_step[-1] == (j - 1) % (k + 1) + 1  # bonus dropped


def test_eos_as_first_token(target, drafter, prompts, refs):
    p, ref = prompts[0], refs[0]
    assert greedy_generate(target, p, MAX_NEW, [ref[0]]) == [ref[0]]
    res = speculative_generate(target, EagleProposer(drafter), p, MAX_NEW, [ref[0]], 3)
    assert res.tokens == [ref[0]] and res.verify_steps == 0 and res.acceptance_length is None
    assert res.finish_reason == "stop"


@pytest.mark.parametrize("budget", [0, 1, 2, 3, 6, 11])
def test_max_new_tokens_exact(target, drafter, prompts, refs, budget):
    p, ref = prompts[1], refs[1]
    assert greedy_generate(target, p, budget) == ref[:budget]
    for proposer in (EagleProposer(drafter), ScriptedProposer(p[0].tolist() + ref, [4])):
        res = speculative_generate(target, proposer, p, budget, [], 4)
        assert res.tokens == ref[:budget]
        check_accounting(res)


def test_bad_inputs(target, drafter):
    with pytest.raises(ValueError):
        speculative_generate(target, EagleProposer(drafter), torch.tensor([[1, 2], [3, 4]]), 4, [], 3)
    with pytest.raises(ValueError):
        speculative_generate(target, EagleProposer(drafter), torch.tensor([[1, 2]]), 4, [], 0)
    with pytest.raises(ValueError):
        greedy_generate(target, torch.zeros(1, 0, dtype=torch.long), 4)


def test_crop_cache(target):
    cache = DynamicCache()
    _target_forward(target, torch.tensor([[5, 6, 7, 8, 9]]), cache, last_only=True)
    crop_cache(cache, 5)  # no-op (a bare crop(0) would empty a 4.x cache)
    assert cache.get_seq_length() == 5
    crop_cache(cache, 3)
    assert cache.get_seq_length() == 3
    with pytest.raises(ValueError):
        crop_cache(cache, 4)


def test_first_mismatch():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


# ---------------------------------------------------------------------------------------------------------
# benchmark


def _save_tiny_target(folder: Path) -> LlamaForCausalLM:
    """A save_pretrained target folder with a character-level tokenizer and a chat template."""
    tok, vocab = char_chat_tokenizer(["<unk>", "<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"])
    model = _tiny_llama(seed=3, eos_token_id=vocab["<|end|>"])
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model


def _tiny_dflash_folder(target: LlamaForCausalLM, folder: Path, seed: int, block_size: int = 6) -> Path:
    """A DFlash drafter folder for the tiny target as aerie exports it (MASK: the tokenizer's <unk>, id 0, which no
    text encodes to), drafting block_size - 1 tokens a step."""
    from aerie.drafter_kinds.dflash.model import DFlashDrafter
    from aerie.drafter_kinds.dflash.shape import DFlashShape
    from aerie.drafter_kinds.dflash.weights import export_dflash

    shape = DFlashShape.from_target(
        target.config, num_layers=2, block_size=block_size, mask_token_id=0, target_layer_ids=[1, 3]
    )
    torch.manual_seed(seed)
    export_dflash(DFlashDrafter(shape), shape, folder, {})
    return folder


@pytest.fixture(scope="module")
def bench_files(tmp_path_factory) -> Path:
    """A saved target (with tokenizer), a saved EAGLE-3 drafter, a DFlash one and a prompts file, in one folder."""
    folder = tmp_path_factory.mktemp("bench")
    target = _save_tiny_target(folder / "target")
    _tiny_drafter(target).save_pretrained(folder / "drafter")
    _tiny_dflash_folder(target, folder / "dflash", seed=1)
    texts = ["sort 3 1 2", "what is 12+30?", "hello there", "unused: cut by max_prompts"]
    write_prompts(folder / "bench.jsonl", texts)
    return folder


def _bench(folder: Path, out: Path, lines: list[str] | None = None) -> dict:
    from aerie.benchmark.run import run_benchmark
    from aerie.benchmark.settings import BenchRun, TargetLoad

    threads_before = torch.get_num_threads()
    try:
        return run_benchmark(
            TargetLoad(folder / "target", "cpu", "float32"),
            {"demo": folder / "drafter"},
            [folder / "bench.jsonl"],
            out,
            BenchRun(max_new_tokens=12, num_draft_steps=3, repeats=2, warmup=1, threads=1, max_prompts=3),
            log=(lines if lines is not None else []).append,
        )
    finally:
        torch.set_num_threads(threads_before)


def test_run_benchmark_writes_documented_json(bench_files, tmp_path):
    """One trained drafter (the demo's case): the report of every method, named as before but for the drafter's
    name, with its role, kind and width; no top-level figures of one drafter."""
    out = tmp_path / "bench" / "demo.json"
    lines: list[str] = []
    report = _bench(bench_files, out, lines)

    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(report))
    assert [p.name for p in out.parent.iterdir()] == ["demo.json"]  # no temporary file left behind
    documented = [
        "format",
        "target",
        "drafters",
        "prompts",
        "num_draft_steps",
        "max_new_tokens",
        "baseline",
        "methods",
        "sets",
        "lossless",
        "divergences",
        "failed_requests",
        "per_prompt",
    ]
    assert not [f for f in documented if f not in on_disk]
    assert not {"speculative", "speedup", "acceptance_length", "drafter", "beats_references"} & set(on_disk)
    assert on_disk["format"] == "aerie.bench/4"
    assert on_disk["prompts"] == 3 and len(on_disk["per_prompt"]) == 3
    assert on_disk["num_draft_steps"] == 3 and on_disk["max_new_tokens"] == 12
    (name,) = on_disk["drafters"]
    drafter = on_disk["drafters"]["demo"]
    assert drafter["kind"] == "eagle3" and drafter["draft_tokens"] == 3 and drafter["layer_ids"] == AUX_IDS
    assert drafter["folder"] == str(bench_files / "drafter") and drafter["simulated_acceptance_length"] is None
    methods = on_disk["methods"]
    assert list(methods) == ["demo", "untrained", "ngram"]  # one trained drafter: its twin keeps the name untrained
    roles = {m: (v["role"], v["kind"], v["draft_tokens"], v["twin_of"]) for m, v in methods.items()}
    assert roles == {
        "demo": ("trained", "eagle3", 3, None),
        "untrained": ("untrained", "eagle3", 3, "demo"),
        "ngram": ("ngram", None, 3, None),
    }
    base = on_disk["baseline"]["tokens_per_s"]
    mine = methods["demo"]
    assert base > 0 and mine["tokens_per_s"] > 0
    assert mine["speedup"] == pytest.approx(mine["tokens_per_s"] / base)
    assert on_disk["lossless"] is True and all(
        m["lossless"] for p in on_disk["per_prompt"] for m in p["methods"].values()
    )
    assert len(mine["acceptance_per_position"]) == 3
    assert all(0 <= a <= 1 for a in mine["acceptance_per_position"])
    gen = sum(p["generated_tokens"] for p in on_disk["per_prompt"])
    assert mine["acceptance_length"] == pytest.approx((gen - 3) / mine["verify_steps"])  # one prefill token a prompt
    assert mine["spec_accept_length"] == pytest.approx(gen / mine["verify_steps"])  # SGLang's: the prefill counted
    # One set (one prompt file): its table holds the same figures as the whole run.
    (table,) = on_disk["sets"].values()
    assert table["prompts"] == 3 and table["methods"]["demo"]["acceptance_length"] == mine["acceptance_length"]
    assert on_disk["failed_requests"] == {"baseline": 0, "demo": 0, "untrained": 0, "ngram": 0}
    assert on_disk["baseline"]["tokens"] == mine["tokens"] == 2 * gen  # 2 repeats
    assert on_disk["threads"] == 1 and on_disk["cpu_count"] == os.cpu_count()
    for p in on_disk["per_prompt"]:
        assert len(p["baseline_s"]) == 2 and set(p["methods"]) == {"demo", "untrained", "ngram"}
        d = p["methods"]["demo"]
        assert len(d["seconds"]) == 2 and d["speedup"] == pytest.approx(d["tokens_per_s"] / p["baseline_tokens_per_s"])
        assert not {"speedup", "lossless", "speculative_s"} & set(p)
    assert any("tok/s; demo " in line for line in lines), lines
    # The references ran in the same run, on the same prompts, losslessly.
    for m in methods.values():
        assert m["lossless"] is True
        assert m["speedup"] == pytest.approx(m["tokens_per_s"] / base)
        assert m["tokens"] == 2 * gen
    assert on_disk["degenerate_prompts"] == [p["id"] for p in on_disk["per_prompt"] if p["degenerate"]]
    # This drafter is random (untrained too): the verdict is computed, whatever it is, naming the drafter.
    from aerie.benchmark.gate import Gate, judge

    verdict = judge(on_disk, Gate(min_speedup=0.0))
    assert list(verdict["drafters"]) == ["demo"] and set(verdict["drafters"]["demo"]["sets"]) == {"bench"}


def test_run_benchmark_reports_a_divergence(bench_files, tmp_path, monkeypatch):
    """A speculative output that differs from greedy is flagged, located and given the target's margin."""
    import aerie.benchmark.run as run_mod

    real = run_mod.speculative_generate

    def corrupted(*args, **kwargs):
        res = real(*args, **kwargs)
        res.tokens[-1] = (res.tokens[-1] + 1) % VOCAB
        return res

    monkeypatch.setattr(run_mod, "speculative_generate", corrupted)
    report = _bench(bench_files, tmp_path / "bad.json")
    assert report["lossless"] is False
    for p in report["per_prompt"]:
        for info in p["methods"].values():
            assert info["lossless"] is False and info["first_mismatch"] == p["generated_tokens"] - 1
            assert info["mismatch_logit_gap"] >= 0
    # Every divergence, per method and prompt, with the target's margin there: what the gate's lossless check reads.
    assert report["backend"] == "inprocess"
    divs = {(d["method"], d["id"]): d for d in report["divergences"]}
    assert set(divs) == {(m, p["id"]) for p in report["per_prompt"] for m in p["methods"]}
    for p in report["per_prompt"]:
        for m, info in p["methods"].items():
            d = divs[(m, p["id"])]
            assert (d["first_diff"], d["logit_gap"]) == (info["first_mismatch"], info["mismatch_logit_gap"])
    from aerie.benchmark.gate import Gate, gate_failures

    # The corrupted last token is no tie: strict and tolerant gates both call it a loss, naming where.
    for gate in (Gate(min_speedup=0, must_beat_references=False), Gate(0, False, None, 1e-9)):
        (msg,) = gate_failures(report, gate)["demo"]
        assert "differ from the baseline's greedy output, not at a near-tie" in msg and "from token" in msg
    # A tolerance above every measured gap accepts them as near-ties (the gate reads the same figures).
    top = max(d["logit_gap"] for d in report["divergences"])
    assert gate_failures(report, Gate(0, False, None, top)) == {"demo": []}


def test_run_benchmark_measures_every_trained_drafter_of_any_kind_beside_references(bench_files, tmp_path):
    """Two trained drafters (EAGLE-3 and DFlash) and references of both kinds, in one run on the same prompts, per
    set: each trained drafter through its kind at its width (the DFlash block's 5 drafts, the chain's 3), each with
    its untrained twin named after it; a reference folder read by its kind; the trained EAGLE-3 drafter's own folder
    as a reference ties it exactly (same greedy drafts), which the gate calls a loss per set - for that drafter only."""
    import shutil

    from aerie.benchmark.gate import Gate, judge
    from aerie.benchmark.run import run_benchmark
    from aerie.benchmark.settings import BenchRun, TargetLoad

    other = _tiny_dflash_folder(_tiny_llama(seed=3), tmp_path / "published", seed=9)
    second = tmp_path / "results" / "gsm8k" / "prompts" / "bench.jsonl"
    second.parent.mkdir(parents=True)
    write_prompts(second, ["add 4 and 5", "sort 9 8"], dataset="gsm8k")
    shutil.copy(bench_files / "bench.jsonl", tmp_path / "chat.jsonl")
    same = str(bench_files / "drafter")
    threads_before = torch.get_num_threads()
    try:
        report = run_benchmark(
            TargetLoad(bench_files / "target", "cpu", "float32"),
            {"demo-eagle3": bench_files / "drafter", "demo-dflash": bench_files / "dflash"},
            [tmp_path / "chat.jsonl", second],
            tmp_path / "out.json",
            BenchRun(
                max_new_tokens=10,
                num_draft_steps=3,
                warmup=0,
                threads=1,
                max_prompts=2,  # per set
                references=("untrained", "ngram", "published", same),
            ),
            reference_drafters={"published": other, same: Path(same)},
        )
    finally:
        torch.set_num_threads(threads_before)
    methods = report["methods"]
    assert list(methods) == [
        "demo-eagle3",
        "demo-dflash",
        "untrained:demo-eagle3",
        "untrained:demo-dflash",
        "ngram",
        "published",
        same,
    ]
    described = {m: (v["role"], v["kind"], v["draft_tokens"], v["twin_of"]) for m, v in methods.items()}
    assert described == {
        "demo-eagle3": ("trained", "eagle3", 3, None),
        "demo-dflash": ("trained", "dflash", 5, None),
        "untrained:demo-eagle3": ("untrained", "eagle3", 3, "demo-eagle3"),
        "untrained:demo-dflash": ("untrained", "dflash", 5, "demo-dflash"),
        "ngram": ("ngram", None, 3, None),
        "published": ("drafter", "dflash", 5, None),
        same: ("drafter", "eagle3", 3, None),
    }
    assert methods["published"]["folder"] == str(other)
    assert {n: (d["kind"], d["draft_tokens"], d["layer_ids"]) for n, d in report["drafters"].items()} == {
        "demo-eagle3": ("eagle3", 3, AUX_IDS),
        "demo-dflash": ("dflash", 5, [1, 3]),
    }
    assert all(len(v["acceptance_per_position"]) == v["draft_tokens"] for v in methods.values())
    assert report["lossless"] is True  # every method, both kinds, decodes losslessly
    assert list(report["sets"]) == ["chat", "gsm8k"] and report["prompts"] == 4
    for table in report["sets"].values():
        assert table["prompts"] == 2 and set(table["methods"]) == set(methods)
        mine, twin = table["methods"]["demo-eagle3"], table["methods"][same]
        assert twin["acceptance_length"] == mine["acceptance_length"] and twin["verify_steps"] == mine["verify_steps"]
    assert {p["set"] for p in report["per_prompt"]} == {"chat", "gsm8k"}
    verdict = judge(report, Gate(min_speedup=0.0, beat_references_on=("acceptance_length",)))
    accept = {s: report["sets"][s]["methods"]["demo-eagle3"]["acceptance_length"] for s in report["sets"]}
    ties = [f for f in verdict["drafters"]["demo-eagle3"]["failures"] if same in f]
    assert ties == [
        f"set {s}: demo-eagle3's acceptance length {accept[s]:.3f} does not beat reference {same}'s {accept[s]:.3f}"
        for s in ("chat", "gsm8k")
    ]
    # The DFlash drafter is not judged against the EAGLE-3 folders (another width) nor its sibling's twin.
    dflash_refs = {x["reference"] for s in verdict["drafters"]["demo-dflash"]["sets"].values() for x in s["losses"]}
    assert not dflash_refs & {same, "demo-eagle3", "untrained:demo-eagle3", "ngram"}


def test_a_warm_started_drafters_untrained_twin_is_its_start_folder(bench_files, tmp_path):
    """ "untrained" is the drafter as its training started: for a warm start, the drafter.init folder its config.json
    records (train_config.init, or init when no epoch beat the start), not a fresh init. The twin drafts exactly as
    that folder does (same acceptance per set as the folder named as a reference); a drafter trained from scratch
    keeps the fresh-init twin (no folder)."""
    import json
    import shutil

    from aerie.benchmark.methods import bench_methods
    from aerie.benchmark.run import run_benchmark
    from aerie.benchmark.settings import BenchRun, TargetLoad

    start = _tiny_dflash_folder(_tiny_llama(seed=3), tmp_path / "start", seed=9)
    trained = tmp_path / "trained"
    shutil.copytree(bench_files / "dflash", trained)
    config = json.loads((trained / "config.json").read_text())
    config["aerie"] = {**(config.get("aerie") or {}), "train_config": {"init": str(start), "kind": "dflash"}}
    (trained / "config.json").write_text(json.dumps(config))
    # the EAGLE-3 form of an export of the start itself (epoch 0): init at the top of the aerie block
    eagle3 = tmp_path / "eagle3"
    shutil.copytree(bench_files / "drafter", eagle3)
    config = json.loads((eagle3 / "config.json").read_text())
    config["aerie"] = {**(config.get("aerie") or {}), "epoch": 0, "init": str(bench_files / "drafter")}
    (eagle3 / "config.json").write_text(json.dumps(config))
    planned = bench_methods(
        {"a": eagle3, "b": bench_files / "drafter"}, ["untrained"], {}, num_draft_steps=3, ngram_draft_tokens=3
    )
    assert planned["untrained:a"].folder == bench_files / "drafter" and planned["untrained:b"].folder is None
    config["aerie"]["init"] = str(tmp_path / "gone")
    (eagle3 / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="was warm-started from drafter.init"):
        bench_methods({"a": eagle3}, ["untrained"], {}, num_draft_steps=3, ngram_draft_tokens=3)

    threads_before = torch.get_num_threads()
    try:
        report = run_benchmark(
            TargetLoad(bench_files / "target", "cpu", "float32"),
            {"demo-dflash": trained},
            [bench_files / "bench.jsonl"],
            tmp_path / "out.json",
            BenchRun(
                max_new_tokens=10,
                num_draft_steps=3,
                warmup=0,
                threads=1,
                max_prompts=3,
                references=("untrained", "published"),
            ),
            reference_drafters={"published": start},
        )
    finally:
        torch.set_num_threads(threads_before)
    twin = report["methods"]["untrained"]
    assert (twin["role"], twin["folder"], twin["twin_of"]) == ("untrained", str(start), "demo-dflash")
    for table in report["sets"].values():
        mine, published = table["methods"]["untrained"], table["methods"]["published"]
        assert mine["acceptance_length"] == published["acceptance_length"], table["methods"]
        assert mine["verify_steps"] == published["verify_steps"]
    # the twin's weights are the start folder's, not a fresh init of the trained drafter's shape
    from transformers import AutoModelForCausalLM

    from aerie.benchmark.run import load_methods
    from aerie.drafter_kinds.dflash.training import load_for_bench

    target = AutoModelForCausalLM.from_pretrained(bench_files / "target")
    planned = bench_methods({"demo-dflash": trained}, ["untrained"], {}, num_draft_steps=3, ngram_draft_tokens=3)
    loaded = load_methods(target, bench_files / "target", planned, torch.device("cpu"))
    twin_fc = loaded.proposers["untrained"].drafter.fc.weight
    assert torch.equal(twin_fc, load_for_bench(target, bench_files / "target", start, torch.device("cpu")).fc.weight)
    assert not torch.equal(twin_fc, loaded.proposers["demo-dflash"].drafter.fc.weight)
