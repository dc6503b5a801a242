"""The responses stage and the preview of recorded datasets (``source.kind: recorded``): the samples that
aerie.sources.recorded read from the target's own answers (kept in the prompt cache) become ``aerie.responses/1``
shards,
with their provenance and cost 0, and ``snakemake -n`` counts them as $0 with their token totals.

The readers live in aerie.sources.recorded (imported by aerie.sources.datasets at conversion); this module reads their
output
through aerie.sources.datasets. Parse time imports it: no torch until a shard is written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from aerie.formats.responses import RESPONSES_FORMAT
from aerie.sources.datasets import read_prompts, recorded_at, recorded_stats, with_system_prompt
from aerie.sources.recorded import BACKEND, CHARS_PER_TOKEN, PROVENANCE_KIND, RecordedError, is_recorded_dataset
from aerie.sources.tables import source_label
from aerie.tools.artifacts import atomic_write_bytes

# ---- the responses stage of a recorded dataset --------------------------------------------------------------


def responses_record(record: dict[str, Any], name: str, dataset: dict[str, Any], model: str) -> dict[str, Any]:
    """The ``aerie.responses/1`` record of a recorded sample (a prompt-cache record with its answer)."""
    from aerie.responses.in_process import params_hash

    r = record["recorded"]
    params = {"chat_template_kwargs": r["chat_template_kwargs"]} if r.get("chat_template_kwargs") else {}
    source = dataset["source"]
    answered_by = r.get("model") or source.get("model") or model
    out = {
        "format": RESPONSES_FORMAT,
        "id": f"{name}/{record['id']}",
        "dataset": name,
        "messages": with_system_prompt(dataset, record["messages"]),
        **({"tools": record["tools"]} if record.get("tools") else {}),
        "backend": BACKEND,
        "model": answered_by,
        "params": params,
        "params_hash": params_hash(answered_by, params),
        "reasoning": r.get("reasoning"),
        "content": r.get("content") or "",
        "tool_calls": r.get("tool_calls"),
        "finish_reason": r["finish_reason"],
        "usage": r.get("usage") or {},
        "cost": 0.0,
        "provider": f"{BACKEND}:{source_label(source)}",
        "provenance": {"kind": PROVENANCE_KIND, **record["source"]},
        "generation_id": r.get("id"),
        **{k: r[k] for k in ("prompt_token_ids", "output_token_ids") if r.get(k) is not None},
    }
    return out


def write_recorded_shard(
    name: str,
    dataset: dict[str, Any],
    datasets: dict[str, Any],
    positions: list[int],
    prompts_path: Path,
    out: Path,
    cache_dir: Path | None,
    model: str,
    log: Any = print,
) -> dict[str, Any]:
    """Rule ``responses_recorded``: the shard's samples (the plan's ``positions``, read from the prompt cache) as
    ``aerie.responses/1`` records, in the order of the prompts shard (checked id by id). No request, $0."""
    records = recorded_at(name, dataset, positions, datasets, cache_dir)
    prompts = read_prompts(prompts_path)
    lines = []
    for k, (p, r) in enumerate(zip(prompts, records, strict=False)):
        rec = responses_record(r, name, dataset, model)
        if rec["id"] != p["id"]:
            raise RecordedError(
                f"{prompts_path}:{k + 1}: prompt {p['id']!r} but the recorded source holds {rec['id']!r} at its "
                "position: the source changed since the prompts shard was written; re-run the dry run"
            )
        lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
    if len(prompts) != len(records):
        raise RecordedError(f"{prompts_path}: {len(prompts)} prompts but {len(records)} recorded samples planned")
    atomic_write_bytes(out, "".join(lines).encode())
    summary = {
        "samples": len(lines),
        "cost_usd": 0.0,
        "with_reasoning": sum(r["recorded"].get("reasoning") is not None for r in records),
        "tool_calls": sum(bool(r["recorded"].get("tool_calls")) for r in records),
    }
    log(f"{out.name}: {len(lines)} recorded responses of {source_label(dataset['source'])}, $0: {json.dumps(summary)}")
    return summary


# ---- the preview -------------------------------------------------------------------------------------------


def recorded_preview(config: dict[str, Any], plans: dict[str, Any], results_dir: Path) -> str | None:
    """The ``snakemake -n`` paragraph of the recorded datasets: samples, estimated tokens, $0, skipped rows."""
    names = [n for n, ds in config["datasets"].items() if is_recorded_dataset(ds)]
    if not names:
        return None
    lines = ["aerie recorded responses (the target's own answers from files or Hub sets: no API request, $0):"]
    total_samples = total_tokens = 0
    for name in names:
        plan = plans[name]
        if not plan.total:
            lines.append(f"  {name:<16}0 samples: {plan.note}")
            continue
        stats = recorded_stats(name, config["datasets"][name], config["datasets"], plan.cache_dir)
        samples = plan.planned_prompts
        share = samples / max(int(stats.get("samples", 0)), 1)
        prompt_tokens = stats.get("prompt_chars", 0) * share / CHARS_PER_TOKEN
        output_tokens = stats.get("output_chars", 0) * share / CHARS_PER_TOKEN
        pending = sum(not (results_dir / name / "responses" / f"shard-{s}.jsonl").exists() for s in plan.shard_names)
        skipped = {k.removeprefix("skipped."): v for k, v in stats.items() if k.startswith("skipped.")}
        lines.append(
            f"  {name:<16}{samples:,} samples in {plan.num_shards} shards ({pending} pending), "
            f"~{prompt_tokens:,.0f} prompt + ~{output_tokens:,.0f} output tokens (~{CHARS_PER_TOKEN:.0f} chars a "
            f"token; exact in the tokens reports), $0.00; {int(stats.get('rows', 0)):,} rows read"
            + (f", left out: {', '.join(f'{k} {v:,}' for k, v in sorted(skipped.items()))}" if skipped else "")
        )
        total_samples += samples
        total_tokens += math.ceil(prompt_tokens + output_tokens)
    lines.append(f"  total: {total_samples:,} recorded samples, ~{total_tokens:,} tokens, $0.00")
    return "\n".join(lines)


def recorded_tokens_per_sample(stats: dict[str, Any]) -> float:
    """The mean estimated prompt + output tokens of a recorded sample (the disk preview's figure)."""
    samples = max(int(stats.get("samples", 0)), 1)
    return (stats.get("prompt_chars", 0) + stats.get("output_chars", 0)) / CHARS_PER_TOKEN / samples
