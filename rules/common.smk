import os
import re
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version

min_version("9.0")

# Scripts import the aerie package; make it importable from this checkout in every job (also inside
# per-rule conda envs, which do not have it installed). PYTHONPATH is set here, not required from the
# user, so it is no `envvars:` (which would fail when it is unset).
sys.path.insert(0, workflow.basedir)
os.environ.update(
    PYTHONPATH=os.pathsep.join(
        p for p in (workflow.basedir, os.environ.get("PYTHONPATH")) if p
    )
)

from aerie.plan.config_file import ConfigError, ConfigSources  # noqa: E402
from aerie.plan.drafters import planned_drafters  # noqa: E402
from aerie.plan.resolve import (  # noqa: E402
    bench_settings,
    check_config,
    hidden_layer_ids,
    hidden_settings,
    token_settings,
    vocab_settings,
    plan_datasets,
    responses_config,
    sampling_settings,
    validate_config,
)
from aerie.formats.responses import loads_target  # noqa: E402
from aerie.sources.datasets import prompt_cache_dir  # noqa: E402
from aerie.targets import builder_of  # noqa: E402

# Snakemake has merged the config files and forgotten where each value came from (and kept the last of two equal
# keys). Re-read them with line numbers (aerie.plan.config_file), so that a duplicate key, an unknown key, a wrong type
# or a value out of range fails here - in `snakemake -n` too - naming the key path, the file and the line.
try:
    CONFIG_SOURCES = ConfigSources.read(
        workflow.configfiles, workflow.config_settings.config
    )
except ConfigError as e:
    raise WorkflowError(f"bad configuration: {e}") from None
try:
    validate_config(config, CONFIG_SOURCES)  # config/schema.yaml; fills in its defaults
    check_config(config)
    # A SLURM job re-reads the workflow: its plan is the one its main process scheduled (aerie.plan.resolve.plan_datasets).
    PLANS = plan_datasets(config, Path("results"), job=not workflow.is_main_process)
except ConfigError as e:
    raise WorkflowError(f"bad configuration: {CONFIG_SOURCES.describe(e)}") from None
except ValueError as e:
    raise WorkflowError(f"bad configuration: {e}") from None

# Every GPU job's memory per GPU against the host's (aerie.preview.fit): a job that cannot fit stops the parse - the dry
# run's and the real run's - naming the setting to change, before any job runs and any money is spent. (A job's own
# parse under SLURM skips it: its main process checked the plan.)
if workflow.is_main_process:
    from aerie.preview.fit import fit_plan

    try:
        FIT = fit_plan(config, PLANS)
    except (OSError, ValueError) as e:
        raise WorkflowError(f"bad configuration: the fit plan: {e}") from None
    if getattr(workflow.output_settings, "dryrun", False):
        print(FIT.text(), file=sys.stderr)
    if FIT.failures():
        raise WorkflowError(f"the fit plan refuses this run: {FIT.error()}")

RUN = config["run"]
# The run's drafters (aerie.plan.drafters): one named RUN, or one per entry of `drafters` named RUN-<key>; each
# trains into results/drafter/<name>/ from the same hidden shards, captured once at every drafter's layers.
DRAFTERS = {d.name: d for d in planned_drafters(config, Path.cwd())}
HIDDEN_LAYER_IDS = hidden_layer_ids(
    config
)  # None: the target's depth is unknown at parse time (EAGLE-3 only)
# The one draft vocabulary of the run, for the drafters whose kind has one (EAGLE-3), taken from their warm-start
# folder when they have one.
VOCAB_DRAFTERS = [
    d for d in DRAFTERS.values() if d.train.drafter_kind.needs_draft_vocab
]
VOCAB_INITS = sorted({d.train.init for d in VOCAB_DRAFTERS if d.train.init})
if len(VOCAB_INITS) > 1:
    raise WorkflowError(
        f"bad configuration: drafters with a draft vocabulary start from different folders {VOCAB_INITS}: a run "
        "has one draft vocabulary; train them in two runs"
    )
# Converted prompt sources, read by every parse (aerie.sources.cache).
PROMPT_CACHE = str(prompt_cache_dir(Path("results")))
TARGET = config["target"]["path"]
# A target the pipeline builds (target.demo, target.rehearsal: aerie.targets), None for an existing folder.
TARGET_BUILDER = builder_of(config["target"])


wildcard_constraints:
    dataset="|".join(sorted(config["datasets"])),
    drafter="|".join(map(re.escape, sorted(DRAFTERS))),
    shard=r"\d{5}",
    run=r"[A-Za-z0-9][A-Za-z0-9_.-]*",


def get_target_input():
    """A built target (demo, rehearsal) is its rule's output (a dependency); a real target is an existing folder."""
    return [TARGET] if TARGET_BUILDER is not None else []


def get_prompt_source(wildcards):
    """The dataset's local prompt files (a newer file re-shards); none for Hub datasets and HumanEval."""
    from aerie.sources.datasets import source_files

    return [
        str(p) for p in source_files(config["datasets"][wildcards.dataset]["source"])
    ]


def get_shards(stage, suffix):
    """Every training shard of every dataset for a stage, e.g. get_shards("hidden", "safetensors")."""
    return [
        f"results/{name}/{stage}/shard-{shard}.{suffix}"
        for name, plan in PLANS.items()
        for shard in plan.shard_names
    ]


def get_drafter_init(wildcards=None):
    """A drafter's warm-start folder's config.json and weights (a changed folder retrains; with no wildcards: the
    vocabulary's, for rule draft_vocab), none without an init; a real run refuses to start when the folder is absent
    (the dry run says where it looked), before any money is spent.
    """
    from aerie.drafter_kinds.folders import weight_files

    if wildcards is None:
        folders = [d.init_folder for d in VOCAB_DRAFTERS if d.train.init]
    else:
        folders = [DRAFTERS[wildcards.drafter].init_folder]
    folder = next((f for f in folders if f is not None), None)
    if folder is None:
        return []
    return [str(folder / "config.json"), *map(str, weight_files(folder))]


def get_drafter_vocab(wildcards):
    """The draft vocabulary file, for a drafter whose kind trains one."""
    kind = DRAFTERS[wildcards.drafter].train.drafter_kind
    return ["results/vocab/draft_vocab.safetensors"] if kind.needs_draft_vocab else []


def get_bench_prompts():
    return [
        f"results/{name}/prompts/bench.jsonl"
        for name, plan in PLANS.items()
        if plan.bench > 0
    ]


def get_final_outputs():
    return [
        f"results/bench/{RUN}.json",
        f"results/bench/{RUN}.png",
        "results/report/spend.png",  # rule report_figures (all figures of snakemake --report)
        # model_card (its rule): each drafter's folder to publish, with its model card
        *(f"results/publish/{name}" for name in DRAFTERS),
    ]


def all_cores():
    """The cores given with --cores; 1 for commands that run no job (--unlock, --lint, --summary)."""
    try:
        return workflow.cores
    except WorkflowError:
        return 1


def gpus(rule_key):
    return config["resources"][f"{rule_key}_gpus"]


def get_responses_config(wildcards):
    return responses_config(config, wildcards.dataset)


def get_responses_target(wildcards):
    """The target folder when the job reads it (in-process, a loopback server, or ids for sglang)."""
    from aerie.responses.api.backends import api_backend, is_api_backend

    r = get_responses_config(wildcards)
    ids = is_api_backend(r["backend"]) and api_backend(r["backend"]).sends_token_ids
    return get_target_input() if loads_target(r) or ids else []


def get_responses_threads(wildcards):
    """An API client needs one core; in-process generation and a loopback server take them all."""
    r = get_responses_config(wildcards)
    return all_cores() if loads_target(r) else 1


def get_responses_gpus(wildcards):
    r = get_responses_config(wildcards)
    return gpus("responses") if loads_target(r) else 0


def cost_preview():
    """The pending API work per dataset, cut at each quota (aerie.preview.money.CostPreview; None without API datasets)."""
    from aerie.preview.money import cost_preview as preview
    from aerie.plan.resolve import api_run

    try:
        return preview(api_run(config, PLANS), Path("results"))
    except ValueError as e:
        raise WorkflowError(f"bad configuration: {e}") from None


# `snakemake -n` shows what the pending API work will cost and produce before anything is spent, and the
# disk its hidden states will take (both cut at each dataset's output-token quota).
if workflow.is_main_process and getattr(workflow.output_settings, "dryrun", False):
    from aerie.plan.resolve import plan_text

    print(plan_text(PLANS), file=sys.stderr)
    _preview = cost_preview()
    if _preview is not None:
        print(_preview.text, file=sys.stderr)
    from aerie.responses.recorded import recorded_preview

    _recorded = recorded_preview(config, PLANS, Path("results"))
    if _recorded:
        print(_recorded, file=sys.stderr)
    from aerie.preview.disk import disk_preview, expected_tokens_per_sample

    _tokens_per_sample = expected_tokens_per_sample(config, Path("results"), PLANS)
    _expected_samples = (
        {n: e.expected_samples for n, e in _preview.datasets.items()}
        if _preview is not None
        else None
    )
    print(
        disk_preview(
            config,
            PLANS,
            Path("results"),
            _tokens_per_sample,
            expected_samples=_expected_samples,
        ),
        file=sys.stderr,
    )
    # hours per GPU stage, from committed measurements only (aerie.preview.timing)
    from aerie.preview.timing import planned_samples, time_preview

    print(
        time_preview(
            config, planned_samples(PLANS, _expected_samples), _tokens_per_sample
        ),
        file=sys.stderr,
    )


# drafter.init: the dry run shows where each start folder is and what is taken from it; a real run without a folder
# stops here, before any job runs (training could not start from it after the responses were paid for).
if workflow.is_main_process:
    from aerie.preview.drafters import init_preview_text

    for _drafter in DRAFTERS.values():
        if not _drafter.train.init:
            continue
        if getattr(workflow.output_settings, "dryrun", False):
            print(init_preview_text(_drafter), file=sys.stderr)
        elif _drafter.init_folder is None:
            raise WorkflowError(
                f"bad configuration: {'.'.join(_drafter.where)}.init: {_drafter.train.init!r} is not here "
                "(snakemake -n says where it looked)"
            )


def end_dry_run_without_conda():
    """Called at the end of the Snakefile, once every included file printed its part of the preview: a dry run on a
    machine without conda (the preview, on a laptop) ends cleanly here instead of Snakemake's "Is conda installed"
    failure while it builds the DAG (aerie.plan.environments)."""
    from aerie.plan.environments import preview_without_conda

    message = preview_without_conda(workflow)
    if message:
        print(message, file=sys.stderr)
        sys.exit(0)


def refuse_over_budget():
    """Called from onstart (real runs only): refuse to start when the estimate exceeds what the budget
    leaves after the journals and what the account billed (or may bill) beyond them."""
    from aerie.responses.api.money import usd

    result = cost_preview()
    if result is None:
        return
    print(result.text, file=sys.stderr)
    budget, used = result.budget, result.spent + result.lost
    if (
        budget is not None
        and result.pending_usd > budget - used
        and not config["allow_over_budget"]
    ):
        raise WorkflowError(
            f"the pending API work is estimated at {usd(result.pending_usd)} but only {usd(budget - used)} of "
            f"responses.budget_usd ${budget:.2f} remains (spent: {result.words}); raise the budget, reduce the "
            "prompts or the quotas, or set --config allow_over_budget=True to run until the budget stops it"
        )
