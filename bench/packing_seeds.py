"""Packed vs padded batches, the same training otherwise (issue 29 item 2: results must not change beyond seed
noise), over seeds, on the drafter tests' tiny world (a random 6-layer Llama target's own greedy data, 96
sequences of two lengths: 8-token prompts with 14 or 30 generated tokens, so padded rows carry padding).

    .venv/bin/python bench/packing_seeds.py          # ~3 min on one core; writes bench/results/packing_seeds.json

Per seed (drafter init, held-out split, batch order) both batchings train the same windows in the same batches
(the budget never closes a batch early at these lengths: packed membership equals padded membership) and the
held-out simulated acceptance and loss are compared. bench/tables.py renders the table.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results" / "packing_seeds.json"
SEEDS = (0, 1, 2)


def run() -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    import torch
    from tiny_world import TINY_TRAIN, target_world
    from transformers import LlamaConfig, LlamaForCausalLM

    from aerie.drafter.config import TrainConfig
    from aerie.drafter.loop import train_drafter

    torch.set_num_threads(1)
    target_cfg = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.1,
    )  # fmt: skip  (tests/test_drafter.py's target)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        target = LlamaForCausalLM(LlamaConfig(**target_cfg)).eval()
        with torch.no_grad():
            target.lm_head.weight.mul_(5.0)
        worlds = [
            target_world(
                Path(tmp) / f"w{n}",
                target,
                aux_layer_ids=[1, 2, 4],
                draft_vocab=128,
                num_seqs=48,
                prompt_len=8,
                new_tokens=n,
                id_prefix=f"len{n}",
            )  # fmt: skip
            for n in (14, 30)
        ]
        shards = [s for w in worlds for s in w["shards"]]
        for seed in SEEDS:
            for packing in (False, True):
                cfg = TrainConfig.of(**{**TINY_TRAIN, "epochs": 4, "seed": seed, "packing": packing})
                out = Path(tmp) / f"d{seed}{packing}"
                result = train_drafter(
                    shards, worlds[0]["vocab"], worlds[0]["target_dir"], out, cfg, log=lambda _: None
                )
                rows.append({"seed": seed, "packing": packing,
                             "acceptance": result["simulated_acceptance_length"],
                             "heldout_loss": result["heldout_loss"], "steps": result["optimizer_steps"],
                             "padded_per_real_token": result["windows"]["padded_per_real_token"]})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    data = {"bench": "packing_seeds", "seeds": list(SEEDS), "rows": rows}
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    return data


def table(data: dict | None = None) -> str:
    data = data or json.loads(RESULTS.read_text())
    rows = data["rows"]
    out = [
        "## Packed vs padded batches on the tiny world, over seeds (issue 29 item 2: training unchanged)",
        "",
        "`.venv/bin/python bench/packing_seeds.py`, raw rows `bench/results/packing_seeds.json`: the drafter tests' "
        "tiny Llama world (96 sequences of 22 or 38 tokens), 4 epochs, batch_size 8, per seed both batchings.",
        "",
        "| seed | padded: acceptance | packed: acceptance | padded: held-out loss | packed: held-out loss | steps "
        "| padded / real tokens (padded, packed) |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {(r["seed"], r["packing"]): r for r in rows}
    for seed in data["seeds"]:
        a, b = by[(seed, False)], by[(seed, True)]
        out.append(
            f"| {seed} | {a['acceptance']:.4f} | {b['acceptance']:.4f} | {a['heldout_loss']:.4f} | "
            f"{b['heldout_loss']:.4f} | {a['steps']} / {b['steps']} | {a['padded_per_real_token']:.2f}x, "
            f"{b['padded_per_real_token']:.2f}x |"
        )
    diffs = [by[(s, True)]["acceptance"] - by[(s, False)]["acceptance"] for s in data["seeds"]]
    spread = statistics.stdev(by[(s, False)]["acceptance"] for s in data["seeds"])
    out += ["", f"Acceptance, packed minus padded: largest |difference| {max(map(abs, diffs)):.2e}; the spread over "
            f"seeds (stdev, padded) is {spread:.3f}."]  # fmt: skip
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(table(run()))
