"""The drafter's model card: the README.md a Hub model folder carries, generated from the run's JSON.

Two cards, two rules, so no rule writes into another's output:
- the drafter job writes ``results/drafter/{run}/README.md`` at export: Hub metadata (base model, library, pipeline
  tag, licence, tags), the drafter's shape, how it was trained, held-out acceptance, and the training data read from
  the hidden shards it trained on;
- rule ``model_card``, after the benchmark, writes the published folder ``results/publish/{run}/``: the drafter's
  files (hard links, no copy), ``benchmark.json``, and the full card: the same plus the benchmark table per prompt
  set (and overall), the gate's verdict, where the responses came from and what they cost. That folder is what
  ``hf upload`` sends (the command is in the card and in docs/model-card.md).

Per-set benchmark tables are read from the report's ``sets`` where it has them (``aerie.bench/3``); a report
without them (``aerie.bench/2``) gives one table over every prompt.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aerie.artifacts import atomic_write_text

CARD_NAME = "README.md"
PUBLISHED_BENCH = "benchmark.json"


@dataclass(frozen=True)
class CardSettings:
    """Config section ``card`` (config/README.md)."""

    base_model: str | None = None  # the target's Hub id (metadata base_model); None: read from the target folder
    license: str = "other"  # a Hub licence id (apache-2.0, mit, other, ...)
    license_name: str | None = None  # with license: other, the licence's name (e.g. modified-mit)
    license_link: str | None = None  # with license: other, where its text is
    tags: tuple[str, ...] = ()  # added to eagle3, speculative-decoding, aerie
    repo_id: str | None = None  # the Hub repository the card's upload and serve commands name

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None) -> CardSettings:
        values = dict(section or {})
        values["tags"] = tuple(values.get("tags") or ())
        return cls(**values)


@dataclass
class CardFacts:
    """What a card says, read from the run's files (``None``/empty: that part is left out)."""

    run: str
    target: str  # the target folder as the run loaded it
    drafter: dict[str, Any]  # the drafter's config.json
    evaluation: dict[str, Any]  # its eval.json
    training_data: dict[str, dict[str, int]] = field(default_factory=dict)  # per dataset: samples, tokens, supervised
    bench: dict[str, Any] | None = None  # bench/{run}.json
    responses: dict[str, dict[str, Any]] = field(default_factory=dict)  # per dataset: where they came from, cost
    spend: dict[str, Any] | None = None  # the run's API money story
    sglang: dict[str, Any] = field(default_factory=dict)  # config sglang: the serve command's flags


# ---- reading the run's files ------------------------------------------------------------------------------------


def training_data(hidden_shards: Sequence[Path]) -> dict[str, dict[str, int]]:
    """Per dataset (``<results>/<dataset>/hidden/shard-*``): sequences, tokens and supervised (loss-masked) tokens."""
    from aerie.formats.hidden import open_hidden_shards

    out: dict[str, dict[str, int]] = {}
    for shard in open_hidden_shards(list(hidden_shards)):
        row = out.setdefault(shard.path.parent.parent.name, {"samples": 0, "tokens": 0, "supervised": 0})
        row["samples"] += shard.num_seqs
        row["tokens"] += len(shard.input_ids)
        row["supervised"] += int(shard.loss_mask.sum())
    return out


def responses_summary(response_shards: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """Per dataset: samples, output tokens, backends, models and providers of its responses, and their cost."""
    from aerie.artifacts import iter_jsonl

    out: dict[str, dict[str, Any]] = {}
    for path in map(Path, response_shards):
        row = out.setdefault(
            path.parent.parent.name,
            {"samples": 0, "output_tokens": 0, "cost": 0.0, "backends": set(), "models": set(), "providers": set()},
        )
        for _, r in iter_jsonl(path):
            row["samples"] += 1
            usage = r.get("usage") or {}
            row["output_tokens"] += int(usage.get("completion_tokens") or len(r.get("output_token_ids") or []))
            row["cost"] += float(r.get("cost") or 0.0)
            row["backends"].add(r.get("backend") or "?")
            row["models"].add(str(r.get("model") or "?"))
            if r.get("provider"):
                row["providers"].add(r["provider"])
    return {d: {k: sorted(v) if isinstance(v, set) else v for k, v in row.items()} for d, row in out.items()}


def spend_summary(response_shards: Sequence[Path]) -> dict[str, Any] | None:
    """The run's API spend in the report's named parts (aerie.api.money.spend_story; the ledger, not a live read)."""
    from aerie.api.money import spend_story

    story = spend_story(list(map(Path, response_shards)), live=False)
    if not story.journaled and story.account is None:
        return None
    billed = {d: u.retries + u.lost for d, u in story.billed.items()}
    return {
        "total": story.total,
        "journaled": story.journaled_usd,
        "billed_beyond_journals": sum(billed.values()) + story.unattributed,
        "per_dataset": {
            d: sum(story.journaled.get(d, {}).values()) + billed.get(d, 0.0) for d in {*story.journaled, *billed}
        },
        "source": story.source,
    }


def read_facts(
    run: str,
    drafter_dir: Path,
    target: str,
    *,
    hidden_shards: Sequence[Path] = (),
    bench_json: Path | None = None,
    response_shards: Sequence[Path] = (),
    sglang: Mapping[str, Any] | None = None,
) -> CardFacts:
    drafter_dir = Path(drafter_dir)
    return CardFacts(
        run=run,
        target=str(target),
        drafter=json.loads((drafter_dir / "config.json").read_text()),
        evaluation=json.loads((drafter_dir / "eval.json").read_text()),
        training_data=training_data(hidden_shards) if hidden_shards else {},
        bench=json.loads(Path(bench_json).read_text()) if bench_json is not None else None,
        responses=responses_summary(response_shards) if response_shards else {},
        spend=spend_summary(response_shards) if response_shards else None,
        sglang=dict(sglang or {}),
    )


def base_model_id(settings: CardSettings, target: str) -> str | None:
    """The target's Hub id: ``card.base_model``, else the folder config's ``_name_or_path`` when it names a Hub
    repository (``owner/name``, not a local path); None when neither says."""
    if settings.base_model:
        return settings.base_model
    try:
        name = json.loads((Path(target) / "config.json").read_text()).get("_name_or_path") or ""
    except (OSError, ValueError):
        return None
    is_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists()
    return name if is_hub_id else None


# ---- the card -------------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _metadata(settings: CardSettings, base: str | None) -> str:
    lines = ["---"]
    if base:
        lines.append(f"base_model: {base}")
    lines += ["library_name: sglang", "pipeline_tag: text-generation", f"license: {settings.license}"]
    if settings.license_name:
        lines.append(f"license_name: {settings.license_name}")
    if settings.license_link:
        lines.append(f"license_link: {settings.license_link}")
    tags = list(dict.fromkeys(["eagle3", "speculative-decoding", "draft-model", "aerie", *settings.tags]))
    lines += ["tags:", *(f"- {t}" for t in tags), "---"]
    return "\n".join(lines)


def bench_tables(bench: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{set name: {prompts, baseline, methods}}``: overall first, then each prompt set the report has."""
    overall = {"prompts": bench.get("prompts"), "baseline": bench.get("baseline") or {}}
    overall["methods"] = bench.get("methods") or {}
    sets = bench.get("sets") or {}
    if isinstance(sets, list):  # tolerate a list of named entries
        sets = {str(s.get("set") or s.get("name") or i): s for i, s in enumerate(sets)}
    return {"all prompts": overall, **{str(k): v for k, v in sets.items() if isinstance(v, Mapping)}}


def _bench_section(bench: Mapping[str, Any]) -> list[str]:
    where = bench.get("device") or "?"
    conc = f", concurrency {bench['concurrency']}" if bench.get("concurrency") is not None else ""
    lines = [
        "## Benchmark",
        "",
        f"Measured by aerie's bench job against the plain target in the same run: backend `{bench.get('backend')}`"
        f" ({where}{conc}), greedy, {bench.get('num_draft_steps')} draft tokens per verify step, up to "
        f"{bench.get('max_new_tokens')} new tokens per prompt. Acceptance length: tokens committed per verify step "
        "(bonus token included); speedup: tokens/s over the no-drafter baseline.",
    ]
    for name, table in bench_tables(bench).items():
        base = (table.get("baseline") or {}).get("tokens_per_s")
        lines += [
            "",
            f"**{name}** ({_fmt(table.get('prompts'))} prompts; baseline {_fmt(base, 1)} tok/s)",
            "",
            "| method | acceptance length | tokens/s | speedup | lossless |",
            "|---|---|---|---|---|",
        ]
        for method, m in (table.get("methods") or {}).items():
            label = "this drafter" if method == "eagle3" else method
            lines.append(
                f"| {label} | {_fmt(m.get('acceptance_length'))} | {_fmt(m.get('tokens_per_s'), 1)} | "
                f"{_fmt(m.get('speedup'))}x | {_fmt(m.get('lossless'))} |"
            )
    lines += [
        "",
        "The bench job's gate (`bench.gate`: speedup, beating the references, lossless) passed: a failing run keeps "
        "its report aside and publishes nothing.",
    ]
    return lines


def _training_section(facts: CardFacts) -> list[str]:
    ev, cfg = facts.evaluation, (facts.drafter.get("aerie") or {}).get("train_config") or {}
    per_pos = ", ".join(f"{p:.3f}" for p in ev.get("acceptance_per_position") or [])
    lines = [
        "## Training",
        "",
        f"- held-out simulated acceptance length {_fmt(ev.get('simulated_acceptance_length'))} (best epoch "
        f"{ev.get('best_epoch')} of {len(ev.get('epochs') or [])}; untrained: "
        f"{_fmt((ev.get('untrained') or {}).get('simulated_acceptance_length'))}); per position: {per_pos or '-'}",
        f"- {_fmt(ev.get('tokens_trained'))} tokens trained ({ev.get('ttt_steps')} test-time-training steps each), "
        f"{_fmt(ev.get('optimizer_steps'))} optimizer steps, {_fmt(ev.get('train_seconds'), 0)} s on "
        f"{ev.get('device')} x {ev.get('processes')}",
    ]
    if cfg:
        keys = ("epochs", "learning_rate", "batch_size", "max_seq_len", "ttt_steps", "attention")
        lines.append("- settings: " + ", ".join(f"`{k}` {cfg[k]}" for k in keys if k in cfg))
    lines.append("- curves: `tensorboard/` (TensorBoard event files; the Hub shows them under Metrics)")
    if facts.training_data:
        lines += ["", "| dataset | samples | tokens | supervised tokens |", "|---|---|---|---|"]
        for d, row in facts.training_data.items():
            lines.append(f"| {d} | {_fmt(row['samples'])} | {_fmt(row['tokens'])} | {_fmt(row['supervised'])} |")
        total = {k: sum(r[k] for r in facts.training_data.values()) for k in ("samples", "tokens", "supervised")}
        lines.append(f"| all | {_fmt(total['samples'])} | {_fmt(total['tokens'])} | {_fmt(total['supervised'])} |")
    return lines


def _responses_section(facts: CardFacts) -> list[str]:
    lines = [
        "## Training data: where the responses came from",
        "",
        "Every response was regenerated from the target (aerie's responses stage), so the drafter learns the "
        "target's own distribution.",
        "",
        "| dataset | samples | output tokens | backend | model | providers | cost (USD) |",
        "|---|---|---|---|---|---|---|",
    ]
    for d, r in facts.responses.items():
        lines.append(
            f"| {d} | {_fmt(r['samples'])} | {_fmt(r['output_tokens'])} | {', '.join(r['backends'])} | "
            f"{', '.join(r['models'])} | {', '.join(r['providers']) or '-'} | {r['cost']:.4f} |"
        )
    spend = facts.spend
    if spend is not None:
        lines += [
            "",
            f"Spend: ${spend['total']:.2f} in all (${spend['journaled']:.2f} journaled with the answers + "
            f"${spend['billed_beyond_journals']:.2f} billed beyond them: retries, interrupted requests; "
            f"{spend['source']}).",
        ]
    else:
        lines += ["", "Spend: $0 (no API responses: generated in-process or by a local server)."]
    return lines


def _usage_section(facts: CardFacts, settings: CardSettings, base: str | None, published: bool) -> list[str]:
    from aerie.bench.sglang_server import server_command

    repo = settings.repo_id or f"<your-user>/{facts.run}"
    target = base or facts.target
    cmd = server_command(target, 30000, facts.sglang or None, drafter_dir=repo, python="python", host="0.0.0.0")
    folder = f"results/publish/{facts.run}" if published else f"results/drafter/{facts.run}"
    return [
        "## Use it",
        "",
        "Serve the target with this drafter in SGLang (the flags the benchmark measured):",
        "",
        "```bash",
        " ".join(cmd),
        "```",
        "",
        "Publish this folder (`hf auth login` first; `--repo-type model` is the default):",
        "",
        "```bash",
        f"hf upload {repo} {folder} . --commit-message 'aerie run {facts.run}'",
        "```",
    ]


def render_card(facts: CardFacts, settings: CardSettings, *, published: bool) -> str:
    """The card's markdown: Hub metadata, then the drafter, its benchmark (published), training and data."""
    base = base_model_id(settings, facts.target)
    d = facts.drafter
    arch = ", ".join(d.get("architectures") or ["?"])
    aux = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    about = [
        f"# {facts.run}: an EAGLE-3 drafter for {base or Path(facts.target).name}",
        "",
        f"A draft model for speculative decoding of `{base or facts.target}` with SGLang (EAGLE-3, trained with "
        f"test-time training by aerie): `{arch}`, {d.get('num_hidden_layers', 1)} decoder "
        f"layer, hidden size {_fmt(d.get('hidden_size'))}, draft vocabulary {_fmt(d.get('draft_vocab_size'))} of "
        f"{_fmt(d.get('vocab_size'))} target tokens, reading the target's layers {aux}. Without `embed_tokens`: "
        "SGLang shares the target's.",
    ]
    if not published:
        about += [
            "",
            "This card is written when the drafter is exported; the published card (with the benchmark) is "
            f"`results/publish/{facts.run}/README.md`.",
        ]
    parts = [_metadata(settings, base), "\n".join(about)]
    if facts.bench is not None:
        parts.append("\n".join(_bench_section(facts.bench)))
    parts.append("\n".join(_training_section(facts)))
    if facts.responses:
        parts.append("\n".join(_responses_section(facts)))
    parts.append("\n".join(_usage_section(facts, settings, base, published)))
    return "\n\n".join(parts) + "\n"


# ---- the two rules' entry points --------------------------------------------------------------------------------


def write_export_card(
    drafter_dir: Path, settings: CardSettings, target: str, hidden_shards: Sequence[Path], sglang: Mapping | None
) -> Path:
    """The drafter job's card, ``<drafter_dir>/README.md`` (training facts only)."""
    drafter_dir = Path(drafter_dir)
    facts = read_facts(drafter_dir.name, drafter_dir, target, hidden_shards=hidden_shards, sglang=sglang)
    out = drafter_dir / CARD_NAME
    atomic_write_text(out, render_card(facts, settings, published=False))
    return out


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:  # another filesystem, or links refused: a copy
        shutil.copy2(src, dest)


def write_published_folder(
    out_dir: Path,
    drafter_dir: Path,
    bench_json: Path,
    settings: CardSettings,
    target: str,
    *,
    hidden_shards: Sequence[Path] = (),
    response_shards: Sequence[Path] = (),
    sglang: Mapping | None = None,
) -> Path:
    """Rule ``model_card``: ``out_dir`` = the drafter's files (hard links) + ``benchmark.json`` + the full card."""
    out_dir, drafter_dir = Path(out_dir), Path(drafter_dir)
    facts = read_facts(
        out_dir.name,
        drafter_dir,
        target,
        hidden_shards=hidden_shards,
        bench_json=bench_json,
        response_shards=response_shards,
        sglang=sglang,
    )
    shutil.rmtree(out_dir, ignore_errors=True)
    for src in sorted(drafter_dir.rglob("*")):
        dest = out_dir / src.relative_to(drafter_dir)
        if src.name.startswith(".snakemake"):
            # Snakemake's own marker of a directory output: linked, touching the published folder's would touch
            # the drafter's too (one inode), making the drafter look newer than its benchmark on the next run.
            continue
        if src.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
        elif src.name != CARD_NAME or src.parent != drafter_dir:
            dest.parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(src, dest)
    _link_or_copy(Path(bench_json), out_dir / PUBLISHED_BENCH)
    atomic_write_text(out_dir / CARD_NAME, render_card(facts, settings, published=True))
    return out_dir
