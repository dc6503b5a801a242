"""Rule responses: the target answers one prompt shard (aerie.responses)."""

from aerie.gpu_slots import acquire_rule_gpus
from aerie.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
# First, before torch is imported: this job's own GPUs (CUDA_VISIBLE_DEVICES), or a clear failure when
# Snakemake granted fewer than the rule needs; a no-op without GPUs.
acquire_rule_gpus(snakemake, log)

from pathlib import Path  # noqa: E402

from aerie.api.backends import API_BACKENDS  # noqa: E402
from aerie.api.client import RegenerationStopped  # noqa: E402
from aerie.api.shard import regenerate_api_shard  # noqa: E402
from aerie.responses import generate_hf  # noqa: E402
from aerie.rulelog import snakemake_threads  # noqa: E402

cfg = snakemake.params.responses
config = snakemake.params.config
target = config["target"]
out = Path(snakemake.output[0])
if cfg["backend"] in API_BACKENDS:
    try:
        regenerate_api_shard(
            Path(snakemake.input.prompts),
            out,
            config,
            snakemake.wildcards.dataset,
            results_dir=out.parent.parent.parent,  # results/: every dataset's journals (the budget counts all)
            log=log,
        )
    except (RegenerationStopped, RuntimeError) as e:
        log(f"{out}: not finished: {e}")
        raise SystemExit(f"responses {out}: {e}") from None
else:
    generate_hf(
        Path(snakemake.input.prompts),
        out,
        target["path"],
        temperature=cfg["temperature"],
        top_p=cfg["top_p"],
        max_new_tokens=cfg["max_new_tokens"],
        batch_size=cfg["batch_size"],
        seed=cfg["seed"],
        device=target["device"],
        dtype=target["dtype"],
        threads=snakemake_threads(snakemake),
        trust_remote_code=target.get("trust_remote_code", False),
        log=log,
    )
