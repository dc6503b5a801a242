"""The Kimi rehearsal: config/kimi-rehearsal.yaml end to end, offline, on a Kimi-shaped toy target.

config/kimi-k2.5.yaml's job - five datasets with output-token quotas and two recorded ones, OpenRouter with a dollar
budget and provider routing, DeepSeek aux ids, the compact hidden layout, two drafters from the same data (a Llama-kind
EAGLE-3 and a DFlash, each warm-started from a "published" folder of its kind in another tool's spelling, one capture
for both), replay, the traffic mix, the benchmark gate per drafter - run from the cost preview to the benchmark JSON
and the report. OpenRouter is the bundled emulator in upstream mode in front of
`transformers serve` running the rehearsal target, so the text is the target's own in OpenRouter's envelope
(usage, cost, provider, injected faults). Only paths, sizes and counts may differ from kimi-k2.5.yaml.

The end-to-end part (marked `slow`, ~15 minutes on 2 cores) runs by default, CI included. Its sampling is
Kimi's (temperature 1.0, top_p 0.95) but seeded per request by the server (`aerie.target_model.serve`'s
--default-request-seed), so on one machine every run sees the same answers, and a failure reruns as it failed.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, snakemake

from aerie.sources.synthetic import generate_prompts
from aerie.targets.demo.tokenizer import SYSTEM_PROMPTS

KIMI = REPO / "config" / "kimi-k2.5.yaml"
REHEARSAL = REPO / "config" / "kimi-rehearsal.yaml"

# Every key of kimi-rehearsal.yaml that may differ from kimi-k2.5.yaml, and why. Anything else must be equal.
ALLOWED_DIFFERENCES = {
    "run": "the run's name (results/drafter/{run}/, results/bench/{run}.json)",
    "target.path": "path: the toy target's folder",
    "target.rehearsal": "the pipeline builds the toy target (Kimi K2.5's folder is downloaded)",
    "target.rehearsal.*": "the toy target's build settings",
    "target.num_hidden_layers": "size of the toy target",
    "target.hidden_size": "size of the toy target",
    "target.device": "CI has no GPU",
    "target.dtype": "CPU runs in fp32",
    "target.config_json": "the real target's dimensions for the fit plan before its folder is here (the toy target's "
    "come from target.rehearsal)",
    "target.weights_gib": "size: the real target's weights for the fit plan before its folder is here",
    "datasets.*.source.name": "path: a Hub dataset becomes a local file of the same shape",
    "datasets.*.source.data_files": "path: the local prompt file",
    "datasets.*.source.split": "path: a local file has one split",
    "datasets.*.source.config": "path: a local file has no Hub config",
    "datasets.*.shard_size": "count",
    "datasets.*.bench_prompts": "count",
    "datasets.*.max_output_tokens": "size: quotas scaled to toy responses (one reached on purpose, see CAPPED)",
    "datasets.*.expected_output_tokens": "size: the toy target's response length",
    "datasets.*.max_samples": "count: of the recorded datasets (the test writes their files from the toy's answers)",
    "responses.base_url": "path: the emulator on loopback",
    "responses.max_new_tokens": "size",
    "responses.concurrency": "count",
    "responses.budget_usd": "size: dollars scaled to toy responses",
    "tokens.max_seq_len": "size",
    "hidden.aux_layer_ids": "SGLang's default ids for the toy target's depth ([1, L//2-1, L-4], as [1, 29, 57] for 61)",
    "hidden.backend": "CI has no GPU: transformers hooks instead of SGLang's engine",
    "hidden.batch_tokens": "size",
    "hidden.min_next_token_in_topk": "size: the toy target's top 32 hold ~89 % of its probability (Kimi's nearly all), "
    "so its aligned sampled shards measure 0.898-0.907: 0.85, still far above a misaligned shard",
    "drafters.eagle3.ttt_steps": "count",
    "drafter.max_seq_len": "size",
    "drafter.batch_size": "count: the toy's ~35 short samples train at the schema's default batch",
    "drafter.max_batch_tokens": "size: Kimi's 32,768-token budget is about the H200; the toy's batches are a few "
    "thousand tokens (the default budget, batch_size x max_seq_len)",
    "drafter.learning_rate": "scales with the data size: a few hundred samples need 1e-3 (the demo's finding)",
    "bench.backend": "CI has no GPU: aerie decodes in-process instead of SGLang serving (same report and gate)",
    "bench.max_new_tokens": "count",
    "bench.max_prompts": "count",
    "bench.gate": "a drafter of the toy target costs about what the target does on a CPU; the speed gate is the "
    "demo's to prove (must_beat_references and the lossless check are on, as for Kimi)",
    "bench.gate.min_speedup": "(as bench.gate)",
    "bench.gate.beat_references_on": "(as bench.gate: each trained drafter must beat its references' acceptance - "
    "those of its draft width - on the traffic mix without a loss on a set beyond its spread; speed on a CPU toy says "
    "little)",
    "bench.sets.*.source.*": "path: a Hub (or packaged) benchmark set becomes a local file of the same shape",
    "bench.references": "paths: the published drafters become the warm starts' folders the test writes (Kimi: three "
    "Hub ids - the EAGLE-3 MLA sibling has no toy twin); in-process there is no SGLang NGRAM at its own width, and the "
    "untrained twins are in-process only",
    "vocab.draft_vocab_size": "size: the toy answers' distinct tokens",
    "drafter.epochs": "count: ~35 toy samples need 20 passes to beat prompt lookup (~2 CPU minutes for EAGLE-3, ~7 "
    "for DFlash)",
    "drafters.*.init": "path: each published drafter is a folder the test writes (Kimi's are Hub ids in the HF cache)",
    "drafters.eagle3.num_key_value_heads": "size: the published drafter's shape on the toy target (all its heads, as "
    "Kimi's)",
    "drafters.eagle3.intermediate_size": "size: the published shape on the toy target (2/3 of the target's, as Kimi's)",
    "drafters.dflash.num_anchors": "count: blocks per sequence, one per ~7-10 tokens of the toy's ~30-90-token "
    "answers as 512 for Kimi's ~3,500 (32 took the CPU ~4x longer: each drafted slot is projected on all 163,840 ids)",
    "drafters.dflash.epochs": "count: on the toy's ~35 samples the DFlash drafter's held-out acceptance plateaus from "
    "epoch 6 (1.75; 2.0 at epoch 20 for 12 more CPU epochs of ~13 s)",
    "drafters.dflash.num_layers": "count: the toy folder's 2 draft layers, stated (Kimi's 6 is the default, left "
    "derived): before the folder is here the plan takes SGLang's default ids for the default 6 layers, which on the "
    "toy's 8 target layers do not ascend ([1, 2, 3, 3, 4, 5]) and the parse refuses",
    "resources.*": "count: CI has no GPU",
}
# The dataset whose output-token quota the rehearsal reaches. It is one shard whose quota is concurrency x
# expected_output_tokens, so the first round of requests is admitted whole and the next one is refused: the shard
# completes with the samples of that round (up to `concurrency`: one whose injected fault comes after the quota stop
# is not retried) and the rest not requested, whatever the lengths sampled. (Split in shards, a shard started near
# the quota may hold a single sample, and one truncated answer would leave it empty: the drop gate fails it.)
CAPPED = "code"
# The datasets of the target's own answers (source.kind: recorded, $0): the test writes their files once the toy
# target is served (ShareGPT with <think> inline; a gateway's request/response log), from its own generations.
RECORDED = ["kimi_mtp", "own_traffic"]
RECORDED_ANSWERS = 6  # per recorded file; max_samples 4 of them (a seeded sample, one shard)
# Requests without a seed are sampled by the rehearsal's server as if they carried this one (per request, mixed
# with the prompt: aerie.target_model.serve.honour_request_sampling), so the answers do not depend on timing or retries.
SERVER_SEED = 11
# Cores for the rehearsal's Snakemake runs: CI has 2 quiet cores. On a shared machine, set 1: two torch threads
# that wait for a busy core run many times slower than one (shared/notes/demo-target.md).
CORES = os.environ.get("AERIE_REHEARSAL_CORES", "2")


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: node}


def test_only_paths_sizes_and_counts_differ_from_the_kimi_config() -> None:
    kimi, rehearsal = (flatten(yaml.safe_load(p.read_text())) for p in (KIMI, REHEARSAL))
    differing = sorted(
        k for k in kimi.keys() | rehearsal.keys() if kimi.get(k, "<absent>") != rehearsal.get(k, "<absent>")
    )
    unexplained = [k for k in differing if not any(fnmatch.fnmatchcase(k, p) for p in ALLOWED_DIFFERENCES)]
    assert not unexplained, "keys that differ without a reason: " + ", ".join(
        f"{k}: {kimi.get(k, '<absent>')!r} -> {rehearsal.get(k, '<absent>')!r}" for k in unexplained
    )
    # The same six prompt datasets and two recorded ones, read with the same shapes; the same routing, sampling and
    # serving settings.
    k_cfg, r_cfg = (yaml.safe_load(p.read_text()) for p in (KIMI, REHEARSAL))
    assert list(k_cfg["datasets"]) == list(r_cfg["datasets"]) and len(r_cfg["datasets"]) == 7
    assert list(k_cfg["bench"]["sets"]) == list(r_cfg["bench"]["sets"]) == ["mtbench", "gsm8k", "humaneval"]
    assert RECORDED == [n for n, d in r_cfg["datasets"].items() if d["source"]["kind"] == "recorded"]
    assert r_cfg["responses"]["backend"] == "openrouter" and r_cfg["hidden"]["layout"] == "compact"
    assert r_cfg["hidden"]["aux_layer_ids"][0] == 1  # the DeepSeek-family rule
    assert r_cfg["responses"]["budget_usd"] > 0
    assert all("max_output_tokens" in d for n, d in r_cfg["datasets"].items() if n not in RECORDED)


# ------------------------------------------------------------------------------------------------------------
# end to end


def write_prompt_files(folder: Path) -> dict[str, int]:
    """Prompt files in the shapes of kimi-k2.5.yaml's Hub datasets, with the task language as content."""
    folder.mkdir(parents=True, exist_ok=True)

    def users(family: str, n: int, seed: int) -> list[str]:
        return [p["user"] for p in generate_prompts([family], n, seed)]

    def mixed_users(n: int, seed: int) -> list[str]:
        return [p["user"] for p in generate_prompts(["arith", "lists", "code"], n, seed)]

    mixed = mixed_users(8, 101)
    # Hermes-style rows (a system turn, then the user turn). The system text is one the target was trained with:
    # a long tool list in a system turn is outside what a few CPU minutes teach it (it loops), and the tool
    # declarations themselves are rendered and checked in tests/test_rehearsal_target.py.
    tools_system = SYSTEM_PROMPTS[0]
    rows = {
        "sharegpt.jsonl": [
            {
                "id": f"sg{i}",
                "conversations": [{"from": "human", "value": u}, {"from": "gpt", "value": "(the dataset's answer)"}],
            }
            for i, u in enumerate(mixed)
        ],
        "ultrachat.jsonl": [
            {
                "prompt_id": f"uc{i}",
                "messages": [{"role": "user", "content": u}, {"role": "assistant", "content": "(answer)"}],
            }
            for i, u in enumerate(mixed_users(8, 102))
        ],
        "code.jsonl": [{"problem": u, "solution": "(solution)"} for u in users("code", 8, 103)],
        "gsm8k_train.jsonl": [{"question": u, "answer": "(answer)"} for u in users("arith", 8, 104)],
        "tool_use.jsonl": [
            {
                "id": f"tu{i}",
                "conversations": [{"from": "system", "value": tools_system}, {"from": "human", "value": u}],
            }
            for i, u in enumerate(mixed_users(8, 105))
        ],
        "mt_bench.jsonl": [
            {"prompt_id": i, "prompt": [u, "Now explain the first step."]} for i, u in enumerate(users("arith", 4, 106))
        ],
        # bench.sets: GSM8K's test split and HumanEval's shapes (question/answer; task_id/prompt), the task language.
        "gsm8k_test.jsonl": [{"question": u, "answer": "(answer)"} for u in users("arith", 4, 107)],
        "humaneval.jsonl": [{"task_id": f"HumanEval/{i}", "prompt": u} for i, u in enumerate(users("code", 4, 108))],
    }
    for name, items in rows.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in items))
    return {name: len(items) for name, items in rows.items()}


def write_recorded_answers(folder: Path, url: str, responses: dict) -> None:
    """The toy target's own answers, asked once through a fault-free emulator in front of its server, written as
    the public set ships them (ShareGPT, reasoning inline in <think>) and as a gateway logs them (request body,
    response body). Nothing of this is paid by the run: both datasets are recorded, $0."""
    import requests

    folder.mkdir(parents=True, exist_ok=True)
    # Seed 109, not the gsm8k set's 107: a bench prompt that is also a training prompt is left out of the benchmark.
    users = [p["user"] for p in generate_prompts(["arith", "lists"], 2 * RECORDED_ANSWERS, 109)]
    sharegpt, log = [], []
    for i, user in enumerate(users):
        body = {
            "model": responses["model"],
            "messages": [{"role": "user", "content": user}],
            "temperature": responses["temperature"],
            "top_p": responses["top_p"],
            "max_tokens": responses["max_new_tokens"],
        }
        resp = requests.post(
            f"{url}/chat/completions", json=body, headers={"Authorization": "Bearer rehearsal-key"}, timeout=600
        )
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        message = answer["choices"][0]["message"]
        if i % 2:
            log.append({"request": body, "response": answer})
        else:
            value = f"<think>{message.get('reasoning') or ''}</think>{message.get('content') or ''}"
            sharegpt.append(
                {"id": f"mtp{i}", "conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": value}]}
            )
    (folder / "kimi_mtp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sharegpt))
    (folder / "kimi-k2.5-gateway.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))


def preview_usd(workdir: Path, configfile: Path) -> float:
    """The pending dollars of the cost preview `snakemake -n` prints, unrounded: the same function
    (aerie.preview.money.cost_preview) on the config as the Snakefile validates it (schema defaults filled)."""
    from aerie.plan.config_file import ConfigSources
    from aerie.plan.resolve import api_run, check_config, plan_datasets, validate_config
    from aerie.preview.money import cost_preview

    config = yaml.safe_load(configfile.read_text())
    validate_config(config, ConfigSources.read([str(configfile)]))
    check_config(config)
    cwd = Path.cwd()
    os.chdir(workdir)  # prompt files and results/ are relative to the workflow's directory
    try:
        return cost_preview(api_run(config, plan_datasets(config)), Path("results")).pending_usd
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """Build the target with the pipeline, serve it behind the emulator, preview, run everything."""
    import requests

    from aerie.emulator import EmulatorSettings, parse_faults, serve_in_thread
    from aerie.target_model.serve import serve_on_loopback, transformers_serve_command

    workdir = tmp_path_factory.mktemp("kimi-rehearsal")
    write_prompt_files(workdir / "prompts")
    config = yaml.safe_load(REHEARSAL.read_text())
    configfile = workdir / "kimi-rehearsal.yaml"
    old_key = os.environ.get("OPENROUTER_API_KEY")
    os.environ["OPENROUTER_API_KEY"] = "rehearsal-key"  # the emulator takes any key; it is never written down
    faults = parse_faults(["429=0.05,500=0.03,200-error=0.02,torn=0.02,reset=0.02"])
    try:
        # The toy target is built first (a rehearsal-only step: Kimi K2.5's folder is downloaded). Every real run
        # prices its pending work at start, so an emulator answers then too; it has no upstream yet.
        with serve_in_thread(EmulatorSettings(faults=faults, fault_seed=11)) as emulator_url:
            config["responses"]["base_url"] = emulator_url
            # drafters.*.init's folders are written from the built target below; a real run refuses to start
            # without them
            build_config = {**config, "drafters": {k: without_init(d) for k, d in config["drafters"].items()}}
            configfile.write_text(yaml.safe_dump(build_config, sort_keys=False))
            # The target goes before --configfile, which takes several values. The timeouts only stop a hung run:
            # on 2 quiet cores the build takes ~5 minutes and the run ~5 more; a shared machine takes several times.
            build = snakemake(
                workdir, config["target"]["path"], "--cores", CORES, "--configfile", str(configfile), timeout=2400
            )
            assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
        target = workdir / config["target"]["path"]
        drafters = config["drafters"]
        published = {
            "eagle3": write_published_drafter(workdir / drafters["eagle3"]["init"], target, config),
            "dflash": write_published_dflash(workdir / drafters["dflash"]["init"], target, config),
        }
        with serve_on_loopback(
            lambda port: transformers_serve_command(
                str(target), port, trust_remote_code=True, default_request_seed=SERVER_SEED
            ),
            "/health",
            workdir / "results" / "logs" / "rehearsal_serve.log",
            env={"OMP_NUM_THREADS": CORES},  # the server's torch threads, as the jobs'
        ) as base:
            # From here on OpenRouter is the emulator in upstream mode: the target's own generations.
            upstream = EmulatorSettings(
                faults=faults,
                fault_seed=11,
                upstream_url=f"{base}/v1",
                upstream_model=str(target),
                upstream_tokenizer=str(target),
            )
            # The recorded datasets' files: the target's own answers, before the run's parse reads them (the build's
            # parse planned no shard of them: optional, absent).
            with serve_in_thread(dataclasses.replace(upstream, faults={})) as clean_url:
                write_recorded_answers(workdir / "prompts", clean_url, config["responses"])
            with serve_in_thread(upstream) as emulator_url:
                config["responses"]["base_url"] = emulator_url
                configfile.write_text(yaml.safe_dump(config, sort_keys=False))

                dry = snakemake(workdir, "-n", "--configfile", str(configfile))
                preview = dry.stdout + dry.stderr
                assert dry.returncode == 0, preview
                assert "aerie cost preview" in preview and "live" in preview.split("aerie cost preview", 1)[1][:200]
                for name in RECORDED:  # $0, with their token totals, planned beside the paid datasets
                    assert re.search(
                        rf"^  {name}\s+4 samples in 1 shards \(1 pending\), ~[\d,]+ prompt \+ ~[\d,]+ output "
                        r"tokens.*\$0\.00",
                        preview,
                        re.M,
                    ), preview
                pending = preview_usd(workdir, configfile)

                run = snakemake(workdir, "--cores", CORES, "--configfile", str(configfile), timeout=3600)
                assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-6000:]
                report = snakemake(workdir, "--configfile", str(configfile), "--report", "report.html", timeout=600)
                assert report.returncode == 0, report.stdout[-3000:] + report.stderr[-3000:]
                asked_again = ask_again(base, str(target), workdir / "results")
                emulator_stats = requests.get(f"{emulator_url}/emulator/stats", timeout=10).json()
    finally:
        if old_key is None:
            os.environ.pop("OPENROUTER_API_KEY", None)
        else:
            os.environ["OPENROUTER_API_KEY"] = old_key
    return {
        "workdir": workdir,
        "config": config,
        "published": published,
        "preview": preview,
        "pending_usd": pending,
        "stats": emulator_stats,
        "asked_again": asked_again,
    }


def without_init(section: dict) -> dict:
    return {k: v for k, v in section.items() if k != "init"}


def write_published_drafter(folder: Path, target: Path, config: dict) -> Path:
    """A "published" drafter for the toy target in another tool's spelling: config.json without aerie's block and
    with DeepSeek-style aux ids ([2, 4, 5]: SGLang serves them on Kimi's wrapper as the outputs [1, 3, 4]), no t2d
    (SGLang never reads it). Untrained but for lm_head and the final norm (the target's rows, as a publisher's start);
    its draft vocab: the toy tokenizer's BPE ranks and the first 32 special ids (Kimi's named ones among them)."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import load_file, save_file

    from aerie.drafter_kinds.eagle3.model import DrafterConfig, Eagle3Drafter
    from aerie.target_model.heads import read_target_heads

    heads = read_target_heads(target, ["embed", "norm", "lm_head"])
    size = config["vocab"]["draft_vocab_size"]
    ids = torch.tensor([*range(size - 32), *range(163584, 163584 + 32)])
    entry = config["drafters"]["eagle3"]
    shape = {k: entry[k] for k in ("attention", "num_key_value_heads", "head_dim", "intermediate_size")}
    cfg = DrafterConfig.from_target(SimpleNamespace(**heads.config), size, config["hidden"]["aux_layer_ids"], **shape)
    torch.manual_seed(5)
    drafter = Eagle3Drafter(cfg)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    drafter.set_vocab_maps(ids - torch.arange(size), t2d)
    with torch.no_grad():
        drafter.lm_head.weight.copy_(heads.lm_head[ids])
        drafter.norm.weight.copy_(heads.norm)
    drafter.save_pretrained(folder)
    written = json.loads((folder / "config.json").read_text())
    written.pop("aerie")
    written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    (folder / "config.json").write_text(json.dumps(written, indent=2))
    state = load_file(folder / "model.safetensors")
    del state["t2d"]
    save_file(state, str(folder / "model.safetensors"))
    return folder


DFLASH_BLOCK_SIZE = 8  # z-lab's Kimi-K2.5-DFlash's block


def write_published_dflash(folder: Path, target: Path, config: dict) -> Path:
    """A "published" DFlash drafter for the toy target in another tool's spelling, as z-lab's Kimi-K2.5-DFlash and
    tests/fixtures/dflash_folder are: no aerie block and no dflash_config (``mask_token_id`` and ``target_layer_ids``
    top-level), every tensor name with a ``model.`` prefix, bf16 weights sharded over two files named by
    model.safetensors.index.json, transformers-style extras. Its shape is what aerie sizes for the toy target
    (DFlashShape.from_target: the target's heads and MLP width, 128-wide heads as for an MLA target),
    ``drafters.dflash.num_layers`` layers reading SGLang's default target layers for the toy's depth ([1, 5]), block 8,
    the tokenizer's [UNK] as MASK (Kimi's 163838). Untrained (random, seed 6), as write_published_drafter's; checked
    against the toy target as the drafter job checks a warm start (check_dflash_folder, the MASK id never in text)."""
    import torch
    from safetensors.torch import save_file

    from aerie.drafter_kinds.dflash.folder import check_dflash_folder
    from aerie.drafter_kinds.dflash.model import DFlashDrafter
    from aerie.drafter_kinds.dflash.shape import DFlashShape, default_target_layer_ids
    from aerie.drafter_kinds.dflash.training import mask_token_check
    from aerie.target_model.config import read_text_config
    from aerie.target_model.markers import mask_token_id

    text = read_text_config(target)
    layers = config["drafters"]["dflash"]["num_layers"]
    shape = DFlashShape.from_target(
        text,
        num_layers=layers,
        block_size=DFLASH_BLOCK_SIZE,
        mask_token_id=mask_token_id(target),
        target_layer_ids=default_target_layer_ids(int(text["num_hidden_layers"]), layers),
    )
    torch.manual_seed(6)
    drafter = DFlashDrafter(shape)
    written = shape.to_sglang_config("bfloat16", {})
    written.pop("aerie")
    written.update(written.pop("dflash_config"))  # top-level, as SGLang also reads them
    written.update(
        auto_map={"AutoModel": "dflash.DFlashDraftModel"}, initializer_range=0.02, transformers_version="4.57.1"
    )
    weights = {f"model.{n}": t.detach().to(torch.bfloat16).contiguous() for n, t in drafter.state_dict().items()}
    folder.mkdir(parents=True, exist_ok=True)
    last = f"model.layers.{layers - 1}."
    shards = {
        "model-00001-of-00002.safetensors": [n for n in weights if not n.startswith(last)],
        "model-00002-of-00002.safetensors": [n for n in weights if n.startswith(last)],
    }
    weight_map = {}
    for file, names in shards.items():
        save_file({n: weights[n] for n in names}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    checked = check_dflash_folder(folder, text, mask_token_check(target))
    assert checked.shape == shape and not checked.warnings, checked
    return folder


def ask_again(base: str, target: str, results: Path) -> list[tuple[dict, dict]]:
    """Two journaled samples asked again, straight from the server, with the sampling parameters they were asked
    with: (journal record, the server's message) pairs."""
    import requests

    pairs = []
    for dataset in ("sharegpt", "math"):
        record = journal_records(results, dataset)[0]
        params = {k: record["params"][k] for k in ("temperature", "top_p", "max_tokens")}
        body = {"model": target, "messages": record["messages"], **params}
        resp = requests.post(f"{base}/v1/chat/completions", json=body, timeout=600)
        assert resp.status_code == 200, resp.text
        pairs.append((record, resp.json()["choices"][0]["message"]))
    return pairs


def journal_records(results: Path, dataset: str) -> list[dict]:
    records = []
    for journal in sorted((results / dataset / "responses").glob("shard-*.journal.jsonl")):
        records += [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]
    return records


@pytest.mark.slow
def test_preview_dollars_match_the_spend(rehearsal) -> None:
    results = rehearsal["workdir"] / "results"
    budget = rehearsal["config"]["responses"]["budget_usd"]
    pending = rehearsal["pending_usd"]
    assert 0 < pending <= budget, rehearsal["preview"]
    assert "OVER BUDGET" not in rehearsal["preview"]
    spent = sum(
        float(r.get("cost") or 0.0) for d in rehearsal["config"]["datasets"] for r in journal_records(results, d)
    )
    assert 0 < spent <= budget
    # The preview prices at the routed endpoint (live from the endpoints API) and caps the quota'd dataset;
    # what remains is the estimate of response lengths (expected_output_tokens) against the sampled ones.
    assert 0.5 * pending <= spent <= 1.5 * pending, (pending, spent)
    assert rehearsal["stats"]["charged_usd"] >= spent - 1e-9  # the provider billed at least what was journaled


@pytest.mark.slow
def test_responses_are_the_targets_own_text_in_openrouter_envelopes(rehearsal) -> None:
    results = rehearsal["workdir"] / "results"
    records = [r for d in ("sharegpt", "math") for r in journal_records(results, d)]
    assert records
    assert {r["provider"] for r in records} == {"Chutes"}  # sort: price among int4, fireworks ignored
    max_tokens = rehearsal["config"]["responses"]["max_new_tokens"]
    assert all(r["usage"]["completion_tokens"] <= max_tokens and r["cost"] > 0 for r in records)
    # The target's task language (reasoning before </think>, an answer after), not the emulator's words.
    structured = [r for r in records if r.get("reasoning") and re.search(r"\d", r["reasoning"])]
    assert len(structured) >= len(records) // 2, records[:2]
    outcomes = rehearsal["stats"]["outcomes"]
    assert sum(n for k, n in outcomes.items() if k != "ok") > 0, outcomes  # faults were injected and retried


@pytest.mark.slow
def test_the_quota_is_reached_and_the_dataset_completes(rehearsal) -> None:
    results = rehearsal["workdir"] / "results"
    config = rehearsal["config"]
    cap, responses = config["datasets"][CAPPED]["max_output_tokens"], config["responses"]
    prompts = sum(1 for _ in (rehearsal["workdir"] / config["datasets"][CAPPED]["source"]["data_files"]).open())
    records = journal_records(results, CAPPED)
    tokens = sum(r["usage"]["completion_tokens"] for r in records)
    # Overshoot bounded by the requests in flight; at least one prompt was never requested.
    assert 0 < len(records) < prompts and tokens <= cap + responses["concurrency"] * responses["max_new_tokens"]
    completions = sorted((results / CAPPED / "responses").glob("shard-*.completion.json"))
    assert completions, "no shard of the capped dataset says why it is short"
    records = [json.loads(p.read_text()) for p in completions]
    cut = [r for r in records if r["reason"] == "max_output_tokens" and r["not_requested"] > 0]
    assert cut and all(r["max_output_tokens"] == cap for r in records), records
    # Downstream ran on what exists.
    assert sorted((results / CAPPED / "hidden").glob("shard-*.safetensors"))


@pytest.mark.slow
def test_the_servers_sampling_is_seeded_per_request(rehearsal) -> None:
    """A journaled answer (asked through the emulator, with faults, retries and other requests in flight) is
    the answer the server gives the same request again on its own: sampling depends on the request alone."""
    for record, message in rehearsal["asked_again"]:
        assert (record["reasoning"] or None, record["content"]) == (
            message.get("reasoning_content") or None,
            message.get("content") or "",
        ), record["id"]


def drafter_names(config: dict) -> dict[str, str]:
    """{drafters key: the drafter's name} (aerie.plan.drafters: ``{run}-{key}``, its folder results/drafter/{name})."""
    return {key: f"{config['run']}-{key}" for key in config["drafters"]}


@pytest.mark.slow
def test_kimi_paths_ran_hidden_drafter_and_benchmark(rehearsal) -> None:
    """One capture for both drafters, a folder per drafter, and the benchmark of both side by side with both
    published folders: each drafter judged alone against its references (acceptance only at its own draft width);
    the EAGLE-3 drafter passes as for Kimi; the DFlash drafter's verdict is recorded with its figures, whatever it is
    (a CPU toy need not make it win), and nothing but its references' figures may fail it."""
    from aerie.benchmark.gate import lossy_divergences

    workdir, config = rehearsal["workdir"], rehearsal["config"]
    results = workdir / "results"
    target = json.loads((workdir / config["target"]["path"] / "config.json").read_text())
    assert target["architectures"] == ["KimiK25ForConditionalGeneration"]
    from safetensors import safe_open

    shard = next(iter(sorted((results / "sharegpt" / "hidden").glob("shard-*.safetensors"))))
    with safe_open(str(shard), framework="pt") as f:
        meta = f.metadata()
    # the union of both drafters' layers: EAGLE-3's hidden.aux_layer_ids [1, 3, 4] and the DFlash folder's [1, 5]
    assert json.loads(meta["aux_layer_ids"]) == [1, 3, 4, 5]
    names = drafter_names(config)
    eagle3, dflash = names["eagle3"], names["dflash"]
    exported = {key: json.loads((results / "drafter" / n / "config.json").read_text()) for key, n in names.items()}
    # each published drafter's kind: Llama-kind EAGLE-3 (lightseekorg/kimi-k2.5-eagle3), DFlash (z-lab's)
    assert exported["eagle3"]["architectures"] == ["LlamaForCausalLMEagle3"]
    assert exported["dflash"]["architectures"] == ["DFlashDraftModel"]
    assert all((results / "publish" / n / "README.md").exists() for n in names.values())
    bench = json.loads((results / "bench" / f"{config['run']}.json").read_text())
    assert bench["format"] == "aerie.bench/4"
    assert {n: d["kind"] for n, d in bench["drafters"].items()} == {eagle3: "eagle3", dflash: "dflash"}
    pub_eagle3, pub_dflash = (config["drafters"][k]["init"] for k in ("eagle3", "dflash"))
    methods = bench["methods"]
    described = {m: (v["role"], v["kind"], v["draft_tokens"]) for m, v in methods.items()}
    steps, block = config["bench"]["num_draft_steps"], DFLASH_BLOCK_SIZE - 1
    assert described == {
        eagle3: ("trained", "eagle3", steps),
        dflash: ("trained", "dflash", block),
        f"untrained:{eagle3}": ("untrained", "eagle3", steps),  # twins named by their drafter: two drafters
        f"untrained:{dflash}": ("untrained", "dflash", block),
        "ngram": ("ngram", None, steps),
        pub_eagle3: ("drafter", "eagle3", steps),
        pub_dflash: ("drafter", "dflash", block),
    }, described
    assert list(methods) == list(described)  # trained drafters first, then bench.references' order
    assert methods[f"untrained:{dflash}"]["twin_of"] == dflash and all(v["speedup"] > 0 for v in methods.values())
    # each twin is its drafter as training started: the warm start's published folder, read from the trained folder
    for name, published in ((eagle3, pub_eagle3), (dflash, pub_dflash)):
        assert Path(methods[f"untrained:{name}"]["folder"]).resolve() == (workdir / published).resolve(), methods
    assert list(bench["sets"]) == ["mtbench", "gsm8k", "humaneval"] and bench["prompts"] == 12
    assert bench["failed_requests"] == dict.fromkeys(["baseline", *methods], 0)
    # lossless, as the gate counts it: any output that leaves the baseline's does so at a numerical near-tie
    assert not lossy_divergences(bench, config["bench"]["gate"]["lossless_max_gap"]), bench["divergences"]
    gate = bench["gate"]
    assert gate["passed"] is True and gate["settings"]["traffic"] == pytest.approx(config["bench"]["traffic"])
    assert list(gate["drafters"]) == [eagle3, dflash]
    # The EAGLE-3 drafter passes as for Kimi: on every set it beats prompt lookup, its untrained twin and the
    # "published" folder in acceptance (its width's references; DFlash's block is another width), and so on the mix.
    assert gate["drafters"][eagle3]["passed"] is True and gate["drafters"][eagle3]["failures"] == []
    same_width = [f"untrained:{eagle3}", "ngram", pub_eagle3]
    for set_name, table in bench["sets"].items():
        figures = {m: v["acceptance_length"] for m, v in table["methods"].items()}
        assert figures[eagle3] > max(figures[m] for m in same_width), (set_name, figures)
    weighted = gate["drafters"][eagle3]["traffic"]["acceptance_length"]["weighted"]
    assert weighted[eagle3] > max(weighted[m] for m in same_width), weighted
    # The DFlash drafter: judged alone against its own width's references (its twin, the published DFlash folder),
    # its verdict and figures recorded per set; if it fails, only on those references' figures.
    verdict = gate["drafters"][dflash]
    assert isinstance(verdict["passed"], bool) and verdict["passed"] == (verdict["failures"] == [])
    assert all(f.startswith("traffic: ") for f in verdict["failures"]), verdict["failures"]
    for set_name, table in bench["sets"].items():
        mine = verdict["sets"][set_name]
        assert mine["acceptance_length"] == table["methods"][dflash]["acceptance_length"] >= 1.0, mine
        assert {x["reference"] for x in mine["losses"]} <= {f"untrained:{dflash}", pub_dflash}, mine
    weighted = verdict["traffic"]["acceptance_length"]["weighted"]
    assert set(weighted) >= {dflash, f"untrained:{dflash}", pub_dflash}, weighted
    # the drafter to serve: one that passed, on the traffic-weighted speed
    assert gate["serve"] in [n for n, v in gate["drafters"].items() if v["passed"]], gate
    assert (results / "bench" / "sets" / "gsm8k.jsonl").exists()
    assert (results / "report" / "spend.png").exists() and (workdir / "report.html").stat().st_size > 10_000


@pytest.mark.slow
def test_training_started_from_the_published_folder_and_kept_its_vocab(rehearsal) -> None:
    """drafters.eagle3.init end to end: the dry run said what is taken, the vocab rule took the folder's d2t (not
    counted: the folder's ids cover the toy data, which vocab.warm_start auto keeps), the exported drafter keeps it
    and moved from the folder's weights; its aux ids are aerie's spelling of the same layers SGLang serves the
    published folder ([2, 4, 5] on Kimi's wrapper = outputs [1, 3, 4])."""
    from safetensors.torch import load_file

    from aerie.formats.vocab import load_draft_vocab

    workdir, config, published = rehearsal["workdir"], rehearsal["config"], rehearsal["published"]["eagle3"]
    name, init = drafter_names(config)["eagle3"], config["drafters"]["eagle3"]["init"]
    preview = rehearsal["preview"]
    assert f"aerie warm start ({name}): drafters.eagle3.init {init!r} -> " in preview
    assert "draft vocab: taken from its d2t/t2d (2048 ids), not counted" in preview
    results = workdir / "results"
    vocab = load_draft_vocab(results / "vocab" / "draft_vocab.safetensors")
    assert vocab.meta["source"] == "drafter.init" and vocab.meta["coverage"] > 0.99
    # the config's vocab.warm_start reached the rule (auto: the folder's ids cover >= follow_below, so they are kept)
    assert vocab.meta["warm_start"] == config["vocab"]["warm_start"] == "auto"
    start, trained = (
        load_file(published / "model.safetensors"),
        load_file(results / "drafter" / name / "model.safetensors"),
    )
    assert torch_equal(trained["d2t"], start["d2t"]) and torch_equal(trained["d2t"], vocab.d2t)
    assert not torch_equal(trained["fc.weight"], start["fc.weight"])
    exported = json.loads((results / "drafter" / name / "config.json").read_text())
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert exported["aerie"]["train_config"]["init"] == init
    log = (results / "logs" / "vocab" / "draft_vocab.log").read_text()
    assert "taken from drafter.init" in log


@pytest.mark.slow
def test_the_dflash_drafter_started_from_the_published_dflash_folder(rehearsal) -> None:
    """drafters.dflash.init end to end: the dry run described the third-party folder (its shape, block, MASK id and
    target layers, taken by the plan), training started from its tensors (``model.`` prefixes, two shards) and moved
    from them, and the export is aerie's spelling of the same drafter (dflash_config), checked against the target."""
    from aerie.drafter_kinds.dflash.folder import check_dflash_folder
    from aerie.drafter_kinds.dflash.training import mask_token_check
    from aerie.drafter_kinds.dflash.weights import read_state
    from aerie.target_model.config import read_text_config
    from aerie.target_model.markers import mask_token_id

    workdir, config, published = rehearsal["workdir"], rehearsal["config"], rehearsal["published"]["dflash"]
    name, init = drafter_names(config)["dflash"], config["drafters"]["dflash"]["init"]
    target = workdir / config["target"]["path"]
    mask = mask_token_id(target)
    assert mask == 163838  # the toy tokenizer's [UNK], as z-lab's Kimi-K2.5-DFlash's MASK
    preview = rehearsal["preview"]
    layers = config["drafters"]["dflash"]["num_layers"]
    assert f"aerie warm start ({name}): drafters.dflash.init {init!r} -> " in preview
    assert (
        f"DFlashDraftModel (dflash), {layers} layers, hidden 128, block {DFLASH_BLOCK_SIZE}, mask id {mask}, target "
        "layers [1, 5]" in preview
    ), preview
    folder = workdir / "results" / "drafter" / name
    exported = json.loads((folder / "config.json").read_text())
    assert exported["dflash_config"] == {"mask_token_id": mask, "target_layer_ids": [1, 5]}
    assert exported["block_size"] == DFLASH_BLOCK_SIZE and exported["num_hidden_layers"] == layers
    assert exported["aerie"]["train_config"]["init"] == init
    check_dflash_folder(folder, read_text_config(target), mask_token_check(target))
    start, trained = read_state(published), read_state(folder)
    assert set(start) == set(trained) and "fc.weight" in trained
    assert not torch_equal(trained["fc.weight"].float(), start["fc.weight"].float())
    assert (folder / "eval.json").exists()


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


@pytest.mark.slow
def test_the_fit_plan_agrees_with_the_jobs_measured_peaks(rehearsal) -> None:
    """aerie.preview.fit's estimate of each job, for the CPU, plus the Python/torch baseline, against its peak RSS
    (tests/fit_check.py says what the comparison means)."""
    from fit_check import assert_estimates_agree

    workdir = rehearsal["workdir"]
    drafters = {f"drafter {n}" for n in drafter_names(rehearsal["config"]).values()}  # one job per drafter
    assert_estimates_agree(workdir, workdir / "kimi-rehearsal.yaml", {"hidden", "bench", *drafters})


@pytest.mark.slow
def test_recorded_answers_train_at_zero_dollars_beside_the_paid_datasets(rehearsal) -> None:
    """The two recorded datasets (the toy target's own answers: ShareGPT with <think> inline, a gateway log) went
    through the same token rebuild as the API's answers, into the drafter's data, without a request; the report keeps
    them apart from the paid samples."""
    from aerie.publish.report import figure_spend, load_responses

    workdir = rehearsal["workdir"]
    results = workdir / "results"
    for name in RECORDED:
        shards = sorted((results / name / "responses").glob("shard-[0-9][0-9][0-9][0-9][0-9].jsonl"))
        records = [json.loads(x) for s in shards for x in s.read_text().splitlines()]
        assert len(records) == 4 and {r["backend"] for r in records} == {"recorded"}
        assert all(r["cost"] == 0.0 and r["provenance"]["kind"] == "recorded" for r in records)
        assert not list((results / name / "responses").glob("*.journal.jsonl"))  # never part of the paid job
        report = json.loads((results / name / "tokens" / "shard-00000.report.json").read_text())
        assert report["rebuild_paths"]["refused"] == 0 and report["kept"] >= 3, report["dropped"]
        assert report["reasoning_present"] == 4  # the reasoning came back out of <think> / the log's message
        assert (results / name / "hidden" / "shard-00000.safetensors").exists()
    # The log kept the server's usage: the rebuilt lengths are checked against its completion tokens.
    logged = json.loads((results / "own_traffic" / "tokens" / "shard-00000.report.json").read_text())
    assert logged["usage_length_checked"] == 4 and logged["usage_length_equal"] >= 3, logged["usage_length_deltas"]
    responses = sorted(str(p) for p in results.glob("*/responses/shard-[0-9][0-9][0-9][0-9][0-9].jsonl"))
    summary = figure_spend(load_responses(responses), workdir / "spend-by-source.png")
    assert set(summary["by_source"]["recorded"]) == set(RECORDED)
    assert all(v["usd"] == 0.0 and v["samples"] == 4 for v in summary["by_source"]["recorded"].values())
    assert summary["by_source"]["api:openrouter"]["sharegpt"]["usd"] > 0
    assert not set(summary["by_dataset"]) & set(RECORDED)  # no API spend is ever attributed to them
