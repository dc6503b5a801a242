"""Disk preview: what the pending hidden shards will write, printed by ``snakemake -n``.

Hidden states dominate the pipeline's disk use. For Kimi K2.5 (hidden 7168, three aux layers) the ``full``
layout (aux + final layer in bf16, what SpecForge stores) costs 56 KiB a token, 10M training tokens ~535 GiB;
the default ``compact`` layout (fp8 aux + the target's top-k next tokens) 21 KiB a token, ~0.38x of that.
The preview counts each pending shard's tokens exactly when its tokens shard exists, and estimates them
otherwise. It counts what a run adds: a pending shard the capture store already holds (a crashed or stopped
run finished it: aerie.target_model.store) is published as a hard link to that entry, which costs no data bytes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aerie.formats.prompts import estimate_prompt_tokens
from aerie.plan.resolve import hidden_layer_ids, responses_config
from aerie.responses.api.journal import dataset_journal_totals
from aerie.responses.api.money import mean_output_tokens
from aerie.responses.recorded import recorded_tokens_per_sample
from aerie.sources.datasets import iter_planned_prompts, iter_prompts, recorded_stats
from aerie.sources.recorded import is_recorded_dataset
from aerie.target_model.store import capture_reusable, config_key_function
from aerie.targets import planned_target

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def target_hidden_size(target: dict[str, Any]) -> int | None:
    """``target.hidden_size``, else the planned target's (its folder's config.json, its builder's description or
    ``target.config_json``); None when nothing says."""
    if target.get("hidden_size"):
        return int(target["hidden_size"])
    planned = planned_target(target)
    return planned.text_config.get("hidden_size") if planned else None


def bytes_per_token(
    hidden_size: int, num_aux: int, storage_dtype: str = "bfloat16", layout: str = "full", target_topk: int = 32
) -> int:
    """Bytes a token costs in a hidden shard (aerie.hidden/2), the int32 id and uint8 loss mask included.

    full: aux (A*H) + final (H) states in ``storage_dtype``. compact: aux in float8 (1 byte) + one fp32 scale
    per aux layer, and per top-k entry an int32 token id and an fp16 log-probability."""
    if layout == "full":
        return (num_aux + 1) * hidden_size * DTYPE_BYTES[storage_dtype] + 4 + 1
    if layout == "compact":
        return num_aux * hidden_size + 4 * num_aux + 6 * target_topk + 4 + 1
    raise ValueError(f"hidden.layout: {layout!r} is not compact or full")


def specforge_bytes_per_token(hidden_size: int) -> int:
    """SpecForge's layout for the same data: three aux layers + the final layer in bf16 = 8H bytes."""
    return 8 * hidden_size


def layout_description(hidden_cfg: dict[str, Any], hidden_size: int, num_aux: int, per_token: int) -> str:
    """What one token holds, for the preview line (compact: and its ratio to SpecForge's 8H bytes)."""
    if hidden_cfg.get("layout", "compact") == "compact":
        ratio = per_token / specforge_bytes_per_token(hidden_size)
        return (
            f"compact: {num_aux} aux layers x {hidden_size} x float8 + top-{hidden_cfg.get('target_topk', 32)} "
            f"target tokens, {ratio:.2f}x SpecForge's 8H"
        )
    return f"full: {num_aux} aux + final layer x {hidden_size} x {hidden_cfg.get('storage_dtype', 'bfloat16')}"


def tokens_in_shard(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return int(f.get_slice("input_ids").get_shape()[0])


@dataclass
class PendingHidden:
    """What the pending hidden shards will write (:func:`pending_hidden`)."""

    hidden: int
    num_aux: int
    per_token: int  # bytes
    shards: int = 0  # pending
    exact: int = 0  # counted from their tokens shards
    stored: int = 0  # in the capture store already (hard links: no new data)
    tokens: float = 0.0
    per_dataset: dict[str, float] = field(default_factory=dict)  # tokens

    @property
    def bytes(self) -> int:
        """Data bytes the run adds (the shards in the capture store add none)."""
        return int(self.tokens * self.per_token)


def pending_hidden(
    config: dict[str, Any],
    plans: dict[str, Any],
    results_dir: Path,
    tokens_per_sample: dict[str, float],
    expected_samples: dict[str, int] | None = None,
) -> PendingHidden | None:
    """The pending hidden shards and their estimated bytes; None when the hidden size is unknown (no local target,
    no key). Arguments as :func:`disk_preview`'s."""
    hidden = target_hidden_size(config["target"])
    if hidden is None:
        return None
    ids = hidden_layer_ids(config) or config["hidden"].get("aux_layer_ids")  # every drafter's layers: one capture
    num_aux = len(ids) if ids else 3
    hcfg = config["hidden"]
    per_token = bytes_per_token(
        hidden,
        num_aux,
        hcfg.get("storage_dtype", "bfloat16"),
        hcfg.get("layout", "compact"),
        hcfg.get("target_topk", 32),
    )

    # Asked only for a pending shard whose store entry exists (hashes its tokens shard when the target is there).
    in_store = capture_reusable(config_key_function(config, ids))
    out = PendingHidden(hidden, num_aux, per_token)
    for name, plan in plans.items():
        counted, estimated_samples = 0.0, 0
        for shard in plan.shard_names:
            hidden_path = results_dir / name / "hidden" / f"shard-{shard}.safetensors"
            if hidden_path.exists():
                continue
            out.shards += 1
            tok_path = results_dir / name / "tokens" / f"shard-{shard}.safetensors"
            if tok_path.exists() and in_store(hidden_path, tok_path):
                out.stored += 1
            elif tok_path.exists():
                counted += tokens_in_shard(tok_path)
                out.exact += 1
            else:
                start, stop = plan.shard_range(int(shard))
                estimated_samples += stop - start
        if expected_samples is not None and name in expected_samples:
            journaled = int(dataset_journal_totals(results_dir / name / "responses")["samples"])
            estimated_samples = min(estimated_samples, journaled + expected_samples[name])
        out.per_dataset[name] = counted + estimated_samples * tokens_per_sample.get(name, 0.0)
        out.tokens += out.per_dataset[name]
    return out


def disk_preview(
    config: dict[str, Any],
    plans: dict[str, Any],
    results_dir: Path,
    tokens_per_sample: dict[str, float],
    expected_samples: dict[str, int] | None = None,
) -> str | None:
    """One paragraph for ``snakemake -n``; None when the hidden size is unknown (no local target, no key).

    ``tokens_per_sample``: per dataset, the expected prompt + output tokens of a sample still to generate.
    ``expected_samples``: per API dataset, the responses its output-token quota leaves room for (the cost
    preview's figure); the estimated samples of its pending shards are cut to those plus the ones already
    journaled, so a dataset's disk is capped at its quota like its dollars.
    """
    p = pending_hidden(config, plans, results_dir, tokens_per_sample, expected_samples)
    if p is None:
        return (
            "aerie disk preview: unknown target hidden size (set target.hidden_size to preview the disk "
            "the hidden shards will use)"
        )
    shards, stored, tokens, per_token = p.shards, p.stored, p.tokens, p.per_token
    if not shards:
        return "aerie disk preview: every hidden shard exists"
    linked = "in the capture store already (published as hard links: no new data)"
    if stored == shards:
        return f"aerie disk preview: {shards} pending hidden shards, all {linked}: ~0.00 GiB"
    gib = 2**30 / per_token
    parts = ", ".join(f"{n} ~{t / gib:,.1f}" for n, t in p.per_dataset.items() if t)
    layout = layout_description(config["hidden"], p.hidden, p.num_aux, per_token)
    new = f", {stored} of them {linked}; the other {shards - stored}:" if stored else ","
    return (
        f"aerie disk preview: {shards} pending hidden shards{new} ~{tokens:,.0f} tokens ({p.exact} counted from "
        f"their tokens shards, the rest estimated) x {per_token:,} bytes/token ({layout}) "
        f"= ~{tokens * per_token / 2**30:,.2f} GiB" + (f" ({parts} GiB)" if parts else "")
    )


def expected_tokens_per_sample(
    config: dict[str, Any], results_dir: Path, plans: dict[str, Any] | None = None, sample: int = 200
) -> dict[str, float]:
    """Per dataset: estimated prompt tokens (the first ``sample`` prompts of the plan's shards, or of the source
    without ``plans``; ~4 characters a token) plus the expected output tokens (measured from journals, else
    ``expected_output_tokens``, else the cap)."""
    out = {}
    for name, ds in config["datasets"].items():
        if is_recorded_dataset(ds):  # the answers are here: their own lengths, not an expectation
            cache = plans[name].cache_dir if plans is not None else None
            out[name] = recorded_tokens_per_sample(recorded_stats(name, ds, config["datasets"], cache))
            continue
        source = (
            iter_planned_prompts(plans[name], config["datasets"])
            if plans is not None
            else iter_prompts(name, ds, config["datasets"])
        )
        prompts = list(itertools.islice(source, sample))
        prompt_tokens = sum(estimate_prompt_tokens(p["messages"]) for p in prompts) / max(len(prompts), 1)
        spent = dataset_journal_totals(results_dir / name / "responses")
        output_tokens, _ = mean_output_tokens(responses_config(config, name), spent, (name, ds))
        out[name] = prompt_tokens + output_tokens
    return out
