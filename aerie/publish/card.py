"""A drafter's model card: the README.md a Hub model folder carries, generated from the run's JSON.

Two cards, two rules, so no rule writes into another's output:
- the drafter job writes ``results/drafter/{drafter}/README.md`` at export: Hub metadata (base model, library,
  pipeline tag, licence, tags: the drafter's kind among them), the drafter's kind and shape (read by its kind), how
  it was trained, held-out acceptance, and the training data read from the hidden shards it trained on;
- rule ``model_card``, after the benchmark, writes the published folder ``results/publish/{drafter}/`` for each
  drafter of the run: its files (hard links, no copy, no dotfiles), ``benchmark.json`` (the run's report), and the
  full card: the same plus its gate verdict, which drafter the run recommends serving, the benchmark table per
  prompt set (and overall) with every drafter and reference of the run, where the responses came from and what they
  cost. That folder is what ``hf upload`` sends (the command is in the card and in docs/model-card.md). The rule also
  writes the card as an HTML page for the report (``snakemake --report``).

The Hub metadata is YAML written by a YAML dumper, so any value (a licence name with ``: ``, a tag starting with
``#``) reads back as written. Benchmark reports are ``aerie.bench/4`` (docs/formats.md).
"""

from __future__ import annotations

import html
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import markdown
import yaml

from aerie.benchmark.methods import TRAINED, UNTRAINED, folder_kind
from aerie.benchmark.sglang_server import server_command, sglang_settings
from aerie.drafter_kinds import kind_named
from aerie.formats.hidden import open_hidden_shards
from aerie.responses.api.books import spend_story
from aerie.tools.artifacts import atomic_write_text, iter_jsonl

CARD_NAME = "README.md"
PUBLISHED_BENCH = "benchmark.json"
PUBLISHED_FILES_SUFFIX = ".files"  # results/publish/{drafter} links to results/publish/{drafter}.files


@dataclass(frozen=True)
class CardSettings:
    """Config section ``card`` (config/README.md)."""

    base_model: str | None = None  # the target's Hub id (metadata base_model); None: read from the target folder
    license: str = "other"  # a Hub licence id (apache-2.0, mit, other, ...)
    license_name: str | None = None  # with license: other, the licence's name (e.g. modified-mit)
    license_link: str | None = None  # with license: other, where its text is
    tags: tuple[str, ...] = ()  # added to the drafter's kind, speculative-decoding, draft-model, aerie
    repo_id: str | None = None  # the Hub repository the card's upload and serve commands name

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None) -> CardSettings:
        values = dict(section or {})
        values["tags"] = tuple(values.get("tags") or ())
        return cls(**values)


@dataclass
class CardFacts:
    """What a card says, read from the run's files (``None``/empty: that part is left out)."""

    name: str  # the drafter's name (results/drafter/{name}): the run's, or {run}-{key} of a drafters entry
    target: str  # the target folder as the run loaded it
    drafter: dict[str, Any]  # the drafter's config.json
    evaluation: dict[str, Any]  # its eval.json
    kind: str  # its drafter kind (aerie.drafter_kinds), read from config.json's architecture
    shape: str = ""  # its kind's one line on the folder (DrafterKind.describe_folder)
    training_data: dict[str, dict[str, int]] = field(default_factory=dict)  # per dataset: samples, tokens, supervised
    bench: dict[str, Any] | None = None  # bench/{run}.json: every drafter of the run
    responses: dict[str, dict[str, Any]] = field(default_factory=dict)  # per dataset: where they came from, cost
    spend: dict[str, Any] | None = None  # the run's API money story
    sglang: dict[str, Any] = field(default_factory=dict)  # config sglang: the serve command's flags


# ---- reading the run's files ------------------------------------------------------------------------------------


def training_data(hidden_shards: Sequence[Path]) -> dict[str, dict[str, int]]:
    """Per dataset (``<results>/<dataset>/hidden/shard-*``): sequences, tokens and supervised (loss-masked) tokens."""
    out: dict[str, dict[str, int]] = {}
    for shard in open_hidden_shards(list(hidden_shards)):
        row = out.setdefault(shard.path.parent.parent.name, {"samples": 0, "tokens": 0, "supervised": 0})
        row["samples"] += shard.num_seqs
        row["tokens"] += len(shard.input_ids)
        row["supervised"] += int(shard.loss_mask.sum())
    return out


def responses_summary(response_shards: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """Per dataset: samples, output tokens, backends, models and providers of its responses, and their cost."""
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
    """The run's API spend in the report's named parts (aerie.responses.api.books.spend_story; the ledger, not
    a live read)."""
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
    name: str,
    drafter_dir: Path,
    target: str,
    *,
    hidden_shards: Sequence[Path] = (),
    bench_json: Path | None = None,
    response_shards: Sequence[Path] = (),
    sglang: Mapping[str, Any] | None = None,
) -> CardFacts:
    drafter_dir = Path(drafter_dir)
    kind, config = folder_kind(drafter_dir)
    return CardFacts(
        name=name,
        target=str(target),
        drafter=config,
        evaluation=json.loads((drafter_dir / "eval.json").read_text()),
        kind=kind.name,
        shape=kind.describe_folder(drafter_dir),
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


def metadata_yaml(settings: CardSettings, base: str | None, kind: str) -> str:
    """The card's Hub metadata block (``---`` YAML ``---``), dumped by YAML itself: every value reads back as given."""
    meta: dict[str, Any] = {}
    if base:
        meta["base_model"] = base
    meta.update(library_name="sglang", pipeline_tag="text-generation", license=settings.license)
    if settings.license_name:
        meta["license_name"] = settings.license_name
    if settings.license_link:
        meta["license_link"] = settings.license_link
    meta["tags"] = list(dict.fromkeys([kind, "speculative-decoding", "draft-model", "aerie", *settings.tags]))
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, width=10**6) + "---"


def bench_tables(bench: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{set name: {prompts, baseline, methods}}``: overall first, then each prompt set of the report."""
    overall = {"prompts": bench.get("prompts"), "baseline": bench.get("baseline") or {}}
    overall["methods"] = bench.get("methods") or {}
    return {"all prompts": overall, **(bench.get("sets") or {})}


def _verdict_lines(bench: Mapping[str, Any], name: str) -> list[str]:
    """The drafter's gate verdict and the run's recommendation."""
    gate = bench.get("gate") or {}
    mine = (gate.get("drafters") or {}).get(name) or {}
    if mine.get("passed"):
        lines = ["**Gate: passed** (`bench.gate`: speedup, beating every reference on every set, lossless, every "
                 "request answered)."]  # fmt: skip
    else:
        lines = ["**Gate: failed**: " + "; ".join(mine.get("failures") or ["not judged"]) + "."]
    traffic = (gate.get("settings") or {}).get("traffic")
    if traffic and mine.get("traffic"):  # judged on the user's traffic mix: the weighted figures and the trade-off
        mix = ", ".join(f"{s} {w:.2f}" for s, w in traffic.items())
        lines.append(f"On the stated traffic mix ({mix}):")
        for figure, t in mine["traffic"].items():
            weighted = ", ".join(f"{m} {v:.3f}" for m, v in t["weighted"].items())
            lines.append(f"- traffic-weighted {figure.replace('_', ' ')}: {weighted}")
            lines += [f"  - {x}" for x in t["trade_off"]]
    serve = gate.get("serve")
    if serve == name:
        lines.append(f"**The run recommends serving this drafter** ({gate.get('why')}).")
    elif serve:
        lines.append(f"The run recommends serving `{serve}` instead ({gate.get('why')}).")
    else:
        lines.append(f"The run recommends serving no drafter ({gate.get('why')}).")
    return lines


def _method_cell(method: str, m: Mapping[str, Any], name: str) -> str:
    """A method as the card's table names it: this drafter in bold; another one with its role and kind."""
    if method == name:
        return f"**{method}** (this drafter)"
    what = {TRAINED: "trained in this run too", UNTRAINED: f"untrained twin of {m.get('twin_of')}"}
    role = m.get("role")
    about = [what.get(role, role)] if role != method else []
    about += [m["kind"]] if m.get("kind") and role != UNTRAINED else []
    return f"{method} ({', '.join(about)})" if about else method


def _bench_section(bench: Mapping[str, Any], name: str) -> list[str]:
    where = bench.get("device") or "?"
    conc = f", concurrency {bench['concurrency']}" if bench.get("concurrency") is not None else ""
    width = (bench.get("methods") or {}).get(name, {}).get("draft_tokens")
    lines = [
        "## Benchmark",
        "",
        f"Measured by aerie's bench job against the plain target in the same run, every drafter and reference on "
        f"the same prompts: backend `{bench.get('backend')}` ({where}{conc}), greedy, up to "
        f"{bench.get('max_new_tokens')} new tokens per prompt; this drafter proposes {width} draft tokens per verify "
        "step. Acceptance length: tokens committed per verify step (bonus token included); speedup: tokens/s over "
        "the no-drafter baseline. Acceptance lengths compare between methods of one draft width.",
        "",
        "\n\n".join(_verdict_lines(bench, name)),
    ]
    for set_name, table in bench_tables(bench).items():
        base = (table.get("baseline") or {}).get("tokens_per_s")
        lines += [
            "",
            f"**{set_name}** ({_fmt(table.get('prompts'))} prompts; baseline {_fmt(base, 1)} tok/s)",
            "",
            "| method | drafts per step | acceptance length | tokens/s | speedup | lossless |",
            "|---|---|---|---|---|---|",
        ]
        described = bench.get("methods") or {}
        for method, m in (table.get("methods") or {}).items():
            info = described.get(method, {})
            lines.append(
                f"| {_method_cell(method, info, name)} | {_fmt(info.get('draft_tokens'))} | "
                f"{_fmt(m.get('acceptance_length'))} | {_fmt(m.get('tokens_per_s'), 1)} | {_fmt(m.get('speedup'))}x | "
                f"{_fmt(m.get('lossless'))} |"
            )
    return lines


def _curves_line(settings: CardSettings, curves_link: str) -> str:
    """Where the training curves are: the folder's TensorBoard files, and the Hub page that draws them."""
    hub = (
        f" [on the Hub](https://huggingface.co/{settings.repo_id}/tensorboard)"
        if settings.repo_id
        else " on the Hub model page"
    )
    return (
        f"- training curves: [`tensorboard/`]({curves_link}) (TensorBoard event files: loss, accuracy and held-out "
        f"acceptance per position at every logged step; `tensorboard --logdir tensorboard`; shown under Metrics{hub})"
    )


def _training_section(facts: CardFacts, settings: CardSettings, curves_link: str) -> list[str]:
    ev, cfg = facts.evaluation, (facts.drafter.get("aerie") or {}).get("train_config") or {}
    per_pos = ", ".join(f"{p:.3f}" for p in ev.get("acceptance_per_position") or [])
    lines = [
        "## Training",
        "",
        f"- held-out simulated acceptance length {_fmt(ev.get('simulated_acceptance_length'))} (best epoch "
        f"{ev.get('best_epoch')} of {len(ev.get('epochs') or [])}; untrained: "
        f"{_fmt((ev.get('untrained') or {}).get('simulated_acceptance_length'))}); per position: {per_pos or '-'}",
        f"- {_fmt(ev.get('tokens_trained'))} tokens trained, {_fmt(ev.get('optimizer_steps'))} optimizer steps, "
        f"{_fmt(ev.get('train_seconds'), 0)} s on {ev.get('device')} x {ev.get('processes')}",
    ]
    if cfg:
        generic = ("epochs", "learning_rate", "batch_size", "max_seq_len")
        own = kind_named(facts.kind).setting_names()
        lines.append("- settings: " + ", ".join(f"`{k}` {cfg[k]}" for k in generic if k in cfg))
        lines.append(f"- {facts.kind} settings: " + ", ".join(f"`{k}` {cfg[k]}" for k in own if k in cfg))
    lines.append(_curves_line(settings, curves_link))
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
    repo = settings.repo_id or f"<your-user>/{facts.name}"
    target = base or facts.target
    sglang = sglang_settings(facts.sglang or None)
    flags = kind_named(facts.kind).sglang_flags(repo, facts.drafter, sglang)  # the kind's flags, naming the Hub repo
    cmd = server_command(target, 30000, sglang, speculative=flags, python="python", host="0.0.0.0")
    folder = f"results/publish/{facts.name}" if published else f"results/drafter/{facts.name}"
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
        f"hf upload {repo} {folder} . --commit-message 'aerie drafter {facts.name}'",
        "```",
    ]


def render_card(facts: CardFacts, settings: CardSettings, *, published: bool, curves_link: str = "tensorboard/") -> str:
    """The card's markdown: Hub metadata, then the drafter (its name and kind), its benchmark and gate verdict
    (published), training and data. ``curves_link``: where the card links the TensorBoard files (the folder's own
    ``tensorboard/`` on the Hub; the report's page links them where they are)."""
    base = base_model_id(settings, facts.target)
    target = base or Path(facts.target).name
    about = [
        f"# {facts.name}: a speculative-decoding drafter ({facts.kind}) for {target}",
        "",
        f"A draft model for speculative decoding of `{base or facts.target}` with SGLang, trained by aerie. Drafter "
        f"kind `{facts.kind}`: {kind_named(facts.kind).description}.",
        "",
        f"This folder: {facts.shape or ', '.join(facts.drafter.get('architectures') or ['?'])}.",
    ]
    if not published:
        about += [
            "",
            "This card is written when the drafter is exported; the published card (with the benchmark) is "
            f"`results/publish/{facts.name}/README.md`.",
        ]
    parts = [metadata_yaml(settings, base, facts.kind), "\n".join(about)]
    if facts.bench is not None:
        parts.append("\n".join(_bench_section(facts.bench, facts.name)))
    parts.append("\n".join(_training_section(facts, settings, curves_link)))
    if facts.responses:
        parts.append("\n".join(_responses_section(facts)))
    parts.append("\n".join(_usage_section(facts, settings, base, published)))
    return "\n\n".join(parts) + "\n"


def card_page(card: str, title: str) -> str:
    """The card as one HTML page (the report's): its Hub metadata as a block, the markdown rendered as the Hub
    renders it (tables, code)."""
    _, meta, body = card.split("---\n", 2)
    html_body = markdown.markdown(body, extensions=["tables", "fenced_code"])
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>'
        "body{font-family:sans-serif;max-width:60em;margin:1em auto;line-height:1.4}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:0.2em 0.5em}"
        "pre{background:#f6f6f6;padding:0.5em;overflow-x:auto}</style></head><body>\n"
        f"<p>Hub metadata:</p>\n<pre>{html.escape(meta)}</pre>\n{html_body}\n</body></html>\n"
    )


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
    page: Path | None = None,
) -> Path:
    """Rule ``model_card``: ``out_dir`` (named as the drafter) = the drafter's files (hard links; no dotfile, none
    under a dot folder) + ``benchmark.json`` + the full card; ``page``: the card as the report's HTML page, linking
    the curves where they are.

    ``out_dir`` is a link to ``{out_dir}.files``, the folder that holds them: Snakemake marks a real directory output
    with a ``.snakemake_timestamp`` file inside it (its mtime), which ``hf upload`` would send to the Hub; a linked
    directory it dates by the link itself and leaves alone."""
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
    files = out_dir.with_name(out_dir.name + PUBLISHED_FILES_SUFFIX)
    shutil.rmtree(files, ignore_errors=True)
    files.mkdir(parents=True)
    for src in sorted(drafter_dir.rglob("*")):
        rel = src.relative_to(drafter_dir)
        if any(part.startswith(".") for part in rel.parts):
            # the drafter folder's own .snakemake_timestamp (linked, touching one would touch both: one inode) or
            # any other dotfile: nothing the Hub should hold
            continue
        dest = files / rel
        if src.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
        elif rel != Path(CARD_NAME):
            dest.parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(src, dest)
    _link_or_copy(Path(bench_json), files / PUBLISHED_BENCH)
    atomic_write_text(files / CARD_NAME, render_card(facts, settings, published=True))
    if out_dir.is_symlink() or out_dir.is_file():
        out_dir.unlink()
    elif out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.symlink_to(files.name, target_is_directory=True)  # relative: the results folder may move
    if page is not None:
        curves = (files / "tensorboard").resolve().as_uri()
        card = render_card(facts, settings, published=True, curves_link=curves)
        atomic_write_text(Path(page), card_page(card, f"{facts.name} ({facts.kind}): model card"))
    return out_dir
