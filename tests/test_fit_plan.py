"""The fit plan (aerie.preview.fit, issue 22 item 4): every GPU job's memory per GPU against the host's, before a job
runs.

The Kimi config fits its 8 H200s (every GPU job); a drafter window of 131,072 tokens without a token budget is
refused by the dry run, naming the setting; an in-process benchmark of Kimi's 554 GB fits 8 x 141 GiB only spread
over all 8 (int4 as stored) and is refused on fewer, or loaded as bf16 (~2 TB), naming ``bench.backend: sglang``.
The estimates against measured peaks: tests/test_pipeline_e2e.py (demo) and tests/test_kimi_rehearsal.py.
"""

from __future__ import annotations

import copy
import json
import stat
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, snakemake

from aerie.plan.config_file import ConfigSources
from aerie.plan.resolve import validate_config
from aerie.preview.fit import GIB, decoder_parameters, fit_plan, host_gpu_memory, target_facts

KIMI = REPO / "config" / "kimi-k2.5.yaml"


def kimi_config(**changes) -> dict:
    """config/kimi-k2.5.yaml as the Snakefile validates it (schema defaults filled), with ``changes`` applied
    (``"section.key": value``)."""
    config = yaml.safe_load(KIMI.read_text())
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        config.setdefault(section, {})[key] = value
    validate_config(config, ConfigSources.read([str(KIMI)]))
    return config


def jobs(plan) -> dict:
    return {j.rule: j for j in plan.jobs}


def test_the_kimi_config_fits_every_gpu_job_at_141_gib() -> None:
    config = kimi_config()
    assert config["resources"]["gpu_memory_gib"] == 141
    plan = fit_plan(config, nvidia_smi=None)
    assert plan.gpu_bytes == 141 * GIB and not plan.failures(), plan.text()
    fits = jobs(plan)
    # responses go to OpenRouter: no GPU job; one training job per drafter (EAGLE-3 and DFlash)
    assert set(fits) == {"hidden", "drafter kimi-k2.5-eagle3", "drafter kimi-k2.5-dflash", "bench"}
    for job in fits.values():
        assert job.fits(plan.gpu_bytes) and 0 < job.total < 141 * GIB and job.gpus == 8, job.line(plan.gpu_bytes)
    # Capture: SGLang's static share on GPU 0 holds the weights / 8, aerie's lm_head copy and a 32k sequence's KV.
    hidden = fits["hidden"]
    assert "GPU 0 (SGLang rank 0 + aerie's lm_head copy)" in hidden.where
    assert "lm_head copy for the top-k targets: [163840, 7168] x 2 bytes = 2.35 GB" in " ".join(hidden.notes)
    assert "weights / TP 64.5 GiB" in " ".join(hidden.notes)
    # Training: the estimate aerie.drafter_kinds.eagle3.memory makes for the shipped settings, per GPU (a replica each).
    assert fits["drafter kimi-k2.5-eagle3"].parts["activations"] > 10 * GIB
    # DFlash (z-lab's 6 layers, ~3.48B parameters): fp32 weights, gradients and AdamW ~52 GiB a replica, stated
    dflash = fits["drafter kimi-k2.5-dflash"]
    assert 48 * GIB < dflash.parts["parameters"] * 4 < 56 * GIB and "3.48B trainable parameters" in " ".join(
        dflash.notes
    )
    text = plan.text()
    assert text.startswith("aerie fit plan: 141.0 GiB per GPU (resources.gpu_memory_gib)")
    assert text.count(": fits, ") == 4


def test_a_131072_token_window_without_a_token_budget_is_refused_by_the_dry_run(workdir: Path) -> None:
    config = kimi_config(**{"drafter.max_seq_len": 131072, "drafter.max_batch_tokens": 0, "drafter.batch_size": 4})
    plan = fit_plan(config, nvidia_smi=None)
    assert "drafter kimi-k2.5-eagle3" in [j.rule for j in plan.failures()]
    assert "drafter.max_batch_tokens" in plan.error() and "does not fit 141.0 GiB" in plan.error()
    # Through Snakemake: the dry run stops at parse time, before any job (and any dollar), naming the setting.
    raw = yaml.safe_load(KIMI.read_text())
    raw["drafter"].update(max_seq_len=131072, max_batch_tokens=0, batch_size=4)
    raw["target"]["config_json"] = str(REPO / raw["target"]["config_json"])
    for ds in raw["datasets"].values():  # local prompt files: the named Hub datasets are not cached here
        if ds["source"]["kind"] == "recorded":
            continue  # optional: absent here, no shard
        path = workdir / "prompts.jsonl"
        path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"q {i}"}) + "\n" for i in range(3)))
        ds["source"] = {"kind": "jsonl", "path": str(path), "id_field": "id"}
    (workdir / "kimi.yaml").write_text(yaml.safe_dump(raw))
    proc = snakemake(workdir, "-n", "--configfile", str(workdir / "kimi.yaml"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "the fit plan refuses this run: rule drafter" in out and "set drafter.max_batch_tokens" in out, out
    assert "Job stats" not in out  # refused while parsing: nothing was scheduled


def test_an_inprocess_benchmark_of_kimi_fits_8_h200s_spread_and_is_refused_otherwise() -> None:
    """554 GB (516 GiB) as stored - int4 experts stay packed - spread over 8 x 141 GiB: ~65 GiB of weights per GPU
    beside the KV cache and the drafters. On 4 GPUs it exceeds what placement allows for weights (85% of each), and
    the same model at bf16 (~1.03T parameters x 2 bytes) fits no 8-GPU host: both refused naming the fix."""
    plan = fit_plan(kimi_config(**{"bench.backend": "inprocess"}), nvidia_smi=None)
    bench = jobs(plan)["bench"]
    assert bench.fits(plan.gpu_bytes) is True, bench.line(plan.gpu_bytes)
    assert "GPU 0 of 8 (device_map" in bench.where
    assert 64 * GIB < bench.parts["target weights"] < 65 * GIB
    for change in ({"resources.bench_gpus": 4}, {"target.weights_gib": 1.03e12 * 2 / GIB}):
        plan = fit_plan(kimi_config(**{"bench.backend": "inprocess", **change}), nvidia_smi=None)
        failed = {j.rule: j for j in plan.failures()}  # ~2 TB does not fit SGLang's capture on 8 GPUs either
        assert "set bench.backend: sglang" in failed["bench"].refusal, change
        assert "rule bench:" in plan.error() and "bench.backend: sglang" in plan.error()


def test_the_sglang_static_share_must_hold_the_weights_the_lm_head_copy_and_a_sequence() -> None:
    # 80 GiB GPUs: the static share (0.85) holds 64.5 GiB of weights + the 3.4 GB copy, not a 32k sequence's KV.
    plan = fit_plan(kimi_config(**{"resources.gpu_memory_gib": 80}), nvidia_smi=None)
    refused = {j.rule: j.refusal for j in plan.failures()}
    assert "raise hidden.sglang.mem_fraction_static or hidden.sglang.tp_size" in refused["hidden"]
    # The copy sits on the GPU target.device names, else SGLang's rank 0.
    plan = fit_plan(kimi_config(**{"target.device": "cuda:3"}), nvidia_smi=None)
    assert jobs(plan)["hidden"].where.startswith("GPU 3 ")
    # TP wider than the job's GPUs cannot start at all.
    config = kimi_config(**{"resources.hidden_gpus": 4})
    assert "hidden.sglang.tp_size 8 needs 8 GPUs" in jobs(fit_plan(config, nvidia_smi=None))["hidden"].refusal


def test_gpu_memory_is_the_setting_else_nvidia_smi_else_unknown(tmp_path: Path) -> None:
    config = kimi_config()
    del config["resources"]["gpu_memory_gib"]
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '143771\\n81559\\n'\n")  # a mixed host: the smallest GPU counts
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert host_gpu_memory(config, str(fake)) == (81559 * 2**20, "nvidia-smi: the smallest of 2 GPU(s)")
    assert host_gpu_memory(config, None) == (None, "")
    # Unknown (a CPU-only machine): printed for the job's own device, not checked, and the text says what to set.
    plan = fit_plan(config, nvidia_smi=None)
    assert plan.gpu_bytes is None and not plan.failures()
    assert "set resources.gpu_memory_gib" in plan.text() and "DOES NOT FIT" not in plan.text()


def tiny_texts() -> dict[str, dict]:
    llama = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    llama |= dict(intermediate_size=48, vocab_size=100, tie_word_embeddings=False)
    mla = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, vocab_size=100)
    mla |= dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2)
    mla |= dict(n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8)
    mla |= dict(qk_rope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1, tie_word_embeddings=False)
    return {"llama": llama, "deepseek_v3": mla}


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_the_parameter_count_is_the_models(kind: str) -> None:
    """A pipeline-built target is planned before it exists: its weights are its parameter count x 4 bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    text = tiny_texts()[kind]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **text))
    assert decoder_parameters(text) == sum(p.numel() for p in model.parameters())


def test_weights_come_from_the_safetensors_headers_and_scale_to_the_loading_dtype(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **tiny_texts()["llama"]}))
    save_file({"a": torch.zeros(64, 32, dtype=torch.bfloat16)}, folder / "model-1.safetensors")
    save_file({"b": torch.zeros(32, dtype=torch.bfloat16)}, folder / "model-2.safetensors")
    config = kimi_config()
    config["target"] = {"path": str(folder), "weights_gib": 999}  # the folder wins over the declared size
    facts = target_facts(config)
    assert facts.weights == 2 * (64 * 32 + 32) and facts.stored_dtype_bytes == 2
    assert facts.loaded_weights(4) == 2 * facts.weights and facts.config_from.endswith("config.json")
    # Packed integer tensors (int4 experts) are taken as stored, whatever the loading dtype.
    save_file({"packed": torch.zeros(16, dtype=torch.int32)}, folder / "model-3.safetensors")
    facts = target_facts(config)
    assert facts.stored_dtype_bytes is None and facts.loaded_weights(4) == facts.weights


def test_the_fit_plan_reads_no_weights_and_imports_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, yaml\nfrom aerie.plan.config_file import ConfigSources\n"
        "from aerie.plan.resolve import validate_config\n"
        "from aerie.preview.fit import fit_plan\n"
        f"c = yaml.safe_load(open({str(KIMI)!r}))\nvalidate_config(c, ConfigSources.read([{str(KIMI)!r}]))\n"
        "print(fit_plan(c, nvidia_smi=None).text())\n"
        "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("[]") and "aerie fit plan" in proc.stdout


def test_the_in_process_responses_fit_holds_a_batch_of_sequences() -> None:
    """responses.backend hf generates responses.batch_size sequences at once: the KV cache, the logits and the
    forward grow with the batch, the weights do not (issue 30 item 7: an estimate that ignored the batch size
    passed every test)."""
    one, four = (
        jobs(fit_plan(kimi_config(**{"responses.backend": "hf", "responses.batch_size": b}), nvidia_smi=None))[
            "responses"
        ]
        for b in (1, 4)
    )
    for part in ("KV cache", "logits", "forward"):
        assert four.parts[part] == 4 * one.parts[part] > 0, part
    assert four.parts["target weights"] == one.parts["target weights"]
    assert four.total > one.total and "4 sequences of 2,048 prompt" in " ".join(four.notes)


def test_a_config_copy_is_not_changed() -> None:
    config = kimi_config()
    before = copy.deepcopy(config)
    fit_plan(config, nvidia_smi=None)
    assert config == before


def test_the_inprocess_bench_holds_a_drafter_per_reference_and_its_sets_bound_the_sequence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each drafter reference is one more drafter (and embeddings copy) beside the trained one: a folder not here
    yet is sized as the trained drafter; prompt lookup holds nothing. A bench set's prompts (HumanEval's are long)
    bound the sequence as the datasets' held-out prompts do."""
    from aerie.preview.fit import longest_prompt

    monkeypatch.chdir(tmp_path)
    (tmp_path / "long.jsonl").write_text(json.dumps({"question": "x" * 40_000}) + "\n")
    refs = ["untrained", "ngram", "lightseekorg/kimi-k2.5-eagle3"]
    base = {"bench.backend": "inprocess", "bench.references": refs}
    bench = jobs(fit_plan(kimi_config(**base), nvidia_smi=None))["bench"]
    held = {k for k in bench.parts if "drafter" in k or "reference" in k or "untrained" in k}
    drafters = ("kimi-k2.5-eagle3", "kimi-k2.5-dflash")
    assert held == {
        *(f"trained drafter {d}" for d in drafters),
        *(f"untrained {d}" for d in drafters),
        "reference lightseekorg/kimi-k2.5-eagle3",
    }, bench.parts
    eagle3 = bench.parts["trained drafter kimi-k2.5-eagle3"]
    assert bench.parts["reference lightseekorg/kimi-k2.5-eagle3"] == eagle3  # not here: sized as the first drafter
    # DFlash reads the target's own embeddings in process (EAGLE-3 holds a copy): ~3.48B bf16 parameters alone
    assert 6.4 * GIB < bench.parts["trained drafter kimi-k2.5-dflash"] < 6.6 * GIB
    alone = jobs(fit_plan(kimi_config(**{**base, "bench.references": ["ngram"]}), nvidia_smi=None))["bench"]
    untrained = sum(bench.parts[f"untrained {d}"] for d in drafters)
    assert alone.total == bench.total - untrained - eagle3
    sets = {"long": {"source": {"kind": "jsonl", "path": "long.jsonl", "text_field": "question"}}}
    assert longest_prompt(kimi_config(**{**base, "bench.sets": {}}), {}) == 1
    assert longest_prompt(kimi_config(**{**base, "bench.sets": sets}), {}) >= 10_000
