"""DFlash vs EAGLE-3 from the same data, per set, in one process (issue 36 item 7): on the demo target (default)
and on the Kimi-shaped rehearsal target (``--target rehearsal``).

    .venv/bin/python bench/warm_start.py data --work /tmp/aerie-ws --study shifted      # the demo's data (shared)
    .venv/bin/python bench/dflash_vs_eagle3.py run --work /tmp/aerie-ws --seeds 0 1 2 3 4
    .venv/bin/python bench/drafter_kinds.py data --work /tmp/dfr --prompts 384            # the rehearsal's data
    .venv/bin/python bench/dflash_vs_eagle3.py run --target rehearsal --work /tmp/dfr --seeds 0 1 2 3 4
    .venv/bin/python bench/tables.py                                                    # the RESULTS tables

The data is bench/warm_start.py's ``shifted`` study (the demo target; the publisher's general set of arith and
lists answers: 360 sequences; its held-out general prompts, and the user's HumanEval prompts as a second set the
training never saw). Per seed, one EAGLE-3 drafter (the demo's recipe, ``EAGLE3``: the warm-start study's published
drafter is this very training, so seeds 0-2 reuse ``published-{seed}`` when it is there) and one DFlash drafter
(``DFLASH``) are trained from scratch on the same hidden-state shards, reading the same captured layers (the
capture's three: DFlash's ``target_layer_ids`` set to them, so one capture serves both), and benchmarked in ONE
process by aerie's own in-process benchmark (aerie.benchmark.run.run_benchmark): greedy baseline, both drafters and
prompt lookup on the same prompts, acceptance length (tokens committed per verify step, as SGLang's
spec_accept_length less the prefill token), tokens/s and losslessness per set. The DFlash block is 4 (3 drafts per
verify step), EAGLE-3 drafts a chain of 3: the same width, so their acceptance lengths compare.

On the rehearsal target (``--target rehearsal``) the data is bench/drafter_kinds.py's (its ``data`` step: the
rehearsal target built by the pipeline exactly as config/kimi-rehearsal.yaml builds it, synthetic arith, lists and
code prompts answered in-process at Kimi's sampling, hidden states captured at the rehearsal's aux layers, a draft
vocab, 24 held-out bench prompts: one set, ``tasks``). Per seed, an MLA EAGLE-3 drafter (``Eagle3DeepseekV2``,
aerie's kind for DeepseekV3 targets) at drafter_kinds' ``RECIPE`` and a DFlash drafter (``DFLASH_REHEARSAL``) are
trained from scratch on those shards, DFlash again reading the capture's layers, and benchmarked the same way.

One JSON per seed under ``--out`` (bench/results/dflash_vs_eagle3/seed-N.json; the rehearsal's under
bench/results/dflash_vs_eagle3_rehearsal/); a finished seed is never redone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's aerie, installed or not
sys.path.insert(0, str(REPO / "bench"))  # warm_start, paired_stats, tables

import drafter_kinds  # noqa: E402  (the rehearsal's data and its MLA EAGLE-3 recipe)
import warm_start  # noqa: E402  (the study's data and published folders)

FORMAT = "aerie.bench.dflash-vs-eagle3/1"
OUT = REPO / "bench" / "results" / "dflash_vs_eagle3"
STUDY = "shifted"
KINDS = ("eagle3", "dflash")
EAGLE3 = {k: v for k, v in warm_start.PUBLISH.items() if k != "seed"}  # the demo's recipe on the general set


def dflash_recipe(eagle3: dict[str, Any], num_anchors: int) -> dict[str, Any]:
    """DFlash beside an EAGLE-3 recipe: 2 layers, a block of 4 (3 drafts: the chain's width), ``num_anchors`` blocks
    per sequence, and the EAGLE-3 recipe's epochs, rate, batches and held-out share."""
    same = ("epochs", "learning_rate", "max_seq_len", "batch_size", "eval_fraction")
    return dict(kind="dflash", num_layers=2, block_size=4, num_anchors=num_anchors, **{k: eagle3[k] for k in same})


# DFlash at the demo target's scale: 2 layers (the target has 8; EAGLE-3 has 1), a block of 4 (3 drafts, EAGLE-3's
# width), 64 anchors per sequence, the same epochs, rate and batches as EAGLE-3; its layers are the capture's.
DFLASH = dflash_recipe(EAGLE3, num_anchors=64)
BENCH = dict(max_new_tokens=64, num_draft_steps=3, repeats=1, warmup=1, max_prompts=16)

# The rehearsal target (8 layers of width 128, MLA, MoE, Kimi's 163,840-id vocabulary): EAGLE-3 is drafter_kinds'
# MLA recipe on its data, the kind aerie trains for a DeepseekV3 target.
OUT_REHEARSAL = REPO / "bench" / "results" / "dflash_vs_eagle3_rehearsal"
EAGLE3_REHEARSAL = {**drafter_kinds.RECIPE, "attention": "mla"}
# DFlash on the rehearsal: 2 layers, as on the demo and as the rehearsal's CI drafter (Kimi's is 6 of 61 target layers;
# one layer of 8 would leave DFlash a single attention over the context), block 4 (3 drafts: EAGLE-3's chain of 3),
# and 16 anchors per sequence: the answers here are ~40 tokens (the demo's 64 anchors would sample nearly every answer
# position several times over), so 16 blocks of 3 drafts cover an answer about once; and each drafted slot is
# projected on all 163,840 ids (DFlash has no draft vocab), which makes anchors the cost of its training on a CPU. The
# same epochs, rate, batches and held-out share as the EAGLE-3 recipe.
DFLASH_REHEARSAL = dflash_recipe(EAGLE3_REHEARSAL, num_anchors=16)
BENCH_REHEARSAL = {**drafter_kinds.BENCH}  # every one of the 24 bench prompts, as drafter_kinds benches them
TARGETS = ("demo", "rehearsal")


def rehearsal_files(work: Path) -> dict[str, Any]:
    """bench/drafter_kinds.py's data in ``work``, under the names this script reads."""
    f = drafter_kinds.data_files(work)
    return {"target": f["target"], "general_hidden": f["hidden"], "general_vocab": f["vocab"], "published": {}, **f}


def train(kind: str, seed: int, f: dict[str, Any], folder: Path, threads: int, target: str = "demo") -> dict[str, Any]:
    """One drafter of ``kind`` at ``seed`` on the general set's shards; its eval.json (a finished folder is kept)."""
    from aerie.drafter.config import TrainConfig
    from aerie.drafter.loop import train_drafter
    from aerie.formats.hidden import open_hidden_shards

    if (folder / "eval.json").exists():
        return json.loads((folder / "eval.json").read_text())
    if kind == "eagle3":
        published = f["published"].get(seed)
        if published is not None and (published / "eval.json").exists():  # this very training, done by the study
            shutil.copytree(published, folder, dirs_exist_ok=True)
            return json.loads((folder / "eval.json").read_text())
        recipe = EAGLE3 if target == "demo" else EAGLE3_REHEARSAL
        cfg = TrainConfig.of(**{**recipe, "seed": seed}, threads=threads, resume=False, checkpoint_every=0)
        return train_drafter(f["general_hidden"], f["general_vocab"], f["target"], folder, cfg, log=print)
    layers = list(open_hidden_shards(f["general_hidden"])[0].aux_layer_ids)
    recipe = DFLASH if target == "demo" else DFLASH_REHEARSAL
    cfg = TrainConfig.of(
        **{**recipe, "seed": seed, "target_layer_ids": layers}, threads=threads, resume=False, checkpoint_every=0
    )
    return train_drafter(f["general_hidden"], None, f["target"], folder, cfg, log=print, layer_ids=layers)


def run_seed(work: Path, seed: int, out: Path, threads: int, target: str = "demo") -> dict[str, Any]:
    import torch

    from aerie.benchmark.run import run_benchmark
    from aerie.benchmark.settings import BenchRun, TargetLoad

    torch.set_num_threads(threads)
    if target == "demo":
        f = warm_start.files(warm_start.study_dir(work, STUDY))
        load_target = TargetLoad(Path(f["target"]), "cpu", "float32")
        prompt_files, bench = [f["general_bench"], f["domain_bench"]], BENCH
    else:
        f = rehearsal_files(work)
        load_target = TargetLoad(Path(f["target"]), "cpu", "float32", trust_remote_code=True)
        prompt_files, bench = [f["bench_prompts"]], BENCH_REHEARSAL
    load = {"before": os.getloadavg()}
    folders = {k: work / "dflash-vs-eagle3" / f"{k}-{seed}" for k in KINDS}
    evals = {}
    for kind in KINDS:
        t0 = time.perf_counter()
        evals[kind] = {
            **train(kind, seed, f, folders[kind], threads, target),
            "wall_seconds": time.perf_counter() - t0,
        }
    load["after_training"] = os.getloadavg()
    report = run_benchmark(
        load_target,
        folders,
        prompt_files,
        folders["dflash"].parent / f"bench-{seed}.json",
        BenchRun(**bench, threads=threads, references=("ngram",)),
        log=lambda _: None,
    )
    load["after_bench"] = os.getloadavg()
    keep = ("acceptance_length", "acceptance_per_position", "tokens_per_s", "speedup", "lossless")
    result = {
        "format": FORMAT,
        "seed": seed,
        "study": STUDY,
        "recipes": {"eagle3": EAGLE3, "dflash": DFLASH},
        "bench_settings": BENCH,
    }
    if target != "demo":  # the demo's JSON stays as it was; the rehearsal's says which target and data it is
        result.update(
            target=target,
            study="drafter_kinds",
            recipes={"eagle3": EAGLE3_REHEARSAL, "dflash": DFLASH_REHEARSAL},
            bench_settings=BENCH_REHEARSAL,
            data=rehearsal_data(f, folders, report),
        )
    result |= {
        "train": {
            k: {
                "simulated_acceptance_length": ev.get("simulated_acceptance_length"),
                "best_epoch": ev.get("best_epoch"),
                "tokens_per_s": ev.get("tokens_per_s"),
                "wall_seconds": ev["wall_seconds"],
                **({} if target == "demo" else {"train_seconds": ev.get("train_seconds")}),
            }
            for k, ev in evals.items()
        },
        "sets": {
            name: {
                "prompts": table["prompts"],
                "baseline_tokens_per_s": (table.get("baseline") or {}).get("tokens_per_s"),
                "methods": {
                    m: {**{k: v.get(k) for k in keep}, "draft_tokens": report["methods"][m]["draft_tokens"]}
                    for m, v in table["methods"].items()
                },
            }
            for name, table in report["sets"].items()
        },
        "lossless": report["lossless"],
        "code": warm_start.code_version(),
        "machine": {"loadavg": load, "cpu_count": os.cpu_count(), "threads": threads},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)
    return result


def rehearsal_data(f: dict[str, Any], folders: dict[str, Path], report: dict[str, Any]) -> dict[str, Any]:
    """What the rehearsal's figures stand on: the shards' size, the captured layers, each drafter's architecture."""
    from aerie.formats.hidden import open_hidden_shards

    shards = open_hidden_shards(f["hidden"])
    return {
        "sequences": sum(s.num_seqs for s in shards),
        "tokens": sum(int(s.seq_offsets[-1]) for s in shards),
        "generated_tokens": sum(int(s.loss_mask.sum()) for s in shards),
        "aux_layer_ids": list(shards[0].aux_layer_ids),
        "bench_prompts": report["prompts"],
        "architectures": {
            k: json.loads((folder / "config.json").read_text()).get("architectures") for k, folder in folders.items()
        },
    }


def load_results(out: Path) -> dict[int, dict]:
    results = {}
    for path in sorted(out.glob("seed-*.json")):
        r = json.loads(path.read_text())
        if r.get("format") != FORMAT:
            raise SystemExit(f"{path}: format {r.get('format')!r}, not {FORMAT}")
        results[r["seed"]] = r
    return results


def dflash_table(out: Path = OUT) -> str:
    """The RESULTS table: mean +- stdev per set and method, then paired tests (DFlash - EAGLE-3, each - ngram)."""
    from paired_stats import paired_test
    from tables import gap_text, paired_header, spread

    results = load_results(out)
    if not results:
        return f"(no results under {out})"
    seeds = sorted(results)
    r0 = results[seeds[0]]
    sets = list(r0["sets"])
    methods = list(r0["sets"][sets[0]]["methods"])
    lines = [
        f"Mean ± stdev over seeds {', '.join(map(str, seeds))}; acceptance length (drafts per verify step: "
        + ", ".join(f"{m} {r0['sets'][sets[0]]['methods'][m]['draft_tokens']}" for m in methods)
        + ") and speedup over the greedy baseline, measured in one process per seed:",
        "",
        "| method | " + " | ".join(f"{s}: acceptance | {s}: speedup" for s in sets) + " |",
        "|---|" + "---|---|" * len(sets),
    ]
    for m in methods:
        cells = []
        for s in sets:
            for key in ("acceptance_length", "speedup"):
                cells.append(spread([results[k]["sets"][s]["methods"][m][key] for k in seeds]))
        lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    pairs = (("dflash", "eagle3"), ("dflash", "ngram"), ("eagle3", "ngram"))
    lines += ["", paired_header(len(pairs) * len(sets) * 2), ""]
    lines += ["| comparison | set | figure | difference |", "|---|---|---|---|"]
    for a, b in pairs:
        for s in sets:
            for key in ("acceptance_length", "speedup"):
                test = paired_test(*([results[k]["sets"][s]["methods"][m][key] for k in seeds] for m in (a, b)))
                lines.append(f"| {a} - {b} | {s} | {key.replace('_', ' ')} | {gap_text(test)} |")
    train = {k: [results[s]["train"][k] for s in seeds] for k in ("eagle3", "dflash")}
    loads = [x for r in results.values() for x in (r["machine"]["loadavg"][k][0] for k in r["machine"]["loadavg"])]
    if r0.get("target", "demo") == "demo":
        data = (
            f"Study data: bench/warm_start.py `{r0['study']}` (general set: the publisher's arith and lists answers; "
            "the domain set: HumanEval prompts no drafter trained on). "
        )
    else:
        d = r0["data"]
        data = (
            f"Data: bench/drafter_kinds.py `data` on the Kimi rehearsal target ({d['sequences']} sequences, "
            f"{d['tokens']:,} tokens, {d['generated_tokens']:,} of them generated; layers {d['aux_layer_ids']} "
            "captured, read by both drafters; one bench set, `tasks`: held-out arith, lists and code prompts). "
            "Drafters: "
            + "; ".join(f"{k} {', '.join(a or ['?'])}" for k, a in d["architectures"].items())
            + ". Measured acceptance per draft position (mean over seeds): "
            + "; ".join(
                f"{s} {m} "
                + " / ".join(
                    f"{statistics.fmean(x):.3f}"
                    for x in zip(*(results[k]["sets"][s]["methods"][m]["acceptance_per_position"] for k in seeds))
                )
                for s in sets
                for m in methods
            )
            + ". Training wall seconds (one thread): "
            + "; ".join(f"{k} " + "/".join(f"{t['wall_seconds']:.0f}" for t in v) for k, v in train.items())
            + ". "
        )
    lines += [
        "",
        data
        + "; ".join(f"{s} {r0['sets'][s]['prompts']} prompts" for s in sets)
        + ". Simulated (training eval) acceptance: "
        + "; ".join(f"{k} " + "/".join(f"{t['simulated_acceptance_length']:.2f}" for t in v) for k, v in train.items())
        + ". Best epoch: "
        + "; ".join(f"{k} " + "/".join(str(t["best_epoch"]) for t in v) for k, v in train.items())
        + ". Recipes: "
        + "; ".join(
            f"{k} {', '.join(f'{a} {b}' for a, b in r.items() if a != 'seed')}" for k, r in r0["recipes"].items()
        )
        + f"; bench {', '.join(f'{a} {b}' for a, b in r0['bench_settings'].items())}. Every decode lossless: "
        f"{all(r['lossless'] for r in results.values())}. Code {r0['code']}; load average (1 min) "
        f"{min(loads):.1f}-{max(loads):.1f} on {r0['machine']['cpu_count']} cores.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run")
    run.add_argument(
        "--work",
        type=Path,
        required=True,
        help="bench/warm_start.py's --work (its shifted study); with --target rehearsal, bench/drafter_kinds.py's",
    )
    run.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    run.add_argument("--threads", type=int, default=1)
    tab = sub.add_parser("table")
    for p in (run, tab):
        p.add_argument("--target", choices=TARGETS, default="demo", help="the demo target or the Kimi rehearsal's")
        p.add_argument("--out", type=Path, help="default: bench/results/dflash_vs_eagle3[_rehearsal]")
    args = ap.parse_args(argv)
    out = args.out or (OUT if args.target == "demo" else OUT_REHEARSAL)
    if args.cmd == "table":
        print(dflash_table(out))
        return
    for seed in args.seeds:
        path = out / f"seed-{seed}.json"
        if path.exists():
            print(f"{path.name}: done", flush=True)
            continue
        t0 = time.perf_counter()
        r = run_seed(args.work.resolve(), seed, path, args.threads, args.target)
        figures = "; ".join(
            f"{s}: " + ", ".join(f"{m} {v['acceptance_length']:.3f}" for m, v in t["methods"].items())
            for s, t in r["sets"].items()
        )
        print(f"seed {seed} ({time.perf_counter() - t0:.0f} s): {figures}", flush=True)


if __name__ == "__main__":
    main()
