"""Parse-time checks and the shard plan: everything decided before any job runs.

Snakemake calls these while reading the workflow, so a bad setting or a malformed prompt file fails
``snakemake`` (and ``snakemake -n``) before any work, with a message naming the setting or file:line.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from aerie.benchmark.settings import BenchSettings
from aerie.drafter.traffic import check_traffic
from aerie.drafter_kinds.folders import DrafterFolderError
from aerie.drafter_kinds.kind import TargetView
from aerie.formats.backends import backend_named
from aerie.formats.responses import QUOTA_REASON, RECORDED, is_in_process, is_recorded, read_completion
from aerie.hidden.settings import CaptureSettings
from aerie.plan.config_file import ConfigError, ConfigSources, check_against_schema, schema_errors
from aerie.plan.drafters import PlannedDrafter, capture_layer_ids, drafter_layer_ids, planned_drafters
from aerie.responses.api.backends import api_backend, is_api_backend, provider_refusal
from aerie.responses.api.journal import dataset_journal_totals, journal_path
from aerie.responses.api.money import mean_output_tokens
from aerie.responses.api.settings import ApiDataset, ApiRun, PlannedShard, TargetSettings, responses_settings
from aerie.responses.sampling import Sampling
from aerie.sources.datasets import (
    DatasetPlan,
    iter_planned_prompts,
    plan_dataset,
    prompt_cache_dir,
    prompts_at,
    source_files,
)
from aerie.sources.recorded import is_recorded_dataset
from aerie.target_model.config import check_servable_aux_layer_ids
from aerie.targets import builder_of, planned_target
from aerie.tokens.settings import TokenSettings
from aerie.vocab.settings import VocabSettings

if TYPE_CHECKING:
    from aerie.responses.api.settings import ApiRun


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


def check_config(config: dict[str, Any]) -> None:
    """Checks beyond the schema: keys of dataclass-backed sections, backend needs, the benchmark set."""
    target = config["target"]
    try:
        builder = builder_of(target)
    except ValueError as e:
        raise ConfigError(str(e), ("target",)) from None
    if builder is not None:
        _dataclass_section(("target", builder.key), target[builder.key] or {}, builder.settings_class)
    drafters = planned_drafters(config, Path.cwd())  # ConfigError naming drafter.<key> / drafters.<name>.<key>
    check_recipe(config, drafters)

    for name in config["datasets"]:
        responses = responses_config(config, name)
        where = ("responses",) if "responses" not in config["datasets"][name] else ("datasets", name, "responses")
        backend = responses["backend"]
        if is_recorded_dataset(config["datasets"][name]):
            _check_recorded(config, name)
            continue
        if "max_samples" in config["datasets"][name]:
            raise ConfigError(
                "caps a recorded source (source.kind: recorded); an API dataset is capped by max_output_tokens",
                ("datasets", name, "max_samples"),
            )
        if is_recorded(backend):
            raise ConfigError("is set by a recorded source (source.kind: recorded), not by hand", where + ("backend",))
        if not is_in_process(backend):
            _check_api_responses(config, name, responses, where)

    try:  # the target's folder, its builder's description, or target.config_json (kimi-k2.5.yaml)
        planned = planned_target(target)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read it: {e}", ("target", "config_json")) from None
    _check_drafter_layers(config, drafters, planned)

    held_out = any(d.get("bench_prompts", 0) > 0 for d in config["datasets"].values())
    if not held_out and not (config.get("bench") or {}).get("sets"):
        raise ConfigError(
            "no dataset reserves bench_prompts and bench.sets names no set, so the benchmark would have no prompts",
            ("datasets",),
        )


def check_recipe(config: dict[str, Any], drafters: list[PlannedDrafter]) -> None:
    """vocab's warm-start rule, bench.traffic's sets and weights, and the datasets each drafter's replay_dataset and
    heldout_weights name: ConfigError naming the key before any job runs."""
    try:
        VocabSettings.of(config.get("vocab"))
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e), ("vocab",)) from None
    bench = config.get("bench") or {}
    datasets = list(config["datasets"])
    if bench.get("traffic"):
        sets = [n for n, d in config["datasets"].items() if d.get("bench_prompts", 0) > 0] + list(
            bench.get("sets") or {}
        )
        try:
            check_traffic(bench["traffic"], sets)
        except ValueError as e:
            raise ConfigError(str(e).removeprefix("bench.traffic"), ("bench", "traffic")) from None
    for d in drafters:
        named = [("replay_dataset", d.train.replay_dataset)] if d.train.replay_dataset else []
        named += [("heldout_weights", name) for name, _ in d.train.heldout_weights]
        for key, name in named:
            if name not in datasets:
                raise ConfigError(f"{name!r} is not a dataset of this config (its datasets: {', '.join(datasets)})",
                                  (*d.where, key))  # fmt: skip


def target_view(config: dict[str, Any]) -> TargetView | None:
    """The target as parse time knows it (aerie.targets.planned_target; else target.num_hidden_layers alone), None
    when nothing describes it."""
    target = config["target"]
    planned = planned_target(target)
    if planned is not None:
        return TargetView(planned.text_config, planned.architectures)
    known = {k: target[k] for k in ("num_hidden_layers", "hidden_size") if target.get(k)}
    return TargetView(known) if "num_hidden_layers" in known else None


def hidden_layer_ids(config: dict[str, Any]) -> list[int] | None:
    """The layers rule hidden captures: every drafter's (one capture serves them all), in layer order; None when
    parse time cannot know the target's depth (the hidden job resolves hidden.aux_layer_ids then: EAGLE-3 only)."""
    view = target_view(config)
    if view is None:
        return None
    return capture_layer_ids(planned_drafters(config, Path.cwd()), view, config["hidden"].get("aux_layer_ids"))


def sampling_settings(config: dict[str, Any], dataset: str) -> Sampling:
    """How the in-process backend samples ``dataset`` (its merged ``responses`` section), resolved once."""
    return Sampling.of(responses_config(config, dataset))


def bench_settings(config: dict[str, Any]) -> BenchSettings:
    """Rule bench's settings, resolved once: config ``bench.*`` (the backend, how every method decodes, the
    references as configured, the gate with the traffic mix). The job resolves the reference folders against the
    target once they are here, and adds its threads."""
    return BenchSettings.of(config["bench"])


def vocab_settings(config: dict[str, Any]) -> VocabSettings:
    """Rule draft_vocab's settings, resolved once: config ``vocab.*`` (its size; what a warm start does with the
    folder's vocabulary)."""
    return VocabSettings.of(config.get("vocab"))


def token_settings(config: dict[str, Any]) -> TokenSettings:
    """Rule tokens' settings, resolved once: config ``tokens.*`` and ``target.trust_remote_code`` (the tokenizer)."""
    tokens = config["tokens"]
    return TokenSettings(
        max_seq_len=tokens["max_seq_len"],
        overlong=tokens["overlong"],
        drop_truncated=tokens["drop_truncated"],
        drop_filtered=tokens["drop_filtered"],
        drop_degenerate=tokens["drop_degenerate"],
        special_token_text=tokens["special_token_text"],
        max_dropped_fraction=tokens["max_dropped_fraction"],
        keep_missing_reasoning=tokens["keep_missing_reasoning"],
        trust_remote_code=bool(config["target"].get("trust_remote_code", False)),
    )


def hidden_settings(config: dict[str, Any]) -> CaptureSettings:
    """Rule hidden's settings, resolved once: config ``hidden.*`` with the layers every drafter reads
    (``hidden_layer_ids``; None: hidden.aux_layer_ids, resolved against the target in the job) and ``target.*``
    for the load. The job adds its threads."""
    hidden, target = config["hidden"], config["target"]
    return CaptureSettings(
        aux_layer_ids=hidden_layer_ids(config) or hidden.get("aux_layer_ids"),
        layout=hidden["layout"],
        target_topk=hidden["target_topk"],
        backend=hidden["backend"],
        backend_options=backend_named("hidden", hidden["backend"]).options(config),
        batch_tokens=hidden["batch_tokens"],
        storage_dtype=hidden["storage_dtype"],
        device=target["device"],
        dtype=target["dtype"],
        trust_remote_code=bool(target.get("trust_remote_code", False)),
        min_next_token_agreement=hidden["min_next_token_agreement"],
        min_next_token_in_topk=hidden["min_next_token_in_topk"],
    )


def _check_drafter_layers(config: dict[str, Any], drafters: list[PlannedDrafter], planned: Any) -> None:
    """Each drafter's layers against the target (SGLang must capture and serve exactly them), the capture's union
    against SGLang's capture, and each warm-start folder that is here against its drafter."""
    ids = config["hidden"].get("aux_layer_ids")
    view = target_view(config)
    if view is None:
        if ids:
            try:
                check_servable_aux_layer_ids(ids, max(ids) + 2, ())
            except ValueError as e:
                raise ConfigError(str(e), ("hidden", "aux_layer_ids")) from None
        return
    layers = view.num_hidden_layers
    by_drafter = {}
    for d in drafters:
        try:
            by_drafter[d.name] = drafter_layer_ids(d, view, ids)
        except ValueError as e:
            if d.kind == "eagle3":
                hint = "" if ids else f" (SGLang's default for {layers} layers; set hidden.aux_layer_ids)"
                raise ConfigError(f"{e}{hint}", ("hidden", "aux_layer_ids")) from None
            raise ConfigError(str(e), (*d.where, "target_layer_ids")) from None
    union = sorted({i for v in by_drafter.values() for i in v})
    try:  # the capture reads them all at once, through SGLang's EAGLE-3 capture on a GPU host
        check_servable_aux_layer_ids(union, layers, view.architectures)
    except ValueError as e:
        raise ConfigError(f"the layers captured for every drafter {union}: {e}", ("hidden", "aux_layer_ids")) from None
    wanted = int((config.get("vocab") or {}).get("draft_vocab_size") or 32000)
    vocab = view.text_config.get("vocab_size")
    for d in drafters:
        if d.init_folder is None:
            continue
        try:
            d.train.drafter_kind.check_init_folder(
                d.init_folder,
                d.train.kind_settings,
                view if view.text_config.get("hidden_size") else None,
                by_drafter[d.name],
                min(wanted, vocab) if vocab else None,
            )
        except (DrafterFolderError, ValueError) as e:
            raise ConfigError(str(e), (*d.where, "init")) from None


def _check_api_responses(config: dict[str, Any], name: str, responses: dict[str, Any], where: tuple[str, ...]) -> None:
    """What an API backend needs of its settings (aerie.responses.api.backends says what each needs and offers)."""
    api = api_backend(responses["backend"])
    if api.needs_model and not responses.get("model") and not responses.get("serve"):
        raise ConfigError(f"required for the '{api.name}' backend (the API model name)", where + ("model",))
    if not responses.get("base_url") and not responses.get("serve"):
        raise ConfigError(f"required for the '{api.name}' backend", where + ("base_url",))
    if responses.get("serve") and not api.may_serve:
        raise ConfigError(f"starts an OpenAI-compatible server, which backend '{api.name}' is not", where + ("serve",))
    if responses.get("mode") == "batch" and not api.batch:
        raise ConfigError(f"backend '{api.name}' has no batch API: use mode stream", where + ("mode",))
    if responses.get("mode") == "batch" and (why := provider_refusal(responses.get("provider"))):
        raise ConfigError(why, where + ("provider",))
    own = config["datasets"][name].get("responses") or {}
    if "budget_usd" in own:
        raise ConfigError(
            "the budget is the run's (responses.budget_usd, one per run and key): a dataset has none of its own; cap "
            "a dataset with its max_output_tokens",
            ("datasets", name, "responses", "budget_usd"),
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
    whose source is recorded (aerie.sources.recorded) has the backend ``recorded``: its answers exist, nothing is
    requested.
    """
    override = config["datasets"][dataset].get("responses") or {}
    merged = {**config["responses"], **override}
    if is_recorded_dataset(config["datasets"][dataset]):
        merged["backend"] = RECORDED
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
    """The run's API settings resolved once, for the API job and the cost preview (aerie.responses.api.settings): every
    dataset regenerated through an API with its merged, checked ``responses`` settings as one typed object, the run's
    one budget, and, with ``plans``, each dataset's planned training shards and their prompts in the plan's order."""
    target = config["target"]
    datasets = {}
    for name, section in config["datasets"].items():
        responses = responses_config(config, name)
        if not is_api_backend(responses["backend"]):
            continue
        plan = plans.get(name) if plans is not None else None
        datasets[name] = ApiDataset(
            name=name,
            settings=responses_settings(responses, target["path"]),
            max_output_tokens=section.get("max_output_tokens"),
            expected_output_tokens=section.get("expected_output_tokens"),
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
    # libyaml's loader when PyYAML has it (4x faster; every `snakemake -n` pays this), else the Python one.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load((Path(__file__).resolve().parents[2] / "config" / "schema.yaml").read_text(), Loader=loader)


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
        elif is_recorded_dataset(ds) and ds.get("max_samples") is not None and plan.train:
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
    order, aerie.sources.datasets.sample_order): a 600k-conversation set is trained on the part the disk and the GPUs
    hold."""
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
    ds = config["datasets"][name]
    return (
        ds.get("max_output_tokens") is not None
        and ds.get("sample_seed", 0) is not None
        and is_api_backend(responses_config(config, name)["backend"])
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
    spent = spent or {"samples": 0, "completion_tokens": 0, "cost": 0.0}
    return mean_output_tokens(responses_config(config, name), spent, (name, config["datasets"][name]))


def quota_state(config: dict[str, Any], name: str, plan: DatasetPlan, results_dir: Path) -> QuotaState:
    """Read the dataset's journals, completion records and shard files (no prompt is read)."""
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
