"""Build the demo target folder: tokenizer + pre-trained LlamaForCausalLM + build report, published atomically.

python -m aerie.targets.demo.build OUT_DIR [--steps N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GenerationConfig

from aerie.target_model.model import set_threads
from aerie.targets.demo.config import DemoTargetConfig
from aerie.targets.demo.pretrain import (
    TOKENIZER_SEED_OFFSET,
    build_model,
    evaluate,
    pretrain,
)
from aerie.targets.demo.tokenizer import END_OF_TURN, special_token_ids, tokenizer_corpus, train_tokenizer
from aerie.targets.pretraining import PretrainingConfig
from aerie.tools.artifacts import publish_folder

REPORT_FILE = "aerie_demo_target.json"
REPORT_FORMAT = "aerie.demo-target/1"


def build_demo_target(out_dir: str | Path, cfg: DemoTargetConfig, log: Callable[[str], None] = print) -> dict:
    """Train tokenizer and model, evaluate, and publish a save_pretrained folder at ``out_dir``.

    Everything is written to ``out_dir.tmp`` first and renamed at the end, so ``out_dir`` is either absent
    or complete. Returns the report also written to ``out_dir/aerie_demo_target.json``.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    t_start = time.perf_counter()
    set_threads(cfg.threads)

    t = time.perf_counter()
    tokenizer = train_tokenizer(
        tokenizer_corpus(cfg.tokenizer_examples, cfg.seed + TOKENIZER_SEED_OFFSET, cfg.tokenizer_stdlib_chars),
        vocab_size=cfg.vocab_size,
        model_max_length=cfg.max_position_embeddings,
    )
    ids = special_token_ids(tokenizer)
    tokenizer_seconds = time.perf_counter() - t
    log(f"tokenizer: {len(tokenizer)} tokens ({tokenizer_seconds:.1f}s)")

    model = build_model(cfg, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: LlamaForCausalLM {cfg.num_hidden_layers}L x {cfg.hidden_size}, {n_params / 1e6:.2f}M params")
    train_stats = pretrain(model, tokenizer, cfg, log)
    metrics = evaluate(model, tokenizer, cfg, log)

    model.generation_config = GenerationConfig(
        bos_token_id=ids["[BOS]"],
        eos_token_id=ids[END_OF_TURN],
        pad_token_id=ids["[PAD]"],
    )
    model.save_pretrained(tmp)  # fp32: autocast never changed the stored weights
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json (docs/formats.md).
    tokenizer.save_pretrained(tmp, save_jinja_files=False)

    report = {
        **report_opening(REPORT_FORMAT, cfg),
        "tokenizer": {"vocab_size": len(tokenizer), "special_token_ids": ids, "seconds": round(tokenizer_seconds, 2)},
        "model": {"architecture": "LlamaForCausalLM", "parameters": n_params, "dtype": "float32"},
        "train": train_stats,
        "metrics": metrics,
    }
    return publish_target(tmp, out_dir, report, REPORT_FILE, cfg.threads, t_start, log)


def report_opening(report_format: str, cfg: PretrainingConfig) -> dict:
    """The first fields of a target's build report: its format, the whole build config (a dataclass) and the
    pre-training corpus (the demo's task language, ``cfg.families`` from ``cfg.seed``)."""
    return {
        "format": report_format,
        "config": dataclasses.asdict(cfg),
        "corpus": {
            "kind": "synthetic tasks (aerie.sources.synthetic)",
            "families": list(cfg.families),
            "train_seed": cfg.seed,
            "loss_on": "assistant completion tokens (reasoning, </think>, answer, <|im_end|>)",
        },
    }


def publish_target(
    tmp: Path, out_dir: Path, report: dict, report_file: str, threads: int, started: float, log: Callable[[str], None]
) -> dict:
    """Finish a target folder built at ``tmp``: stamp its build report (torch version, threads, seconds since
    ``started``), write it into the folder as ``report_file``, publish the folder as ``out_dir`` (never partial:
    ``publish_folder``) and return the report."""
    report.update(torch=torch.__version__, threads=threads, seconds=round(time.perf_counter() - started, 2))
    (tmp / report_file).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    publish_folder(tmp, out_dir)
    log(f"wrote {out_dir} in {report['seconds']:.0f}s")
    return report


def parse_build_args(description: str, argv: list[str] | None = None) -> tuple[Path, dict[str, int]]:
    """The target builders' command line: ``OUT_DIR [--steps N] [--seed N] [--threads N]``, as the output folder
    and the config fields to override (``train_steps``, ``seed``, ``threads``; unset ones keep the defaults)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, help="pre-training steps (default: the config's train_steps)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args(argv)
    given = {"train_steps": args.steps, "seed": args.seed, "threads": args.threads}
    return args.out_dir, {k: v for k, v in given.items() if v is not None}


def main(argv: list[str] | None = None) -> None:
    out_dir, overrides = parse_build_args("Build the aerie demo target (tiny Llama on synthetic tasks).", argv)
    report = build_demo_target(out_dir, dataclasses.replace(DemoTargetConfig(), **overrides))
    m = {k: v for k, v in report["metrics"].items() if k != "samples"}
    print(json.dumps(m, indent=2))


if __name__ == "__main__":
    main()
