"""Warm start at toy scale: a "published" drafter trained by a separate run on a large general set and handed over
only as a folder; then the user's small domain set, trained from scratch and warm-started from that folder
(``drafter.init``) with and without the issue-37 recipe; every drafter benchmarked per set, in the same process, on
the same prompts.

One command per study, on a fresh clone (everything under --work; the demo target is built once there, by the
first study, and every later study uses that same folder):

    .venv/bin/python bench/warm_start.py study --work /tmp/aerie-ws --study shifted --arms scratch warm recipe
    .venv/bin/python bench/warm_start.py study --work /tmp/aerie-ws --study covered --arms warm recipe
    .venv/bin/python bench/tables.py              # the RESULTS tables from bench/results/warm_start/recipe-STUDY/

``study`` = ``data`` (if not there) + ``publish`` + ``run``, each also a command of its own (``one`` runs one seed).
- ``data`` runs this checkout's pipeline twice under WORK/STUDY/: the publisher's run (``publisher_config``: a
  general set of the demo's task language, ``--general`` prompts of the study's families, ``--bench-prompts`` held
  out, responses, hidden states, a counted draft vocab) and the user's run (``user_config``: the domain - real
  HumanEval prompts, ``--bench-prompts`` held out and ONE training shard of ``--domain`` answers - and ``--replay``
  general answers of another seed, the user's replay data: what ``kimi_mtp`` is to a Kimi user).
- ``publish`` trains the published drafter on the publisher's data at each of PUBLISHER_SEEDS (WORK/STUDY/
  published-N); user seed k starts from, and is paired with, publisher seed k mod 3, so the paired tests see the
  publisher's seed too.
- ``run`` trains, per seed, the user's arms (STUDY_ARMS; ``--arms`` picks): ``scratch`` (its own counted draft
  vocab), ``warm`` (the folder's vocab, a fine-tuning schedule), ``recipe`` (warm + the vocabulary following the
  data + replay at REPLAY_SHARE + the epoch chosen on the TRAFFIC mix), the one-lever ablations ``warm-vocab``,
  ``warm-replay``, ``warm-weighting`` and ``recipe-eagle31`` (the recipe with EAGLE 3.1's switches, norms from 1);
  then benchmarks the published drafter, every arm and prompt lookup (``ngram``) on both sets' held-out prompts (the
  first ``BENCH["max_prompts"]`` of each) with aerie's in-process speculative decoding (greedy chain drafting,
  lossless verification against the plain target's greedy output). One JSON per seed (``--out``, default
  bench/results/warm_start/recipe-STUDY/), written when the seed finishes; a finished seed is never recomputed; a
  seed file of other settings is refused.

The issue-28 studies (``FORMAT``: one published folder at seed 0; bench/results/warm_start/{covered,levers,
levers-strong}/) are still rendered by ``warm_start_table``. Acceptance length (tokens committed per verify step,
the bonus included, as SGLang's ``spec_accept_length``) is the measure; tokens/s is kept but the machine is
shared, so speed says little here.
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

FORMAT = "aerie.bench.warm-start/1"  # the issue-28 studies: one published folder (seed 0)
FORMAT2 = "aerie.bench.warm-start/2"  # issue 37: published at PUBLISHER_SEEDS, replay data, the recipe's levers
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
# The recipe (issue 37) and its ablations: the plain warm start plus one lever each, all three, and EAGLE 3.1.
# - vocabulary: the published draft vocabulary follows the user's data (vocab.warm_start: follow; counted over the
#   run's data, domain and replay): ids it never uses replaced by the most frequent it lacks, new lm_head rows from
#   the target's;
# - replay: the user's general answers (the ``general`` dataset of the user's run, another seed of the study's
#   general families: the analogue of kimi_mtp) mixed into every epoch at REPLAY_SHARE of its windows;
# - weighting: the best epoch chosen on the held-out mix TRAFFIC (the general dataset's held-out split stands for
#   the general set's traffic; its training windows are not used without replay).
TRAFFIC = {DOMAIN: 0.7, GENERAL: 0.3}  # the user's stated traffic: mostly the domain
REPLAY_SHARE = 0.5
LEVER_FLAGS = {  # arm -> (vocabulary follows the data, replay share, traffic-weighted epoch choice)
    "warm-vocab": (True, 0.0, False),
    "warm-replay": (False, REPLAY_SHARE, False),
    "warm-weighting": (False, 0.0, True),
    "recipe": (True, REPLAY_SHARE, True),
    "recipe-eagle31": (True, REPLAY_SHARE, True),
}
RECIPE_ARMS = {arm: dict(ARMS["warm"]) for arm in LEVER_FLAGS}
RECIPE_ARMS["recipe-eagle31"].update(fc_norm=True, norm_output=True)  # EAGLE 3.1's switches, norms starting at 1
ALL_ARMS = {**ARMS, **LEVERS, **RECIPE_ARMS}
DEFAULT_ARMS = list(ARMS)
STUDY_ARMS = ["scratch", "warm", "recipe", "warm-vocab", "warm-replay", "warm-weighting", "recipe-eagle31"]


def arm_levers(arm: str) -> dict:
    """What an arm does besides its training keys (recorded with its recipe)."""
    follow, share, weighted = LEVER_FLAGS.get(arm, (False, 0.0, False))
    return {
        "init": "published" if is_warm(arm) else "",
        "vocab": "counted" if not is_warm(arm) else ("follows the data" if follow else "the folder's"),
        "replay_share": share,
        "traffic": TRAFFIC if weighted else None,
    }


BENCH = dict(max_new_tokens=64, num_draft_steps=3, max_prompts=16)  # per set


# The studies: what the publisher's general set holds. ``covered``: all three task families, ``code`` (function
# descriptions, the shape of the user's HumanEval prompts) among them; ``shifted``: no ``code`` - the user's domain is
# new to the published drafter (as Chinese was to LightSeek's phase-1 drafter: CEval 1.48 -> 2.30 after phase 2).
STUDIES = {"covered": ["arith", "lists", "code"], "shifted": ["arith", "lists"]}
# The published drafter is trained at each of these seeds; user seed k starts from (and is compared with) the one
# of publisher seed k mod 3, so the paired tests see the publisher's seed too.
PUBLISHER_SEEDS = (0, 1, 2)


def demo_target(work_root: Path) -> Path:
    """The demo target every study of ``work_root`` shares (built once, by the first study's publisher run)."""
    return work_root / "demo-target"


def target_section(work_root: Path) -> dict:
    """The shared demo target: built at WORK/demo-target by the first study, an existing folder for the next."""
    folder = demo_target(work_root)
    section = {"path": str(folder), "device": "cpu", "dtype": "float32"}
    if not folder.exists():
        section["demo"] = yaml.safe_load(DEMO.read_text())["target"]["demo"]
    return section


def publisher_config(general: int, bench_prompts: int, study: str, target: dict) -> dict:
    demo = yaml.safe_load(DEMO.read_text())
    return {
        "run": "published",
        "target": target,
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


def user_config(target: Path, domain: int, bench_prompts: int, study: str, replay: int) -> dict:
    """The user's run: the domain (HumanEval answers) and the general data replayed against forgetting (the
    target's answers to the study's general task families at another seed: what ``kimi_mtp`` is to a Kimi user)."""
    pub = publisher_config(8, 1, study, {"path": str(target), "device": "cpu", "dtype": "float32"})
    return {
        **pub,
        "run": "user",
        "datasets": {
            DOMAIN: {
                "source": {"kind": "humaneval", "instruction": "describe"},
                "shard_size": domain,
                "bench_prompts": bench_prompts,
            },
            GENERAL: {
                "source": {"kind": "synthetic", "families": STUDIES[study], "count": replay, "seed": 23},
                "shard_size": replay,
                "bench_prompts": 0,
            },
        },
    }


def files(work: Path) -> dict[str, Any]:
    pub, user = work / "publisher" / "results", work / "user" / "results"
    return {
        "target": demo_target(work.parent),
        "general_hidden": sorted(Path(p) for p in glob.glob(str(pub / GENERAL / "hidden" / "shard-*.safetensors"))),
        "general_vocab": pub / "vocab" / "draft_vocab.safetensors",
        "general_bench": pub / GENERAL / "prompts" / "bench.jsonl",
        "domain_hidden": [user / DOMAIN / "hidden" / "shard-00000.safetensors"],
        "domain_tokens": [user / DOMAIN / "tokens" / "shard-00000.safetensors"],
        "domain_bench": user / DOMAIN / "prompts" / "bench.jsonl",
        "replay_hidden": [user / GENERAL / "hidden" / "shard-00000.safetensors"],
        "replay_tokens": [user / GENERAL / "tokens" / "shard-00000.safetensors"],
        "published": {seed: work / f"published-{seed}" for seed in PUBLISHER_SEEDS},
        "scratch_vocab": work / "vocab-scratch.safetensors",
        "warm_vocab": {seed: work / f"vocab-warm-{seed}.safetensors" for seed in PUBLISHER_SEEDS},
        "follow_vocab": {seed: work / f"vocab-follow-{seed}.safetensors" for seed in PUBLISHER_SEEDS},
    }


def snakemake(workdir: Path, configfile: Path, targets: list[str], cores: int) -> None:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir)]
    cmd += ["--configfile", str(configfile), "--cores", str(cores), *targets]
    print(" ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(cmd, check=True, env=env)


def make_data(args: argparse.Namespace) -> None:
    """The study's two pipeline runs (WORK/STUDY/publisher, WORK/STUDY/user) on the shared demo target."""
    work = study_dir(args.work, args.study)
    cfg = publisher_config(args.general, args.bench_prompts, args.study, target_section(args.work.resolve()))
    pub = work / "publisher"
    pub.mkdir(parents=True, exist_ok=True)
    (pub / "study.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    snakemake(pub, pub / "study.yaml", ["--until", "hidden", "draft_vocab"], args.cores)
    snakemake(pub, pub / "study.yaml", [f"results/{GENERAL}/prompts/bench.jsonl"], args.cores)
    f = files(work)
    user = work / "user"
    user.mkdir(parents=True, exist_ok=True)
    (user / "study.yaml").write_text(
        yaml.safe_dump(
            user_config(f["target"], args.domain, args.bench_prompts, args.study, args.replay), sort_keys=False
        )
    )
    outs = [f"results/{DOMAIN}/hidden/shard-00000.safetensors", f"results/{DOMAIN}/prompts/bench.jsonl"]
    snakemake(user, user / "study.yaml", [*outs, f"results/{GENERAL}/hidden/shard-00000.safetensors"], args.cores)


def study_dir(work_root: Path, study: str) -> Path:
    return work_root.resolve() / study


def publish(args: argparse.Namespace) -> None:
    """The published drafter: one folder per publisher seed, each trained once on the general set."""
    import torch

    from aerie.drafter.config import TrainConfig
    from aerie.drafter.loop import train_drafter

    f = files(study_dir(args.work, args.study))
    torch.set_num_threads(args.threads)
    only = getattr(args, "publisher_seed", None)
    for seed, folder in f["published"].items():
        if only is not None and seed != only:
            continue
        if (folder / "eval.json").exists():
            print(f"published seed {seed}: {folder} (done)")
            continue
        cfg = TrainConfig.of(**{**PUBLISH, "seed": seed}, threads=args.threads, resume=False, checkpoint_every=0)
        ev = train_drafter(f["general_hidden"], f["general_vocab"], f["target"], folder, cfg, log=print)
        print(f"published seed {seed}: simulated acceptance {ev['simulated_acceptance_length']:.3f} -> {folder}")


def code_version() -> str:
    from drafter_kinds import code_version as version

    return version()


# ---- one seed --------------------------------------------------------------------------------------------------
def is_warm(arm: str) -> bool:
    """The arms that start from the published folder."""
    return arm.startswith("warm") or arm.startswith("recipe")


def recipes(arms: list[str], levers: bool = False) -> dict:
    """What a seed file records and a rerun must match: the published drafter's recipe and each arm's (with
    ``levers``, the format-2 studies: each arm's levers beside its training keys, the publisher's seeds)."""
    if not levers:
        return {"published": PUBLISH, **{a: ALL_ARMS[a] for a in arms}}
    published = {**PUBLISH, "seeds": list(PUBLISHER_SEEDS)}
    return {"published": published, **{a: {**ALL_ARMS[a], **arm_levers(a)} for a in arms}}


def publisher_seed(seed: int) -> int:
    """The publisher's seed a user seed starts from and is compared with."""
    return PUBLISHER_SEEDS[seed % len(PUBLISHER_SEEDS)]


def trained_before(out: Path, cfg: Any, shards: list[Path], vocab: Path) -> dict | None:
    """The eval.json of a drafter this very recipe already trained into ``out`` on these shards and vocabulary
    (training is deterministic on the CPU: a rerun would write the same folder), else None."""
    try:
        facts = json.loads((out / "config.json").read_text())["aerie"]
        ev = json.loads((out / "eval.json").read_text())
    except (OSError, KeyError, ValueError):
        return None
    same = facts.get("train_config") == json.loads(json.dumps(cfg.section())) and facts.get("draft_vocab") == str(vocab)
    return ev if same and facts.get("hidden_shards") == [str(p) for p in shards] else None


def train_arm(f: dict, arm: str, seed: int, threads: int, work: Path) -> dict:
    from aerie.drafter.config import TrainConfig
    from aerie.drafter.loop import train_drafter

    levers = arm_levers(arm)
    ps = publisher_seed(seed)
    extra: dict[str, Any] = {"init": str(f["published"][ps])} if levers["init"] else {}
    shards = list(f["domain_hidden"])
    if levers["replay_share"] or levers["traffic"]:  # the general answers: replayed, or held out for the choice
        shards += f["replay_hidden"]
        extra.update(replay_dataset=GENERAL, replay_share=levers["replay_share"])
    if levers["traffic"]:
        extra["heldout_weights"] = levers["traffic"]
    cfg = TrainConfig.of(**ALL_ARMS[arm], **extra, seed=seed, threads=threads, resume=False, checkpoint_every=0)
    if not levers["init"]:
        vocab = f["scratch_vocab"]
    else:
        vocab = f["follow_vocab" if levers["vocab"] == "follows the data" else "warm_vocab"][ps]
    out = work / "drafters" / f"{arm}-{seed}"
    ev = trained_before(out, cfg, shards, vocab)  # a seed whose bench failed after training: its drafters stand
    if ev is None:
        ev = train_drafter(shards, vocab, f["target"], out, cfg, log=lambda _: None)
    train = {
        "wall_seconds": ev["seconds"],  # the training run's own (a reused drafter: the earlier run's)
        "optimizer_steps": ev["optimizer_steps"],
        "best_epoch": ev["best_epoch"],
        "heldout_simulated_acceptance": ev["simulated_acceptance_length"],
        "untrained_simulated_acceptance": ev["untrained"]["simulated_acceptance_length"],
        "tokens_per_s": ev["tokens_per_s"],
        "selection": ev.get("selection"),
    }
    if "replay" in ev["windows"]:
        train["replay"] = ev["windows"]["replay"]
    return {"folder": out, "train": train}


def bench_sets(f: dict, folders: dict[str, Path], threads: int, max_prompts: int = BENCH["max_prompts"]) -> dict:
    """Every drafter and prompt lookup on each set's held-out prompts: greedy baseline once per prompt, then each
    method (order rotated per prompt); acceptance from the committed tokens per verify step."""
    import torch

    from aerie.benchmark.prompts import load_bench_prompts
    from aerie.benchmark.speculative import NgramProposer, first_mismatch, greedy_generate, speculative_generate
    from aerie.drafter_kinds.eagle3.drafting import EagleProposer
    from aerie.drafter_kinds.eagle3.model import Eagle3Drafter
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
        prompts = load_bench_prompts([prompt_file], max_prompts)
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


def data_facts(f: dict, seed: int | None = None) -> dict:
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

    def fingerprint(paths: list[Path], vocab: Path) -> Any:
        return data_fingerprint(paths, vocab, f["target"], [1, 3, 4])["hidden_shards"]

    if seed is None:  # format 1: one published folder
        return {
            "general": about(f["general_hidden"]),
            "domain": about(f["domain_hidden"]),
            "domain_fingerprint": fingerprint(f["domain_hidden"], f["scratch_vocab"]),
            "published_fingerprint": fingerprint(f["general_hidden"], f["general_vocab"]),
            "vocab": {
                "scratch": load_draft_vocab(f["scratch_vocab"]).meta,
                "warm": load_draft_vocab(f["warm_vocab"]).meta,
            },
        }
    ps = publisher_seed(seed)
    return {
        "general": about(f["general_hidden"]),
        "domain": about(f["domain_hidden"]),
        "replay": about(f["replay_hidden"]),
        "domain_fingerprint": fingerprint(f["domain_hidden"], f["scratch_vocab"]),
        "replay_fingerprint": fingerprint(f["replay_hidden"], f["scratch_vocab"]),
        "published_fingerprint": fingerprint(f["general_hidden"], f["general_vocab"]),
        "publisher_seed": ps,
        "vocab": {
            "scratch": load_draft_vocab(f["scratch_vocab"]).meta,
            "warm": load_draft_vocab(f["warm_vocab"][ps]).meta,
            "follow": load_draft_vocab(f["follow_vocab"][ps]).meta,
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
    wanted = arms_wanted or STUDY_ARMS
    order = list(wanted) if seed % 2 == 0 else list(reversed(wanted))  # who trains first alternates
    arms = {arm: train_arm(f, arm, seed, threads, work) for arm in order}
    load["after_training"] = os.getloadavg()
    published = f["published"][publisher_seed(seed)]
    sets = bench_sets(f, {"published": published, **{a: arms[a]["folder"] for a in wanted}}, threads)
    load["after_bench"] = os.getloadavg()
    result = {
        "format": FORMAT2,
        "seed": seed,
        "study": study_of(work),
        "general_families": STUDIES[study_of(work)],
        "recipes": recipes(wanted, levers=True),
        "traffic": TRAFFIC,
        "bench_settings": BENCH,
        "draft_vocab_size": DRAFT_VOCAB,
        "data": data_facts(f, seed),
        "train": {a: arms[a]["train"] for a in wanted},
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
    """The user's vocabularies: counted on the domain shard (scratch); per publisher seed, the published folder's
    own (warm) and the folder's after following the run's data, domain and replay (the recipe)."""
    from aerie.target_model.config import read_text_config
    from aerie.vocab.draft_vocab import build_draft_vocab, draft_vocab_from_folder
    from aerie.vocab.settings import VocabSettings

    f = files(work)
    vocab_size = int(read_text_config(f["target"])["vocab_size"])
    if not f["scratch_vocab"].exists():
        build_draft_vocab(
            f["domain_tokens"],
            f["scratch_vocab"],
            target_vocab_size=vocab_size,
            draft_vocab_size=DRAFT_VOCAB,
            log=print,
        )
    follow = VocabSettings(draft_vocab_size=DRAFT_VOCAB, warm_start="follow")
    tokens = f["domain_tokens"] + f["replay_tokens"]
    for ps, folder in f["published"].items():  # the publisher seeds trained so far
        if not (folder / "eval.json").exists():
            continue
        if not f["warm_vocab"][ps].exists():
            draft_vocab_from_folder(f["domain_tokens"], f["warm_vocab"][ps], target_path=f["target"], init=str(folder))
        if not f["follow_vocab"][ps].exists():
            draft_vocab_from_folder(tokens, f["follow_vocab"][ps], target_path=f["target"], init=str(folder),
                                    settings=follow)  # fmt: skip


def run_all(args: argparse.Namespace) -> None:
    work = study_dir(args.work, args.study)
    arms = args.arms or STUDY_ARMS
    out = args.out or OUT / f"recipe-{args.study}"
    todo = []
    for seed in args.seeds:  # a finished seed of other settings is refused before anything runs
        path = out / f"seed-{seed}.json"
        if not path.exists():
            todo.append(seed)
            continue
        done = json.loads(path.read_text())
        if done["recipes"] != recipes(arms, levers=True) or done["bench_settings"] != BENCH:
            raise SystemExit(f"{path} was made with other settings: use another --out")
        print(f"{path.name}: done", flush=True)
    if todo:
        prepare_vocabs(work)
    for seed in todo:
        path = out / f"seed-{seed}.json"
        cmd = [sys.executable, __file__, "one", "--work", str(args.work), "--study", args.study, "--seed", str(seed)]
        cmd += ["--out", str(out), "--threads", str(args.threads), "--arms", *arms]
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


def study(args: argparse.Namespace) -> None:
    """One command, a fresh clone: the data (both pipeline runs; the demo target built once under --work and shared
    by every study), the published drafters, then every seed."""
    work = study_dir(args.work, args.study)
    if not (work / "user" / "results" / GENERAL / "hidden" / "shard-00000.safetensors").exists():
        make_data(args)
    publish(args)
    run_all(args)


# ---- the table (torch-free: bench/tables.py) -----------------------------------------------------------------
def methods_of(result: dict) -> list[str]:
    """The published drafter, the seed's arms in recipe order, prompt lookup."""
    return ["published", *(a for a in result["recipes"] if a != "published"), "ngram"]


def load_results(out: Path) -> dict[int, dict]:
    results = {}
    for path in sorted(out.glob("seed-*.json")):
        r = json.loads(path.read_text())
        if r.get("format") not in (FORMAT, FORMAT2):
            raise SystemExit(f"{path}: format {r.get('format')!r}, not {FORMAT} or {FORMAT2}")
        results[r["seed"]] = r
    return results


def warm_start_table(out: Path = OUT) -> str:
    from paired_stats import paired_test
    from tables import gap_text, paired_header, spread, table

    results = load_results(out)
    if not results:
        raise SystemExit(f"{out}: no seed finished")
    if any(r["format"] == FORMAT2 for r in results.values()):
        return recipe_table(results)
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
        + merged_note(results)
        + f". Code {', '.join(sorted(codes_of(results)))}; load average (1 min) "
        f"{min(loads):.1f}-{max(loads):.1f} on {r0['machine']['cpu_count']} cores; every decode lossless: {lossless}."
    )
    return (
        f"Mean ± stdev over seeds {', '.join(map(str, seeds))}:\n\n"
        + table(head, rows)
        + "\n\n"
        + paired_header()
        + "\n\n"
        + table(["comparison", "set", "difference"], tests)
        + "\n\n"
        + notes
        + "\n"
    )


def merge_arms(source: Path, into: Path) -> None:
    """Add the arms of ``source``'s seed files (a later run of more arms on the same study) to ``into``'s: refused
    unless both measured the same published drafter and prompt lookup to the same figures on every set (the same
    data, publisher seed, prompts and bench settings: deterministic decoding gives equal figures)."""
    for path in sorted(source.glob("seed-*.json")):
        extra, target = json.loads(path.read_text()), into / path.name
        if not target.exists():
            raise SystemExit(f"{target}: no such seed in {into} to add {path}'s arms to")
        base = json.loads(target.read_text())
        for key in ("format", "seed", "study", "bench_settings", "traffic"):
            if extra[key] != base[key]:
                raise SystemExit(f"{path} and {target} differ in {key}: not the same study")
        if extra["data"]["publisher_seed"] != base["data"]["publisher_seed"]:
            raise SystemExit(f"{path} and {target} start from different published drafters")
        for s, st in base["sets"].items():
            for m in ("published", "ngram"):
                a, b = st["methods"][m]["acceptance_length"], extra["sets"][s]["methods"][m]["acceptance_length"]
                if abs(a - b) > 1e-9:
                    raise SystemExit(f"{path}: {m} measured {b} on {s}, {target} {a}: not the same measurement")
        arms = [a for a in extra["recipes"] if a != "published" and a not in base["recipes"]]
        for arm in arms:
            base["recipes"][arm] = extra["recipes"][arm]
            base["train"][arm] = extra["train"][arm]
            for s in base["sets"]:
                base["sets"][s]["methods"][arm] = extra["sets"][s]["methods"][arm]
        base.setdefault("merged", []).append({"arms": arms, "code": extra["code"], "machine": extra["machine"]})
        target.write_text(json.dumps(base, indent=1) + "\n")
        print(f"{target.name}: added {', '.join(arms) or 'nothing'} from {path}")


# The goals of issue 37, each "within the spread or better": (study, arm, reference, set).
GOALS = {
    "shifted": [("recipe", "scratch", DOMAIN), ("recipe", "published", GENERAL)],
    "covered": [("recipe", "published", DOMAIN), ("recipe", "published", GENERAL)],
}
MIX = "traffic mix"


def recipe_table(results: dict[int, dict]) -> str:
    """The format-2 study: every drafter per set and on the traffic mix, the paired tests (each arm against the
    published drafter of its publisher seed, the recipe against scratch, each lever and EAGLE 3.1 against the arm
    it adds to), the issue's goals checked, and what the runs trained on."""
    from paired_stats import paired_test
    from tables import gap_text, paired_header, spread, table

    seeds = sorted(results)
    r0 = results[seeds[0]]
    if any(list(r["recipes"]) != list(r0["recipes"]) or r["format"] != FORMAT2 for r in results.values()):
        raise SystemExit("seed files of different arms or formats in one study")
    sets, traffic = list(r0["sets"]), r0["traffic"]
    arms = [a for a in r0["recipes"] if a != "published"]

    def acc(s: str, m: str) -> list[float]:
        if s == MIX:
            return [sum(w * float(results[k]["sets"][x]["methods"][m]["acceptance_length"]) for x, w in traffic.items())
                    for k in seeds]  # fmt: skip
        return [float(results[k]["sets"][s]["methods"][m]["acceptance_length"]) for k in seeds]

    columns = [*sets, MIX]
    rows = [[f"`{m}`", *(spread(acc(s, m)) for s in columns)] for m in methods_of(r0)]
    head = ["drafter", *(f"{s} set" for s in sets), f"{MIX} ({', '.join(f'{s} {w}' for s, w in traffic.items())})"]
    pairs = [(a, "published") for a in arms]
    pairs += [(a, "scratch") for a in arms if a != "scratch" and "scratch" in arms]
    pairs += [(a, "warm") for a in arms if a.startswith("warm-") and "warm" in arms]
    pairs += [("recipe", a) for a in arms if a.startswith("warm-") and "recipe" in arms]
    if {"recipe", "recipe-eagle31"} <= set(arms):
        pairs.append(("recipe-eagle31", "recipe"))
    tests = [[f"{a} - {b}", s, gap_text(paired_test(acc(s, a), acc(s, b)))] for s in columns for a, b in pairs]
    goals = []
    for arm, ref, s in GOALS.get(r0["study"], []):
        if arm in arms and (ref in arms or ref == "published"):
            t = paired_test(acc(s, arm), acc(s, ref))
            holds = t["mean_diff"] >= 0 or t["p"] >= 0.05
            goals.append([f"{arm} >= {ref} on the {s} set", gap_text(t), "**holds**" if holds else "**does not hold**"])
    parts = [
        f"Mean ± stdev over seeds {', '.join(map(str, seeds))} (measured acceptance length):",
        table(head, rows),
        paired_header(len(tests)),
        table(["comparison", "set", "difference"], tests),
    ]
    if goals:
        parts += [
            "Issue 37's goals (each within the spread or better):",
            table(["goal", "difference", "verdict"], goals),
        ]
    parts.append(recipe_notes(results, arms))
    return "\n\n".join(parts) + "\n"


def codes_of(results: dict[int, dict]) -> set[str]:
    return {r["code"] for r in results.values()} | {m["code"] for r in results.values() for m in r.get("merged", [])}


def merged_note(results: dict[int, dict]) -> str:
    """Which arms a later run added (``merge``), its published and prompt-lookup figures equal to the first's."""
    arms = sorted({a for r in results.values() for m in r.get("merged", []) for a in m["arms"]})
    if not arms:
        return ""
    return (
        f". Arms {', '.join(arms)} were trained and benchmarked by a later run of the same seeds (bench/warm_start.py "
        "merge: its published drafter and prompt lookup measured the same figures on every set)"
    )


def recipe_notes(results: dict[int, dict], arms: list[str]) -> str:
    """One paragraph: the data, vocabularies, epoch choice, replay, recipes, code, load, losslessness."""
    seeds = sorted(results)
    r0 = results[seeds[0]]
    d = r0["data"]

    def per_seed(fn) -> str:
        return "/".join(str(fn(results[k])) for k in seeds)

    def vocab(name: str, key: str = "coverage") -> str:
        return per_seed(lambda r: f"{r['data']['vocab'][name][key]:.3f}")

    halfwidths = [
        r["train"][a]["selection"]["halfwidth_95"]
        for r in results.values()
        for a in arms
        if (r["train"][a].get("selection") or {}).get("halfwidth_95") is not None
    ]
    replay = next((r0["train"][a]["replay"] for a in arms if "replay" in r0["train"][a]), None)
    lossless = all(v["lossless"] for r in results.values() for st in r["sets"].values() for v in st["methods"].values())
    loads = [x for r in results.values() for x in (r["machine"]["loadavg"][k][0] for k in ("before", "after_bench"))]
    return (
        f"Study `{r0['study']}` (the published drafter's general set: {', '.join(r0['general_families'])}). Seeds "
        f"{', '.join(map(str, seeds))}; publisher seed of each (the published drafter it starts from and is paired "
        f"with): {per_seed(lambda r: r['data']['publisher_seed'])}. Data: general {d['general']['sequences']} "
        f"sequences ({d['general']['generated_tokens']:,} generated tokens), the publisher's; domain "
        f"{d['domain']['sequences']} HumanEval answers ({d['domain']['generated_tokens']:,}); replay "
        f"{d['replay']['sequences']} general answers of another seed ({d['replay']['generated_tokens']:,}), the "
        f"user's; " + ", ".join(f"{s} {r0['sets'][s]['prompts']} held-out prompts" for s in r0["sets"]) + ". "
        f"Draft vocab {r0['draft_vocab_size']} ids; coverage of the domain answers per seed: counted (scratch) "
        f"{vocab('scratch')}, the published folder's (warm) {vocab('warm')}; following the data (domain + replay "
        f"counted): {vocab('follow', 'coverage_before')} -> {vocab('follow')} of those tokens, "
        f"{per_seed(lambda r: r['data']['vocab']['follow'].get('replaced'))} ids replaced. Best held-out epoch: "
        + "; ".join(
            f"{a} {per_seed(lambda r, a=a: r['train'][a]['best_epoch'])} of {r0['recipes'][a]['epochs']}" for a in arms
        )  # fmt: skip
        + (
            f". Traffic-weighted epoch choice: 95 % half-width of its figure {min(halfwidths):.3f}-"
            f"{max(halfwidths):.3f} (a floor; separating drafters 0.05 apart needs <= 0.035: the split is too small "
            "here, as the run's warning says)"
            if halfwidths
            else ""
        )
        + (
            f". Replay: {replay['windows_per_epoch']} of the {replay['pool_windows']} general windows per epoch beside "
            f"{replay['own_windows_per_epoch']} domain windows (share {replay['share']})"
            if replay
            else ""
        )
        + ". Recipes: "
        + "; ".join(f"{a} " + ", ".join(f"{k} {v}" for k, v in r0["recipes"][a].items()) for a in r0["recipes"])
        + "; bench "
        + ", ".join(f"{k} {v}" for k, v in r0["bench_settings"].items())
        + merged_note(results)
        + f". Code {', '.join(sorted(codes_of(results)))}; load average (1 min) "
        f"{min(loads):.1f}-{max(loads):.1f} on {r0['machine']['cpu_count']} cores; every decode lossless: {lossless}."
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    parsers = {name: sub.add_parser(name) for name in ("study", "data", "publish", "run", "one", "table", "merge")}
    parsers["merge"].add_argument("--source", type=Path, required=True, help="seed files with the arms to add")
    parsers["merge"].add_argument("--into", type=Path, required=True, help="the study's seed files")
    for name, p in parsers.items():
        if name in ("table", "merge"):
            continue
        p.add_argument("--work", type=Path, required=True, help="the studies' folder (the demo target is shared)")
        p.add_argument("--study", choices=sorted(STUDIES), default="covered")
    for p in (parsers["study"], parsers["data"]):
        p.add_argument("--general", type=int, default=384)
        p.add_argument("--domain", type=int, default=48)
        p.add_argument("--bench-prompts", type=int, default=24)
        p.add_argument("--cores", type=int, default=1)
        p.add_argument("--replay", type=int, default=96, help="general answers the user replays against forgetting")
    for p in (parsers["study"], parsers["publish"], parsers["run"], parsers["one"]):
        p.add_argument("--threads", type=int, default=1)
    for p in (parsers["study"], parsers["run"], parsers["one"]):
        p.add_argument("--arms", nargs="+", choices=sorted(ALL_ARMS), default=None)
        p.add_argument("--out", type=Path, default=None, help="default: bench/results/warm_start/recipe-STUDY")
    for p in (parsers["study"], parsers["run"]):
        p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parsers["one"].add_argument("--seed", type=int, required=True)
    parsers["publish"].add_argument("--publisher-seed", type=int, choices=PUBLISHER_SEEDS, help="train only this one")
    parsers["table"].add_argument("--out", type=Path, default=OUT / "recipe-shifted")
    args = ap.parse_args(argv)
    if args.cmd == "study":
        study(args)
    elif args.cmd == "data":
        make_data(args)
    elif args.cmd == "publish":
        publish(args)
    elif args.cmd == "run":
        run_all(args)
    elif args.cmd == "merge":
        merge_arms(args.source, args.into)
    elif args.cmd == "one":
        out = args.out or OUT / f"recipe-{args.study}"
        prepare_vocabs(study_dir(args.work, args.study))
        run_seed(study_dir(args.work, args.study), args.seed, out / f"seed-{args.seed}.json", args.threads, args.arms)
    else:
        print(warm_start_table(args.out))


if __name__ == "__main__":
    main()
