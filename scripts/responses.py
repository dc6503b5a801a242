"""Rule responses: the target answers one prompt shard (aerie.responses)."""

from pathlib import Path

from aerie.responses import API_BACKENDS, generate_hf
from aerie.rulelog import open_rule_log, snakemake_threads

log = open_rule_log(snakemake.log[0])
cfg = snakemake.params.responses
target = snakemake.params.target
if cfg["backend"] in API_BACKENDS:
    raise SystemExit(
        f"responses.backend '{cfg['backend']}': API backends are not in this version of aerie yet; "
        "use backend 'hf' (in-process) for now"
    )
generate_hf(
    Path(snakemake.input.prompts),
    Path(snakemake.output[0]),
    target["path"],
    temperature=cfg["temperature"],
    top_p=cfg["top_p"],
    max_new_tokens=cfg["max_new_tokens"],
    batch_size=cfg["batch_size"],
    seed=cfg["seed"],
    device=target["device"],
    dtype=target["dtype"],
    threads=snakemake_threads(snakemake),
    log=log,
)
