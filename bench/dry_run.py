"""Parse-time cost of `snakemake -n` against Snakemake's own empty workflow, measured interleaved.

Two cases:

- a finished demo workdir (the shrunk e2e config): ``bench/dry_run.py WORKDIR [--configfile FILE]``;
- the Kimi config at the real datasets' sizes (issue 22): ``bench/dry_run.py WORKDIR --real-size DATA``
  writes stand-in prompt files of the five Hub datasets' real row counts and shapes under DATA (ShareGPT
  94,145 conversations, UltraChat 207,865, Magicoder 75,197, GSM8K 7,473, Hermes function calling 1,893,
  MT-bench 80; ~0.4 GB of generated text, seeded; reused when already there), and config/kimi-k2.5.yaml with
  each named source replaced by its local file (same shape, field and id settings) in WORKDIR, then times
  ``snakemake -n`` of that config: the first parse (fresh HF_HOME: ``datasets`` converts the files; aerie
  fills its prompt cache), the parses after it, and a job's own run (``--mode remote --target-jobs``, as every
  SLURM job re-reads the workflow before it runs: here the one-second bench_prompts job), and counts the jobs.
  ``--compare-snakefile OLD/Snakefile`` times another checkout (``git archive``) of the workflow interleaved.

Every command runs in its own process, interleaved with the others, so load from other work hits all alike;
medians of wall and CPU seconds (user + sys of the child: less sensitive to a busy machine than wall) are
printed, and ``--json FILE`` keeps every sample with ``uptime``'s load; ``--table FILE`` prints the RESULTS.md
table of a saved run again (bench/results/dry_run.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
EMPTY_WORKFLOW = "rule all:\n    input: []\n"

# The Hub datasets of config/kimi-k2.5.yaml at their public sizes (rows), file kinds and columns.
REAL_SIZES = {"sharegpt": 94_145, "ultrachat": 207_865, "code": 75_197, "math": 7_473, "tool_use": 1_893, "mtbench": 80}


# ---- stand-in prompt files -----------------------------------------------------------------------------------


class _Text:
    """Seeded English-like text from a fixed word list: paragraphs of about ``chars`` characters, each led by a
    unique tag so no two prompts are equal (the real sets are deduplicated on the way in)."""

    WORDS = (
        "the of and to in is that for it as with was on be by this are or from at an which have not can but "
        "function value list return string number data model code file error python write explain example how "
        "what why when use using create make find given each step first then result output input user system "
        "question answer problem solution test class method variable loop array table query server client "
        "request response time memory thread process network image text word sentence story character "
        "history science math equation proof theorem graph tree node edge path cost price market company "
        "product customer service design plan project team meeting report summary review analysis research"
    ).split()

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.sentences = [
            " ".join(self.rng.choices(self.WORDS, k=self.rng.randint(6, 22))).capitalize() + "." for _ in range(4000)
        ]

    def paragraph(self, tag: str, chars: int) -> str:
        parts, n = [tag], len(tag)
        while n < chars:
            s = self.sentences[self.rng.randrange(len(self.sentences))]
            parts.append(s)
            n += len(s) + 1
        return " ".join(parts)

    def length(self, mean: int) -> int:
        return max(20, int(self.rng.expovariate(1 / mean)))


def _sharegpt_turns(text: _Text, tag: str, pairs: int, user_chars: int, answer_chars: int) -> list[dict[str, str]]:
    turns = []
    for t in range(pairs):
        turns.append({"from": "human", "value": text.paragraph(f"{tag} q{t}", text.length(user_chars))})
        turns.append({"from": "gpt", "value": text.paragraph(f"{tag} a{t}", text.length(answer_chars))})
    return turns


def write_stand_ins(data: Path, scale: float = 1.0) -> dict[str, Path]:
    """The six prompt files in the Hub datasets' shapes (``scale`` shrinks the row counts for a quick try).

    sharegpt: ShareGPT_V3_unfiltered_cleaned_split.json (a JSON list of {id, conversations: [{from, value}]}, some
    empty); ultrachat: train_sft parquet {prompt, prompt_id, messages: [{content, role}]}; code: Magicoder's jsonl
    {lang, raw_index, index, seed, openai_fingerprint, problem, solution}; math: GSM8K main train parquet
    {question, answer}; tool_use: Hermes func-calling-singleturn.json (a JSON list, tools in the system turn);
    mtbench: {prompt: [two turns], prompt_id, category}. Written once: a file already there is kept."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data.mkdir(parents=True, exist_ok=True)
    rows = {name: max(1, int(n * scale)) if name != "mtbench" else n for name, n in REAL_SIZES.items()}
    files = {
        "sharegpt": data / "ShareGPT_V3_unfiltered_cleaned_split.json",
        "ultrachat": data / "ultrachat_train_sft.parquet",
        "code": data / "data-oss_instruct-decontaminated.jsonl",
        "math": data / "gsm8k_main_train.parquet",
        "tool_use": data / "func-calling-singleturn.json",
        "mtbench": data / "mt_bench_prompts.jsonl",
    }
    text = _Text(22)
    if not files["sharegpt"].exists():
        convs = []
        for i in range(rows["sharegpt"]):
            pairs = 0 if i % 97 == 0 else 1 + min(7, int(text.rng.expovariate(1 / 1.5)))
            convs.append({"id": f"sg{i}", "conversations": _sharegpt_turns(text, f"sharegpt {i}", pairs, 300, 700)})
        _write_atomic(files["sharegpt"], json.dumps(convs, ensure_ascii=False))
    if not files["ultrachat"].exists():
        records = []
        for i in range(rows["ultrachat"]):
            msgs = []
            for t in range(1 + min(4, int(text.rng.expovariate(1 / 1.2)))):
                msgs.append({"content": text.paragraph(f"ultrachat {i} q{t}", text.length(180)), "role": "user"})
                msgs.append({"content": text.paragraph(f"ultrachat {i} a{t}", text.length(420)), "role": "assistant"})
            records.append({"prompt": msgs[0]["content"], "prompt_id": f"{i:064x}", "messages": msgs})
        tmp = files["ultrachat"].with_suffix(".tmp")
        pq.write_table(pa.Table.from_pylist(records), tmp)
        tmp.replace(files["ultrachat"])
    if not files["code"].exists():
        lines = []
        for i in range(rows["code"]):
            problem = text.paragraph(f"code problem {i}", text.length(600))
            solution = text.paragraph(f"code solution {i}", text.length(350))
            rec = {"lang": "python", "raw_index": i, "index": i, "seed": text.paragraph("seed", 120)}
            rec |= {"openai_fingerprint": "fp_stand_in", "problem": problem, "solution": solution}
            lines.append(json.dumps(rec, ensure_ascii=False))
        _write_atomic(files["code"], "\n".join(lines) + "\n")
    if not files["math"].exists():
        records = [
            {"question": text.paragraph(f"gsm8k {i}", text.length(240)), "answer": text.paragraph("#### 7", 300)}
            for i in range(rows["math"])
        ]
        tmp = files["math"].with_suffix(".tmp")
        pq.write_table(pa.Table.from_pylist(records), tmp)
        tmp.replace(files["math"])
    if not files["tool_use"].exists():
        convs = []
        for i in range(rows["tool_use"]):
            tools = text.paragraph(f"<tools> tool {i}", 1500) + " </tools>"
            turns = [{"from": "system", "value": "You are a function calling AI model. " + tools}]
            turns += _sharegpt_turns(text, f"hermes {i}", 1, 250, 200)
            convs.append({"id": f"h{i}", "conversations": turns, "category": "c", "subcategory": "s", "task": "t"})
        _write_atomic(files["tool_use"], json.dumps(convs, ensure_ascii=False))
    if not files["mtbench"].exists():
        lines = [
            json.dumps({"prompt": [text.paragraph(f"mt {i}", 300), text.paragraph(f"mt {i} b", 200)], "prompt_id": i})
            for i in range(rows["mtbench"])
        ]
        _write_atomic(files["mtbench"], "\n".join(lines) + "\n")
    return files


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


KIMI = Path("config") / "kimi-k2.5.yaml"


def real_size_config(files: dict[str, Path], out: Path, kimi: Path = REPO / KIMI) -> Path:
    """config/kimi-k2.5.yaml with each named Hub source replaced by its local stand-in (shape, field, id kept)."""
    config = yaml.safe_load(kimi.read_text())
    for name, ds in config["datasets"].items():
        keep = {k: v for k, v in ds["source"].items() if k not in ("name", "config", "split", "revision", "data_files")}
        ds["source"] = {**keep, "data_files": str(files[name])}
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


# ---- timing ---------------------------------------------------------------------------------------------------


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, its output)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return wall, cpu, proc.stdout + proc.stderr


def job_counts(output: str) -> dict[str, int]:
    """The job-stats table of a `snakemake -n` (rule name -> jobs, and total)."""
    return {k: int(v) for k, v in re.findall(r"^(\w+)\s+(\d+)$", output, flags=re.M)}


def real_size(args: argparse.Namespace) -> dict[str, Any]:
    files = write_stand_ins(args.real_size, args.scale)
    sizes = {name: path.stat().st_size for name, path in files.items()}
    workdir = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    snakefiles = {"aerie": REPO / "Snakefile"}
    if args.compare_snakefile:
        snakefiles[args.compare_label] = args.compare_snakefile.resolve()
    # Each checkout plans its own shipped config/kimi-k2.5.yaml (an older schema refuses keys added since).
    configs = {
        name: real_size_config(files, workdir / f"kimi-k2.5-real-size.{name}.yaml", snakefile.parent / KIMI)
        for name, snakefile in snakefiles.items()
    }
    hf_root = Path(tempfile.mkdtemp(prefix="aerie-dry-run-hf-"))
    # The Kimi config's SGLang rules need conda deployment (profiles/gpu-host sets it); a dry run only asks conda
    # what it is, which the tests' stand-in answers (tests/conda_stand_in.py): no conda is installed here.
    sys.path.insert(0, str(REPO / "tests"))
    from conda_stand_in import CONDA_DEPLOYMENT, conda_on_path

    base_env = {k: v for k, v in conda_on_path(hf_root).items() if k != "OPENROUTER_API_KEY"}
    # Each checkout gets its own workdir and HF_HOME: caches of one never serve the other.
    envs = {name: base_env | {"HF_HOME": str(hf_root / name)} for name in snakefiles}
    snakemake = [sys.executable, "-m", "snakemake"]

    def dry(name: str, *extra: str, conda: bool = True) -> list[str]:
        wd = workdir / name
        wd.mkdir(exist_ok=True)
        return [
            *snakemake,
            "-s",
            str(snakefiles[name]),
            "--directory",
            str(wd),
            "--configfile",
            str(configs[name]),
            *(CONDA_DEPLOYMENT if conda else ()),
            *extra,
        ]

    samples: dict[str, list[dict[str, float]]] = {}
    first: dict[str, dict[str, float]] = {}
    counts: dict[str, dict[str, int]] = {}
    try:
        with tempfile.TemporaryDirectory() as empty:
            (Path(empty) / "Snakefile").write_text(EMPTY_WORKFLOW)
            bare = [*snakemake, "-s", str(Path(empty) / "Snakefile"), "--directory", empty, "-n", "--quiet"]
            commands: dict[str, tuple[list[str], dict[str, str]]] = {"empty workflow": (bare, base_env)}
            for name in snakefiles:
                # The first parse: datasets converts the files into a fresh HF_HOME, aerie fills its prompt cache.
                for leftover in (workdir / name / "results" / ".cache", workdir / name / ".snakemake", hf_root / name):
                    shutil.rmtree(leftover, ignore_errors=True)
                wall, cpu, out = timed(dry(name, "-n"), envs[name])
                first[name] = {"wall": wall, "cpu": cpu, "load": load()}
                counts[name] = job_counts(out)
                commands[f"{name} snakemake -n"] = (dry(name, "-n", "--quiet"), envs[name])
                # What a SLURM job runs: Snakemake in remote mode, reading the workflow for one job, here the cheapest
                # (bench_prompts of MT-bench, 80 prompts; conda off: that rule's env would need a real conda).
                job = ("--mode", "remote", "--target-jobs", "bench_prompts:dataset=mtbench")
                job += ("--allowed-rules", "bench_prompts", "--cores", "1")
                commands[f"{name} job re-parse (--mode remote, one job)"] = (dry(name, *job, conda=False), envs[name])
            timed(bare, base_env)
            for _ in range(args.repeats):
                for label, (cmd, env) in commands.items():
                    wall, cpu, _ = timed(cmd, env)
                    samples.setdefault(label, []).append({"wall": wall, "cpu": cpu, "load": load()})
    finally:
        shutil.rmtree(hf_root, ignore_errors=True)
    return {"prompt_files_bytes": sizes, "first_parse": first, "samples": samples, "jobs": counts}


def demo(args: argparse.Namespace) -> dict[str, Any]:
    snakemake = [sys.executable, "-m", "snakemake"]
    aerie = [*snakemake, "-s", str(REPO / "Snakefile"), "--directory", str(args.workdir), "-n", "--quiet"]
    if args.configfile:
        aerie += ["--configfile", str(args.configfile)]
    samples: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as empty:
        (Path(empty) / "Snakefile").write_text(EMPTY_WORKFLOW)
        bare = [*snakemake, "-s", str(Path(empty) / "Snakefile"), "--directory", empty, "-n", "--quiet"]
        timed(aerie), timed(bare)  # warm the page cache and __pycache__
        for _ in range(args.repeats):
            for label, cmd in (("aerie snakemake -n", aerie), ("empty workflow", bare)):
                wall, cpu, _ = timed(cmd)
                samples.setdefault(label, []).append({"wall": wall, "cpu": cpu, "load": load()})
    return {"samples": samples}


def summary(result: dict[str, Any]) -> list[str]:
    lines = []
    bare = statistics.median(s["wall"] for s in result["samples"]["empty workflow"])
    for label, runs in result["samples"].items():
        wall = statistics.median(s["wall"] for s in runs)
        cpu = statistics.median(s["cpu"] for s in runs)
        lines.append(
            f"{label:<44} median wall {wall:6.2f} s (min {min(s['wall'] for s in runs):.2f}), CPU {cpu:6.2f} s, "
            f"{wall / bare:5.2f}x the empty workflow"
        )
    for name, f in result.get("first_parse", {}).items():
        lines.append(f"{name} first parse (fresh caches): wall {f['wall']:.2f} s, CPU {f['cpu']:.2f} s ({f['load']})")
    for name, c in result.get("jobs", {}).items():
        lines.append(f"{name} jobs planned: {c.get('total')} ({', '.join(f'{k} {v}' for k, v in c.items())})")
    if "prompt_files_bytes" in result:
        sizes = result["prompt_files_bytes"]
        lines.append(
            f"prompt files: {sum(sizes.values()) / 1e6:,.0f} MB ("
            + ", ".join(f"{k} {v / 1e6:,.1f} MB" for k, v in sizes.items())
            + ")"
        )
    return lines


def markdown(result: dict[str, Any]) -> str:
    """The RESULTS.md table of one saved run (``--table FILE`` prints it again from the committed JSON)."""
    bare = result["samples"]["empty workflow"]
    bare_wall, bare_cpu = (statistics.median(s[k] for s in bare) for k in ("wall", "cpu"))
    lines = [
        "| command | median wall | min wall | median CPU (user+sys) | wall / empty workflow | CPU / empty workflow |",
        "|---|---|---|---|---|---|",
    ]
    for label, runs in result["samples"].items():
        wall, cpu = (statistics.median(s[k] for s in runs) for k in ("wall", "cpu"))
        lines.append(
            f"| {label} | {wall:.2f} s | {min(s['wall'] for s in runs):.2f} s | {cpu:.2f} s | "
            f"{wall / bare_wall:.2f}x | {cpu / bare_cpu:.2f}x |"
        )
    for name, f in result.get("first_parse", {}).items():
        lines.append(
            f"| {name} snakemake -n, first parse (fresh caches) | {f['wall']:.2f} s | | {f['cpu']:.2f} s | | |"
        )
    lines.append("")
    for name, c in result.get("jobs", {}).items():
        rules = ", ".join(f"{k} {v}" for k, v in c.items() if k != "total")
        lines.append(f"- {name}: {c.get('total')} jobs planned ({rules})")
    sizes = result.get("prompt_files_bytes")
    if sizes:
        files = ", ".join(f"{k} {v / 1e6:,.1f} MB" for k, v in sizes.items())
        lines.append(f"- prompt files: {sum(sizes.values()) / 1e6:,.0f} MB ({files})")
    loads = [s["load"].split("load average: ")[-1] for runs in result["samples"].values() for s in runs]
    lines.append(
        f"- {result['repeats']} interleaved repeats, {result['date']}, {result['cores']} cores; load averages "
        f"during the run: {loads[0]} ... {loads[-1]} (before: {result['load_before'].split('load average: ')[-1]})"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=Path, nargs="?", help="a finished demo, or where the real-size runs work")
    ap.add_argument("--configfile", type=Path, help="the config the demo ran with (default: the workflow's)")
    ap.add_argument("--real-size", type=Path, metavar="DATA", help="stand-in prompt files at the real sizes here")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the stand-ins' row counts (a quick try)")
    ap.add_argument("--compare-snakefile", type=Path, help="another checkout's Snakefile, timed interleaved")
    ap.add_argument("--compare-label", default="before", help="its name in the output")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, help="write every sample here")
    ap.add_argument("--table", type=Path, help="print the RESULTS.md table of a saved --json run and exit")
    args = ap.parse_args()
    if args.table:
        print(markdown(json.loads(args.table.read_text())))
        return
    started = load()
    result = real_size(args) if args.real_size else demo(args)
    result |= {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "load_before": started,
        "load_after": load(),
        "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cores": os.cpu_count(),
    }
    for line in summary(result):
        print(line)
    code = (
        "import sys; import aerie.plan.resolve, aerie.preview.disk, aerie.preview.money; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    heavy = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO).stdout.strip()
    print(f"heavy modules imported at parse time: {heavy}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
