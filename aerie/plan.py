"""Parse-time checks and the shard plan: everything decided before any job runs.

Snakemake calls these while reading the workflow, so a bad setting or a malformed prompt file fails
``snakemake`` (and ``snakemake -n``) before any work, with a message naming the setting or file:line.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aerie.config_file import ConfigError, ConfigSources, check_against_schema
from aerie.demo_target.config import DemoTargetConfig
from aerie.drafter.config import TrainConfig
from aerie.drafter.folder import check_config_init
from aerie.prompts import DatasetPlan, plan_dataset, prompt_cache_dir
from aerie.rehearsal_target.config import ARCHITECTURES as REHEARSAL_ARCHITECTURES
from aerie.rehearsal_target.config import RehearsalTargetConfig
from aerie.target_model.config import architectures as target_config_architectures
from aerie.target_model.config import (
    check_servable_aux_layer_ids,
    default_aux_layer_ids,
    read_described_config,
    read_text_config,
    target_architectures,
    text_config,
)

if TYPE_CHECKING:
    from aerie.api.settings import ApiRun


def validate_config(config: dict[str, Any], sources: ConfigSources) -> None:
    """Check the merged config against config/schema.yaml (every key typed and ranged; errors name the key path and
    the config file and line) and fill in the schema's defaults. Raises ConfigError."""
    check_against_schema(config, _schema(), sources)


def _dataclass_section(section: tuple[str, ...], values: dict[str, Any], cls: type) -> Any:
    """Build a dataclass-backed section (its own checks run in __post_init__) so a value it refuses fails now."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown}; known keys: {sorted(known)}", section + (unknown[0],))
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e), section) from None


def demo_target_config(config: dict[str, Any]) -> DemoTargetConfig:
    return DemoTargetConfig(**config["target"].get("demo") or {})


def train_config(config: dict[str, Any]) -> TrainConfig:
    return TrainConfig(**config.get("drafter") or {})


def check_config(config: dict[str, Any]) -> None:
    """Checks beyond the schema: keys of dataclass-backed sections, backend needs, the benchmark set."""
    target = config["target"]
    if "demo" in target:
        _dataclass_section(("target", "demo"), target["demo"] or {}, DemoTargetConfig)
    if "rehearsal" in target:
        _dataclass_section(("target", "rehearsal"), target["rehearsal"] or {}, RehearsalTargetConfig)
    _dataclass_section(("drafter",), config.get("drafter") or {}, TrainConfig)

    for name in config["datasets"]:
        responses = responses_config(config, name)
        where = ("responses",) if "responses" not in config["datasets"][name] else ("datasets", name, "responses")
        backend = responses["backend"]
        if config["datasets"][name]["source"]["kind"] == "recorded":
            _check_recorded(config, name)
            continue
        if "max_samples" in config["datasets"][name]:
            raise ConfigError(
                "caps a recorded source (source.kind: recorded); an API dataset is capped by max_output_tokens",
                ("datasets", name, "max_samples"),
            )
        if backend == "recorded":
            raise ConfigError("is set by a recorded source (source.kind: recorded), not by hand", where + ("backend",))
        if backend in ("openrouter", "openai") and not responses.get("model") and not responses.get("serve"):
            raise ConfigError(f"required for the '{backend}' backend (the API model name)", where + ("model",))
        if backend != "hf" and not responses.get("base_url") and not responses.get("serve"):
            raise ConfigError(f"required for the '{backend}' backend", where + ("base_url",))
        if responses.get("serve") and backend != "openai":
            raise ConfigError("starts an OpenAI-compatible server, so backend must be 'openai'", where + ("serve",))

    ids = config["hidden"].get("aux_layer_ids")
    layers = target.get("num_hidden_layers") or _local_num_layers(target)
    architectures: Sequence[str] = ()
    if "demo" in target:
        layers = DemoTargetConfig(**target["demo"] or {}).num_hidden_layers
    elif "rehearsal" in target:  # built by the pipeline: its config is known before the folder exists
        layers = RehearsalTargetConfig(**target["rehearsal"] or {}).num_hidden_layers
        architectures = REHEARSAL_ARCHITECTURES
    elif (Path(target["path"]) / "config.json").exists():
        architectures = target_architectures(target["path"])
    elif target.get("config_json"):  # the real target's config before its folder is here (kimi-k2.5.yaml)
        try:
            described = read_described_config(target["config_json"])
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read it: {e}", ("target", "config_json")) from None
        architectures = target_config_architectures(described)
        layers = layers or text_config(described).get("num_hidden_layers")
    if ids or layers:
        try:
            check_servable_aux_layer_ids(
                ids or default_aux_layer_ids(layers),
                layers or max(ids) + 2,
                architectures,
            )
        except ValueError as e:
            hint = "" if ids else f" (SGLang's default for {layers} layers; set hidden.aux_layer_ids)"
            raise ConfigError(f"{e}{hint}", ("hidden", "aux_layer_ids")) from None
    try:  # drafter.init's folder, where it is here, against the target, the aux layers, the vocab, the shape
        check_config_init(config, layers, architectures)
    except ValueError as e:
        raise ConfigError(str(e), ("drafter", "init")) from None

    held_out = any(d.get("bench_prompts", 0) > 0 for d in config["datasets"].values())
    if not held_out and not (config.get("bench") or {}).get("sets"):
        raise ConfigError(
            "no dataset reserves bench_prompts and bench.sets names no set, so the benchmark would have no prompts",
            ("datasets",),
        )


def _check_recorded(config: dict[str, Any], name: str) -> None:
    """A recorded dataset is answered already: API quota settings do not apply to it."""
    ds = config["datasets"][name]
    for key in ("max_output_tokens", "quota_reserve"):
        if key in ds and not (key == "quota_reserve" and ds[key] == QUOTA_RESERVE):
            raise ConfigError(
                "is an API quota; a recorded dataset costs nothing: cap it with max_samples (a seeded sample)",
                ("datasets", name, key),
            )


def responses_config(config: dict[str, Any], dataset: str) -> dict[str, Any]:
    """The responses settings of one dataset: the global section with the dataset's overrides.

    Overrides are checked against the responses schema (unknown keys and bad values name the dataset). A dataset
    whose source is recorded (aerie.recorded) has the backend ``recorded``: its answers exist, nothing is requested.
    """
    from aerie.config_file import schema_errors

    override = config["datasets"][dataset].get("responses") or {}
    merged = {**config["responses"], **override}
    if config["datasets"][dataset]["source"]["kind"] == "recorded":
        merged["backend"] = "recorded"
        merged.pop("serve", None)  # nothing is served for it either
    if override:
        errors = schema_errors(merged, _schema()["properties"]["responses"])
        if errors:
            path, message = errors[0]
            # A key the dataset overrides is named where the dataset sets it; a merged-in global key where it is.
            where = ("datasets", dataset, "responses") if path and path[0] in override else ("responses",)
            raise ConfigError(message, where + path)
    return merged


def api_run(config: dict[str, Any], plans: dict[str, DatasetPlan] | None = None) -> ApiRun:
    """The run's API settings resolved once, for the API job and the cost preview (aerie.api.settings): every
    dataset regenerated through an API with its merged, checked ``responses`` settings, and, with ``plans``,
    its planned training shards and their prompts in the plan's order."""
    from aerie.api.backends import API_BACKENDS
    from aerie.api.settings import ApiDataset, ApiRun, PlannedShard, TargetSettings, backend_settings
    from aerie.prompts import iter_planned_prompts

    target = config["target"]
    datasets = {}
    for name, section in config["datasets"].items():
        responses = responses_config(config, name)
        if responses["backend"] not in API_BACKENDS:
            continue
        plan = plans.get(name) if plans is not None else None
        datasets[name] = ApiDataset(
            name=name,
            responses=responses,
            section=section,
            settings=backend_settings(responses, target["path"]),
            shards=tuple(PlannedShard(s, *plan.shard_range(int(s))) for s in plan.shard_names) if plan else (),
            planned_prompts=functools.partial(iter_planned_prompts, plan, config["datasets"]) if plan else None,
        )
    return ApiRun(
        datasets=datasets,
        target=TargetSettings(
            path=str(target["path"]),
            trust_remote_code=bool(target.get("trust_remote_code", False)),
            device=str(target.get("device", "auto")),
        ),
        concurrency=config["responses"]["concurrency"],
        progress_interval_s=config["responses"]["progress_interval_s"],
        budget_usd=config["responses"].get("budget_usd"),
    )


@functools.cache
def _schema() -> dict[str, Any]:
    import yaml

    # libyaml's loader when PyYAML has it (4x faster; every `snakemake -n` pays this), else the Python one.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load((Path(__file__).resolve().parent.parent / "config" / "schema.yaml").read_text(), Loader=loader)


def _local_num_layers(target: dict[str, Any]) -> int | None:
    """Decoder layers of a local target folder (reads config.json only), else None."""
    if "demo" in target or "rehearsal" in target or not (Path(target["path"]) / "config.json").exists():
        return None
    return read_text_config(target["path"]).get("num_hidden_layers")


def plan_datasets(
    config: dict[str, Any], results_dir: Path | None = None, *, job: bool = False
) -> dict[str, DatasetPlan]:
    """Shard plan of every dataset (reads and validates each prompt source once).

    ``results_dir``: the run's results (prompt cache, journals, published shards); None plans as for a fresh
    folder without a cache. A dataset with an output-token quota plans only the shards the quota can use
    (:func:`quota_shards`). ``job``: the plan inside a job's own parse (a SLURM job re-reads the workflow): a
    quota'd dataset then plans exactly the shards whose prompts the run's main process already wrote, so the job
    sees the DAG its main process scheduled even when the journals have moved on since."""
    cache = prompt_cache_dir(results_dir) if results_dir is not None else None
    plans = {}
    for name, ds in config["datasets"].items():
        plan = plan_dataset(name, ds, config["datasets"], cache_dir=cache)
        if quota_sampled(config, name):
            state = (
                quota_state(config, name, plan, results_dir)
                if results_dir is not None
                else QuotaState(0, *_mean(config, name, None), on_disk=0, pending=0, reached=False)
            )
            seed = ds.get("sample_seed", 0)
            sampled = dataclasses.replace(plan, sample_seed=seed)
            if job:
                shards, note = state.on_disk, "as the run's main process planned it (its prompt shards)"
            else:
                shards, note = quota_shards(
                    sampled, ds["max_output_tokens"], ds.get("quota_reserve", QUOTA_RESERVE), state, f"datasets.{name}"
                )
            plan = dataclasses.replace(sampled, planned_shards=shards, note=note)
        elif ds["source"]["kind"] == "recorded" and ds.get("max_samples") is not None and plan.train:
            plan = recorded_sample(plan, ds["max_samples"], ds.get("sample_seed", 0), f"datasets.{name}")
        plans[name] = plan
    if job:  # the main process checked the plan; a job that runs before any prompts are written plans none
        return plans
    if not any(p.num_shards for p in plans.values()):
        raise ConfigError("every dataset is benchmark-only, so there is nothing to train on", ("datasets",))
    if results_dir is not None:
        for plan in plans.values():
            check_planned_shards(plan, config, results_dir)
    return plans


def recorded_sample(plan: DatasetPlan, max_samples: int, seed: int | None, where: str) -> DatasetPlan:
    """A recorded dataset cut to ``max_samples`` (whole shards) of a seeded sample of its pool (the quota'd datasets'
    order, aerie.prompts.sample_order): a 600k-conversation set is trained on the part the disk and the GPUs hold."""
    shards = min(plan.pool_shards, math.ceil(max_samples / plan.shard_size))
    sampled = dataclasses.replace(plan, sample_seed=seed, planned_shards=shards)
    how = f"a seeded sample ({where}.sample_seed {seed})" if seed is not None else "the source's order"
    return dataclasses.replace(
        sampled,
        note=(
            f"{shards} of {plan.pool_shards} shards ({sampled.planned_prompts:,} of {plan.train:,} recorded samples, "
            f"{how}): {where}.max_samples {max_samples:,}"
        ),
    )


def plan_text(plans: dict[str, DatasetPlan]) -> str:
    """The shard plan, for ``snakemake -n``: per dataset the shards planned and why."""
    planned = sum(p.num_shards for p in plans.values())
    pool = sum(p.pool_shards for p in plans.values())
    lines = [f"aerie shard plan: {planned} training shards ({pool} would hold every prompt)"]
    for name, p in plans.items():
        held = f"; {p.bench:,} held out for the benchmark" if p.bench else ""
        if not p.total and p.note:
            lines.append(f"  {name:<16}{p.note}")
        elif not p.train:
            lines.append(f"  {name:<16}benchmark only ({p.bench:,} prompts)")
        elif p.note:
            lines.append(f"  {name:<16}{p.note}{held}")
        else:
            lines.append(f"  {name:<16}{p.num_shards} shards ({p.train:,} prompts, every one){held}")
    return "\n".join(lines)


# ---- a dataset with an output-token quota: only the shards the quota can use ---------------------------------

# datasets.<name>.quota_reserve's default: prompts planned beyond what the quota admits at the expected length. A
# mean 20% shorter than expected (1 / 0.8 = 1.25) still fills the quota from the first plan; past that a later
# parse tops up. (A 20-sample pilot's mean of thinking answers, coefficient of variation ~0.8, is within ~18% at
# one standard error.)
QUOTA_RESERVE = 0.25


def quota_sampled(config: dict[str, Any], name: str) -> bool:
    """A dataset whose prompts are sampled to its quota: an API backend (the quota is enforced there), a
    ``max_output_tokens``, and ``sample_seed`` not null."""
    from aerie.api.backends import API_BACKENDS

    ds = config["datasets"][name]
    return (
        ds.get("max_output_tokens") is not None
        and ds.get("sample_seed", 0) is not None
        and responses_config(config, name)["backend"] in API_BACKENDS
    )


@dataclasses.dataclass(frozen=True)
class QuotaState:
    """What the run's files say about a quota'd dataset's progress (:func:`quota_state`)."""

    used_tokens: int  # output tokens journaled for the dataset (every shard, stale lines too: they were paid)
    mean_tokens: float  # expected output tokens per sample (measured once 20 are journaled)
    basis: str  # where mean_tokens comes from
    on_disk: int  # shards 0 .. on_disk - 1 already have prompts or responses: planned by an earlier run
    pending: int  # prompts of those shards that are unpublished and have no journaled answer yet
    reached: bool  # a published shard stopped at the quota (the current one, or a higher one)


def _mean(config: dict[str, Any], name: str, spent: dict[str, float] | None) -> tuple[float, str]:
    from aerie.api.money import mean_output_tokens

    spent = spent or {"samples": 0, "completion_tokens": 0, "cost": 0.0}
    return mean_output_tokens(responses_config(config, name), spent, (name, config["datasets"][name]))


def quota_state(config: dict[str, Any], name: str, plan: DatasetPlan, results_dir: Path) -> QuotaState:
    """Read the dataset's journals, completion records and shard files (no prompt is read)."""
    from aerie.api.journal import dataset_journal_totals, journal_path
    from aerie.formats.responses import QUOTA_REASON, read_completion

    responses = Path(results_dir) / name / "responses"
    spent = dataset_journal_totals(responses)
    mean, basis = _mean(config, name, spent)
    indices = [
        int(p.name[6:11])
        for folder in (Path(results_dir) / name / "prompts", responses)
        for p in folder.glob("shard-[0-9][0-9][0-9][0-9][0-9].jsonl")
    ]
    on_disk = max(indices) + 1 if indices else 0
    quota = config["datasets"][name]["max_output_tokens"]
    pending, reached = 0, False
    for k in range(min(on_disk, plan.pool_shards)):
        out = responses / f"shard-{k:05d}.jsonl"
        if out.exists():
            done = read_completion(out)
            recorded = (done or {}).get("max_output_tokens")
            if done and done.get("reason") == QUOTA_REASON and (recorded is None or recorded >= quota):
                reached = True
            continue
        start, stop = plan.shard_range(k)
        journal = journal_path(out)
        journaled = journal.read_bytes().count(b"\n") if journal.exists() else 0
        pending += max(0, stop - start - journaled)
    return QuotaState(int(spent["completion_tokens"]), mean, basis, on_disk, pending, reached)


def quota_shards(plan: DatasetPlan, quota: int, reserve: float, state: QuotaState, where: str) -> tuple[int, str]:
    """(training shards to plan, why) for a dataset with an output-token quota.

    The quota admits ``(quota - used) // mean`` more samples at the expected length; with the reserve that is
    the prompts wanted. Shards already planned (on disk) stay; more are planned only while the prompts of the
    unfinished ones fall short of what is wanted, and never once a shard has stopped at the quota: a first parse
    plans ``ceil(wanted / shard_size)`` shards, a later one tops up when the answers came out shorter than
    expected and every planned shard finished below the quota."""
    admitted = max(0, int((quota - state.used_tokens) // state.mean_tokens)) if state.mean_tokens > 0 else plan.train
    wanted = math.ceil(admitted * (1 + reserve))
    if state.reached:
        extra, why = 0, "a published shard stopped at the quota: no more shards"
    else:
        extra = math.ceil(max(0, wanted - state.pending) / plan.shard_size)
        why = (
            f"the quota admits ~{admitted:,} more samples at {state.mean_tokens:,.0f} output tokens "
            f"({state.basis}) + {reserve:.0%} reserve ({where}.quota_reserve) = {wanted:,} prompts"
        )
        if state.on_disk:
            why += f"; {state.pending:,} not yet answered in the {state.on_disk} shard(s) planned before"
    shards = min(plan.pool_shards, state.on_disk + extra)
    sampled = f"a seeded sample ({where}.sample_seed {plan.sample_seed})"
    return shards, (
        f"{shards} of {plan.pool_shards} shards ({min(plan.train, shards * plan.shard_size):,} of "
        f"{plan.train:,} prompts, {sampled}): {why}"
    )


def check_planned_shards(plan: DatasetPlan, config: dict[str, Any], results_dir: Path) -> None:
    """A shard already written keeps its prompts: refuse a plan that would put other prompts into an existing
    prompts shard (shard_size, sample_seed, the quota sampling or max_prompts changed since it was written).
    A source file newer than the shard is left to Snakemake, which writes the shard again from it."""
    from aerie.prompts import prompts_at, source_files

    folder = Path(results_dir) / plan.name / "prompts"
    shards = sorted(folder.glob("shard-[0-9][0-9][0-9][0-9][0-9].jsonl"))
    if not shards:
        return
    ds = config["datasets"][plan.name]
    newest_source = max((p.stat().st_mtime for p in source_files(ds["source"]) if p.exists()), default=0.0)
    for path in {shards[0], shards[-1]}:
        k = int(path.name[6:11])
        if k >= plan.num_shards or path.stat().st_mtime < newest_source:
            continue
        with open(path, "rb") as fh:
            first = fh.readline()
        if not first.strip():
            continue
        written = json.loads(first).get("id")
        start, _ = plan.shard_range(k)
        (planned,) = prompts_at(plan.name, ds, plan.positions(start, start + 1), config["datasets"], _cache(plan))
        if written != planned["id"]:
            raise ConfigError(
                f"{path} begins with prompt {written!r}, but this plan puts {planned['id']!r} first in shard {k}: "
                "the shards were planned with other settings (shard_size, sample_seed, max_prompts, a quota "
                "turned on or off). A written shard never changes: restore those settings (shards written in the "
                f"source's order, as before quotas sampled: datasets.{plan.name}.sample_seed: null), or move "
                f"results/{plan.name}/ away to plan the dataset afresh",
                ("datasets", plan.name),
            )


def _cache(plan: DatasetPlan) -> Path | None:
    return Path(plan.cache_dir) if plan.cache_dir else None
