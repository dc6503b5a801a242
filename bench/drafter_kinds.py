"""The two drafter kinds side by side on the Kimi-shaped rehearsal target: MLA (``Eagle3DeepseekV2ForCausalLM``,
aerie's default for DeepseekV3 targets) vs Llama attention (``LlamaForCausalLMEagle3``), same data, same recipe.

    .venv/bin/python bench/drafter_kinds.py data --work /tmp/dk            # target, answers, hidden shards, vocab
    .venv/bin/python bench/drafter_kinds.py run --work /tmp/dk --seeds 0 1 2 3 4
    .venv/bin/python bench/drafter_kinds.py table                          # the RESULTS table from the JSON

``data`` runs this checkout's pipeline in ``--work`` on a study config (``study_config``): the rehearsal target
exactly as config/kimi-rehearsal.yaml builds it (``target.rehearsal``), prompts of the rehearsal's task language
(arith, lists, code) answered in-process at Kimi's sampling (temperature 1.0, top_p 0.95, the rehearsal's
``max_new_tokens``), hidden states captured in the compact layout at the rehearsal's aux layers, a draft vocab, and
held-out bench prompts. ``run`` trains every kind x seed in a fresh process (its peak memory is its own), with the
same recipe (``RECIPE``, the rehearsal's drafter settings), scores it with the training's held-out simulation and
with aerie's in-process benchmark (``aerie.benchmark.run.run_benchmark``: greedy decoding vs speculative, with the
untrained drafter of the same kind and prompt lookup measured in the same run), and writes one JSON per kind x
seed under ``--out`` (bench/results/drafter_kinds/). A finished JSON is never recomputed; a JSON made with another
recipe or other data is refused. Seeds run interleaved (the kind that goes first alternates), so the shared
machine's load drifts hit both kinds alike; the load average is kept with every figure.

``table`` prints the markdown table of every JSON under ``--out``: mean +- stdev over seeds per kind, the
references, and paired tests across seeds (MLA - llama, each kind - prompt lookup): mean difference, its 95 %
interval, Student's t p, the sign count and the exact sign-flip p.

Training tokens/s is the trainer's own figure (rows per second of optimizer steps, one thread). Peak memory is
the training process's peak resident set (``ru_maxrss``) after training, and its growth over the resident set
just before training starts (imports and nothing else): on a CPU, what training the kind allocates beyond the
interpreter. Neither says anything about a GPU.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's aerie, installed or not
sys.path.insert(0, str(REPO / "bench"))  # paired_stats, tables

FORMAT = "aerie.bench.drafter-kinds/1"
KINDS = ("mla", "llama")
OUT = REPO / "bench" / "results" / "drafter_kinds"
REHEARSAL = REPO / "config" / "kimi-rehearsal.yaml"
DATASET = "tasks"
# The recipe both kinds train with: the rehearsal's drafter settings (config/kimi-rehearsal.yaml) with more epochs
# for more data; one thread (the machine is shared), the rest TrainConfig's defaults.
RECIPE = dict(ttt_steps=3, epochs=3, learning_rate=0.001, max_seq_len=1024, batch_size=4, eval_fraction=0.1)
BENCH = dict(max_new_tokens=64, num_draft_steps=3, repeats=1, warmup=1)


def study_config(prompts: int, bench_prompts: int) -> dict:
    """The pipeline config of the study's data: the rehearsal's target, sampling, capture and vocab."""
    rehearsal = yaml.safe_load(REHEARSAL.read_text())
    responses = rehearsal["responses"]
    return {
        "run": "drafter-kinds",
        "target": rehearsal["target"],  # built by the pipeline, exactly as the rehearsal builds it
        "datasets": {
            DATASET: {
                # the rehearsal's prompts are this language in six dataset shapes; seed 7 is not a pretraining seed
                "source": {"kind": "synthetic", "families": ["arith", "lists", "code"], "count": prompts, "seed": 7},
                "shard_size": 128,
                "bench_prompts": bench_prompts,
            }
        },
        "responses": {
            "backend": "hf",  # in-process: the same target and sampling as the rehearsal's server, batched
            "temperature": responses["temperature"],
            "top_p": responses["top_p"],
            "max_new_tokens": responses["max_new_tokens"],
            "batch_size": 16,
            "seed": 0,
        },
        "tokens": rehearsal["tokens"],
        # The rehearsal's capture settings, but for one gate: its server (transformers serve) samples with the
        # generation config's default top_k 50 as well as top_p, the in-process backend with top_p alone, and this
        # toy target's top 32 hold only ~89 % of its probability: ~10 % of the tokens sampled here fall outside
        # them (shards measured 0.898-0.907), so the rehearsal's 0.9 would refuse shards that are aligned.
        "hidden": {**{k: v for k, v in rehearsal["hidden"].items() if k != "sglang"}, "min_next_token_in_topk": 0.85},
        # Every one of the toy tokenizer's 1,944 BPE ranks and the special ids its answers use (its answers use ~930
        # distinct ids; coverage 1.0 either way), as config/kimi-rehearsal.yaml sets too. Kimi's 32,000 adds ~30,000
        # ids the toy never produces: 94 % of the drafter's head, which then dominates its cost; at 2,048 head and
        # attention weigh about as they do at Kimi's size (head 32,000 x 7,168 vs attention 116 M (MLA) / 205 M
        # (llama)).
        "vocab": {**rehearsal["vocab"], "draft_vocab_size": 2048},
        "resources": {k: 0 for k in rehearsal["resources"]},
    }


def data_files(work: Path) -> dict[str, Any]:
    hidden = sorted(glob.glob(str(work / "results" / DATASET / "hidden" / "shard-*.safetensors")))
    return {
        "target": work / "results" / "rehearsal-target",
        "hidden": [Path(p) for p in hidden],
        "vocab": work / "results" / "vocab" / "draft_vocab.safetensors",
        "bench_prompts": work / "results" / DATASET / "prompts" / "bench.jsonl",
    }


def make_data(args: argparse.Namespace) -> None:
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    configfile = work / "study.yaml"
    configfile.write_text(yaml.safe_dump(study_config(args.prompts, args.bench_prompts), sort_keys=False))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(work)]
    cmd += ["--configfile", str(configfile), "--cores", str(args.cores)]
    bench_prompts = str(data_files(work)["bench_prompts"].relative_to(work))
    # the vocab is a few seconds and deterministic: recomputed so that a changed draft_vocab_size always takes effect
    for extra in (["--until", "hidden", "draft_vocab", "--forcerun", "draft_vocab"], [bench_prompts]):
        print(" ".join(cmd + extra), flush=True)
        subprocess.run(cmd + extra, check=True)


def code_version() -> str:
    """The aerie code the figures come from: the checkout's commit (+ "-dirty"), or a snapshot's COMMIT file."""
    if (REPO / "COMMIT").exists():  # a `git archive` snapshot (a stable copy while others commit to the checkout)
        return (REPO / "COMMIT").read_text().strip()
    done = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


# ---- one kind x seed, in its own process ---------------------------------------------------------------------
def rss_mib() -> float:
    """The current resident set of this process (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def count_params(model: Any) -> dict[str, int]:
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return {
        "trainable": sum(p.numel() for _, p in trainable),
        "attention": sum(p.numel() for n, p in trainable if ".self_attn." in n),
    }


def train_and_bench(work: Path, kind: str, seed: int, out: Path, threads: int) -> dict:
    """Train one drafter of ``kind`` at ``seed``, benchmark it, write ``out``; figures of this process only."""
    import torch

    from aerie.benchmark.run import run_benchmark
    from aerie.benchmark.settings import BenchRun, TargetLoad
    from aerie.drafter.config import TrainConfig
    from aerie.drafter.loop import train_drafter
    from aerie.drafter.state import data_fingerprint
    from aerie.drafter_kinds.eagle3.model import Eagle3Drafter
    from aerie.formats.hidden import open_hidden_shards

    files = data_files(work)
    torch.set_num_threads(threads)
    cfg = TrainConfig.of(**RECIPE, attention=kind, seed=seed, threads=threads, resume=False, checkpoint_every=0)
    drafter_dir = work / "drafters" / f"{kind}-{seed}"
    shards = open_hidden_shards(files["hidden"])
    aux = shards[0].aux_layer_ids
    load = {"before": os.getloadavg()}
    rss_before = rss_mib()
    t0 = time.perf_counter()
    ev = train_drafter(files["hidden"], files["vocab"], files["target"], drafter_dir, cfg, log=lambda _: None)
    train_wall = time.perf_counter() - t0
    peak = peak_rss_mib()
    load["after_training"] = os.getloadavg()
    drafter = Eagle3Drafter.from_pretrained(drafter_dir)
    report = run_benchmark(
        TargetLoad(Path(files["target"]), "cpu", "float32", trust_remote_code=True),
        {"eagle3": drafter_dir},  # the method's name in the per-seed JSON (methods.eagle3) and the table
        [files["bench_prompts"]],
        drafter_dir / "bench.json",
        BenchRun(**BENCH, threads=threads),
        log=lambda _: None,
    )
    load["after_bench"] = os.getloadavg()
    steps = BENCH["num_draft_steps"]
    result = {
        "format": FORMAT,
        "kind": kind,
        "seed": seed,
        "recipe": {**RECIPE, "threads": threads},
        "bench_settings": BENCH,
        "data": {
            "fingerprint": {
                k: v
                for k, v in data_fingerprint(files["hidden"], files["vocab"], files["target"], aux).items()
                if k != "target"
            },
            "sequences": sum(s.num_seqs for s in shards),
            "tokens": sum(int(s.seq_offsets[-1]) for s in shards),
            "generated_tokens": sum(int(s.loss_mask.sum()) for s in shards),
            "heldout_sequences": ev["heldout_sequences"],
            "bench_prompts": report["prompts"],
        },
        "drafter": {
            "architecture": drafter.cfg.sglang_architecture,
            "params": count_params(drafter),
            "serving_kv_bytes_per_token_bf16": drafter.cfg.serving_kv_bytes_per_token(),
            "shape": {
                k: getattr(drafter.cfg, k)
                for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "q_lora_rank", "kv_lora_rank")
            },
        },
        "train": {
            "tokens_per_s": ev["tokens_per_s"],
            "train_seconds": ev["train_seconds"],
            "wall_seconds": train_wall,
            "optimizer_steps": ev["optimizer_steps"],
            "tokens_trained": ev["tokens_trained"],
            "peak_rss_mib": peak,
            "rss_before_mib": rss_before,
            "peak_rss_growth_mib": peak - rss_before,
        },
        "simulated": {
            "acceptance_length": ev["simulated_acceptance_length_by_steps"][steps - 1],
            "acceptance_per_position": ev["acceptance_per_position"][:steps],
            "heldout_loss": ev["heldout_loss"],
            "best_epoch": ev["best_epoch"],
            "per_epoch": ev["per_epoch"],
            "untrained_acceptance_length": ev["untrained"]["simulated_acceptance_length"],
        },
        "bench": {
            "baseline_tokens_per_s": report["baseline"]["tokens_per_s"],
            "degenerate_prompts": len(report["degenerate_prompts"]),
            "lossless": report["lossless"],
            "methods": {
                m: {
                    k: v[k]
                    for k in (
                        "acceptance_length",
                        "acceptance_length_excluding_degenerate",
                        "acceptance_per_position",
                        "tokens_per_s",
                        "speedup",
                        "lossless",
                    )
                }
                for m, v in report["methods"].items()
            },
        },
        "code": code_version(),
        "machine": {
            "loadavg": load,
            "cpu_count": os.cpu_count(),
            "threads": threads,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)
    return result


def result_path(out: Path, kind: str, seed: int) -> Path:
    return out / f"{kind}-seed{seed}.json"


def run_all(args: argparse.Namespace) -> None:
    """Every kind x seed not finished yet, one fresh process each, seeds interleaved (who goes first alternates)."""
    for i, seed in enumerate(args.seeds):
        kinds = list(args.kinds) if i % 2 == 0 else list(reversed(args.kinds))
        for kind in kinds:
            path = result_path(args.out, kind, seed)
            if path.exists():
                done = json.loads(path.read_text())
                if {k: v for k, v in done["recipe"].items() if k != "threads"} != RECIPE:
                    raise SystemExit(f"{path} was made with recipe {done['recipe']}, not {RECIPE}: use another --out")
                print(f"{path.name}: done", flush=True)
                continue
            cmd = [sys.executable, __file__, "one", "--work", str(args.work), "--kind", kind, "--seed", str(seed)]
            cmd += ["--out", str(args.out), "--threads", str(args.threads)]
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True)
            r = json.loads(path.read_text())
            m = r["bench"]["methods"]
            print(
                f"{kind} seed {seed}: simulated {r['simulated']['acceptance_length']:.3f}, measured "
                f"{m['eagle3']['acceptance_length']:.3f} (ngram {m['ngram']['acceptance_length']:.3f}, untrained "
                f"{m['untrained']['acceptance_length']:.3f}), {r['train']['tokens_per_s']:.0f} train tok/s, peak "
                f"{r['train']['peak_rss_mib']:.0f} MiB, {time.perf_counter() - t0:.0f} s",
                flush=True,
            )


# ---- the table ------------------------------------------------------------------------------------------------
def load_results(out: Path) -> dict[str, dict[int, dict]]:
    """kind -> seed -> result file."""
    results: dict[str, dict[int, dict]] = {k: {} for k in KINDS}
    for path in sorted(out.glob("*-seed*.json")):
        r = json.loads(path.read_text())
        if r.get("format") != FORMAT:
            raise SystemExit(f"{path}: format {r.get('format')!r}, not {FORMAT}")
        results[r["kind"]][r["seed"]] = r
    return results


def kinds_table(out: Path = OUT) -> str:
    """The markdown table of every result under ``out`` (the seeds every kind finished) and the paired tests across
    seeds (bench/paired_stats.py): MLA - llama, and each kind - prompt lookup. Torch-free (bench/tables.py)."""
    from paired_stats import paired_test
    from tables import gap_text, paired_header, spread, table

    results = load_results(out)
    seeds = sorted(set.intersection(*(set(results[k]) for k in KINDS)))
    if not seeds:
        raise SystemExit(f"{out}: no seed finished for every kind {KINDS}")

    def values(kind: str, get) -> list[float]:
        return [float(get(results[kind][s])) for s in seeds]

    def simulated(r: dict) -> float:
        return r["simulated"]["acceptance_length"]

    def measured(method: str):
        return lambda r: r["bench"]["methods"][method]["acceptance_length"]

    def train(key: str):
        return lambda r: r["train"][key]

    rows = []
    for kind in KINDS:
        r0 = results[kind][seeds[0]]
        per_pos = [
            statistics.fmean(p) for p in zip(*(results[kind][s]["simulated"]["acceptance_per_position"] for s in seeds))
        ]
        rows.append(
            [
                f"`{kind}` ({r0['drafter']['architecture']})",
                spread(values(kind, simulated)),
                " / ".join(f"{x:.3f}" for x in per_pos),
                spread(values(kind, measured("eagle3"))),
                spread(values(kind, measured("untrained"))),
                spread(values(kind, train("tokens_per_s")), 0),
                f"{spread(values(kind, train('peak_rss_mib')), 0)} "
                f"({spread(values(kind, train('peak_rss_growth_mib')), 0)})",
                f"{r0['drafter']['params']['trainable']:,} ({r0['drafter']['params']['attention']:,})",
                f"{r0['drafter']['serving_kv_bytes_per_token_bf16']:,}",
            ]
        )
    ngram = sorted({round(measured("ngram")(results[k][s]), 3) for k in KINDS for s in seeds})
    rows.append(["prompt lookup (`ngram`)", "", "", " / ".join(f"{x:.3f}" for x in ngram), "", "", "", "", ""])
    head = [
        "drafter",
        "held-out simulated acceptance",
        "per position",
        "measured acceptance (aerie.benchmark)",
        "untrained, measured",
        "train tokens/s",
        "peak RSS MiB (growth in training)",
        "trainable params (attention)",
        "SGLang KV bytes/token",
    ]
    tests = [
        [
            "mla - llama",
            "simulated acceptance",
            gap_text(paired_test(values("mla", simulated), values("llama", simulated))),
        ],
        [
            "mla - llama",
            "measured acceptance",
            gap_text(paired_test(values("mla", measured("eagle3")), values("llama", measured("eagle3")))),
        ],
        [
            "mla - llama",
            "train tokens/s",
            gap_text(paired_test(values("mla", train("tokens_per_s")), values("llama", train("tokens_per_s")))),
        ],
    ]
    for kind in KINDS:
        diff = paired_test(values(kind, measured("eagle3")), values(kind, measured("ngram")))
        tests.append([f"{kind} - prompt lookup", "measured acceptance", gap_text(diff)])
    every = [results[k][s] for k in KINDS for s in seeds]
    first = every[0]
    d = first["data"]
    loads = [
        x for r in every for x in (r["machine"]["loadavg"]["before"][0], r["machine"]["loadavg"]["after_bench"][0])
    ]
    lossless = all(r["bench"]["lossless"] for r in every)
    notes = (
        f"Data: {d['sequences']} sequences, {d['tokens']:,} tokens ({d['generated_tokens']:,} generated), "
        f"{d['heldout_sequences']} held out at each seed; {d['bench_prompts']} bench prompts. Recipe (both kinds): "
        + ", ".join(f"{k} {v}" for k, v in first["recipe"].items())
        + "; bench: "
        + ", ".join(f"{k} {v}" for k, v in first["bench_settings"].items())
        + f". Code {', '.join(sorted({r['code'] for r in every}))}; {len(every)} kind x seed results, "
        f"{min(r['machine']['date'] for r in every)} to {max(r['machine']['date'] for r in every)}, load average "
        f"(1 min) {min(loads):.1f}-{max(loads):.1f} on {first['machine']['cpu_count']} cores; every decode lossless: "
        f"{lossless}."
    )
    return "\n".join(
        [
            f"Mean ± stdev over seeds {', '.join(map(str, seeds))}:",
            "",
            table(head, rows),
            "",
            paired_header(),
            "",
            table(["comparison", "figure", "mean difference [95 % CI], p"], tests),
            "",
            notes,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data", help="build the target and the study's data with the pipeline in --work")
    data.add_argument("--work", type=Path, required=True)
    data.add_argument("--prompts", type=int, default=960, help="prompts generated (bench prompts included)")
    data.add_argument("--bench-prompts", type=int, default=24)
    data.add_argument("--cores", type=int, default=1)
    for name, helptext in (("run", "train and bench every kind x seed not done"), ("one", "one kind x seed")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--work", type=Path, required=True)
        p.add_argument("--out", type=Path, default=OUT)
        p.add_argument("--threads", type=int, default=1)
        if name == "run":
            p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
            p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
        else:
            p.add_argument("--kind", choices=KINDS, required=True)
            p.add_argument("--seed", type=int, required=True)
    tab = sub.add_parser("table", help="print the markdown table of the JSON under --out")
    tab.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if args.command == "data":
        make_data(args)
    elif args.command == "run":
        run_all(args)
    elif args.command == "one":
        train_and_bench(
            args.work.resolve(), args.kind, args.seed, result_path(args.out, args.kind, args.seed), args.threads
        )
    else:
        print(kinds_table(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
