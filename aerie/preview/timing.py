"""How long each GPU stage will take, printed by ``snakemake -n`` beside the fit plan (issue 29 item 5).

A throughput model whose constants come only from committed measurements, each line naming its source:
- **drafter** (training): ``bench/gpu_check.py`` JSONs (bench/results/gpu_check*.json) measured on the GPU model the
  run will use (``resources.gpu_model``, else the name nvidia-smi reports here). A step over one window of T rows
  takes ``a * T + b * T^2`` seconds (the matmuls, then the causal attention), fitted by least squares to that
  file's step times of the run's attention kernel (the CUDA path, ``flex``, unless ``drafter.attention_kernel``
  says otherwise) and drafter kind; packed batches attend within each sequence, so an epoch costs
  ``sum over samples of (a * n + b * n^2)`` with n each dataset's expected prompt + output tokens, split over
  ``resources.drafter_gpus`` ranks (balanced by cost: aerie.drafter.data.balance_ranks; bench/batch_packing.py
  measures the straggler ratio at 1.00x), times ``drafter.epochs``.
- **hidden** (capture) and **bench** (serving): no script measures their throughput yet, so the preview says so
  rather than guess.
Torch-free: it runs while Snakemake parses the workflow.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aerie.drafter_kinds import kinds
from aerie.drafter_kinds.kind import TargetView
from aerie.plan.drafters import PlannedDrafter, planned_drafters
from aerie.plan.resolve import target_view

MEASUREMENTS = Path(__file__).resolve().parents[2] / "bench" / "results"


@dataclass
class StepModel:
    """Seconds of one training step over a window of T rows: a * T + b * T^2, and where a and b come from."""

    a: float
    b: float
    source: str

    def seconds(self, rows: float) -> float:
        return self.a * rows + self.b * rows * rows


def gpu_model(config: dict[str, Any], nvidia_smi: str | None = "nvidia-smi") -> tuple[str | None, str]:
    """(the GPU model the jobs run on, where that came from): ``resources.gpu_model``, else nvidia-smi's first
    GPU here, else (None, why)."""
    configured = (config.get("resources") or {}).get("gpu_model")
    if configured:
        return str(configured), "resources.gpu_model"
    smi = shutil.which(nvidia_smi) if nvidia_smi else None
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            )
            names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
            if out.returncode == 0 and names:
                return names[0], "nvidia-smi"
        except (OSError, subprocess.SubprocessError):
            pass
    return None, "no resources.gpu_model and no nvidia-smi here"


def _matches(device: str, model: str) -> bool:
    """'NVIDIA H200' matches 'H200', 'h200' and 'NVIDIA H200'; a CPU measurement matches no GPU."""
    return model.lower() in device.lower() and not device.lower().startswith("cpu")


def step_model(measurements: Path, model: str, kind: str, kernel: str) -> StepModel | str:
    """The fitted step time for (GPU model, drafter kind, kernel) from the committed gpu_check JSONs, or why none."""
    files = sorted(measurements.glob("gpu_check*.json"))
    seen = []
    for path in files:
        data = json.loads(path.read_text())
        if data.get("toy"):
            continue
        seen.append(data.get("device", "?"))
        if not _matches(data.get("device", ""), model):
            continue
        points = [
            (p["T"], p["kernels"][kernel]["step_seconds"])
            for p in data.get("points", [])
            if p.get("kind") == kind and "step_seconds" in p.get("kernels", {}).get(kernel, {})
        ]
        if len(points) < 2:
            continue
        # least squares for (a, b) in t = a T + b T^2
        s11 = sum(T * T for T, _ in points)
        s12 = sum(T**3 for T, _ in points)
        s22 = sum(T**4 for T, _ in points)
        r1 = sum(T * t for T, t in points)
        r2 = sum(T * T * t for T, t in points)
        det = s11 * s22 - s12 * s12
        a, b = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
        if b < 0:  # noise at short windows: the linear term alone
            a, b = r1 / s11, 0.0
        Ts = sorted(T for T, _ in points)
        where = f"bench/results/{path.name}" if measurements == MEASUREMENTS else str(path)
        return StepModel(
            a, b, f"{where}: {data['device']}, {data.get('when', '?')}, {kind} kind, {kernel} kernel, "
            f"T = {Ts[0]:,}-{Ts[-1]:,}"
        )  # fmt: skip
    where = f"{measurements}/gpu_check*.json"
    others = f" (measured: {', '.join(sorted(set(seen)))})" if seen else ""
    return f"no committed measurement for {model}, {kind} kind, {kernel} kernel in {where}{others}"


def training_seconds(step: StepModel, samples_tokens: dict[str, tuple[float, float]], epochs: int, gpus: int) -> float:
    """``samples_tokens``: per dataset (samples, tokens per sample)."""
    work = sum(samples * step.seconds(n) for samples, n in samples_tokens.values())
    return epochs * work / max(1, gpus)


def planned_samples(plans: dict[str, Any], expected_samples: dict[str, int] | None) -> dict[str, int]:
    """Training samples per dataset: the plan's shards, cut to what the output quota admits (the cost preview's
    figure) where it gives one. Benchmark-only datasets train nothing."""
    out = {}
    for name, plan in plans.items():
        n = sum(plan.shard_range(int(s))[1] - plan.shard_range(int(s))[0] for s in plan.shard_names)
        if expected_samples is not None and name in expected_samples:
            n = min(n, int(expected_samples[name]))
        out[name] = n
    return out


def time_preview(
    config: dict[str, Any],
    samples: dict[str, int],
    tokens_per_sample: dict[str, float],
    measurements: Path = MEASUREMENTS,
    nvidia_smi: str | None = "nvidia-smi",
) -> str:
    """The dry run's paragraph: one line per GPU stage (per drafter), an estimate with its source or why none."""
    gpus = int(config["resources"]["drafter_gpus"])
    tokens = sum(samples[n] * tokens_per_sample.get(n, 0.0) for n in samples)
    lines = ["aerie time preview (GPU stages; constants from committed measurements only):"]
    lines.append(
        f"  hidden    capture of ~{tokens / 1e6:,.1f}M tokens: not estimated (no committed capture throughput "
        "measurement: bench/gpu_check.py measures training only)"
    )
    model, model_source = gpu_model(config, nvidia_smi)
    view = _target_view(config)
    for d in planned_drafters(config, Path.cwd()):
        train = d.train
        head = (
            f"  drafter   {d.name} ({d.kind}): ~{tokens / 1e6:,.1f}M tokens x {train.epochs} epochs on {gpus} "
            f"GPU{'s' if gpus != 1 else ''}"
        )
        if gpus < 1 or train.device == "cpu":
            lines.append(head + ": on the CPU, not estimated (no committed CPU training measurement)")
        elif model is None:
            lines.append(head + f": not estimated: GPU model unknown ({model_source}; set resources.gpu_model)")
        else:
            step = drafter_step_model(d, view, config, measurements, model)
            if isinstance(step, str):
                lines.append(head + f" ({model}, {model_source}): not estimated: {step}; run bench/gpu_check.py there")
                continue
            per_sample = {n: (samples[n], tokens_per_sample.get(n, 0.0)) for n in samples}
            hours = training_seconds(step, per_sample, train.epochs, gpus) / 3600
            lines.append(
                head + f" ({model}, {model_source}): ~{hours:,.1f} h (a step of T rows = {step.a:.3g} T + "
                f"{step.b:.3g} T^2 s, fitted to {step.source})"
            )
    lines.append(
        "  bench     not estimated (no committed serving throughput measurement; the benchmark's own runs report tok/s)"
    )
    return "\n".join(lines)


def _target_view(config: dict[str, Any]) -> TargetView | None:
    try:
        return target_view(config)
    except (OSError, KeyError, ValueError):
        return None


def drafter_step_model(
    drafter: PlannedDrafter, view: TargetView | None, config: dict[str, Any], measurements: Path, model: str
) -> StepModel | str:
    """The step-time fit of the drafter's kind measured on this GPU model (bench/gpu_check.py); for a kind without
    one there, EAGLE-3's fit on the same GPU scaled by the two kinds' training FLOPs per token (stated in the line:
    an estimate from a measured neighbour, not a measurement)."""
    kind, settings = drafter.train.drafter_kind, drafter.train.kind_settings
    label, kernel = kind.measurement_key(settings, view or TargetView({}))
    own = step_model(measurements, model, label, kernel)
    if not isinstance(own, str) or kind.name == "eagle3":
        return own
    if view is None:
        return f"{own}; the target's dimensions are unknown (set target.config_json) to scale EAGLE-3's"
    eagle = kinds()["eagle3"]
    eagle_settings = eagle.settings({})
    vocab = int(config["vocab"]["draft_vocab_size"])
    aux = config["hidden"].get("aux_layer_ids") or None
    eagle_layers = eagle.capture_layer_ids(eagle_settings, view, aux)
    e_label, e_kernel = eagle.measurement_key(eagle_settings, view)
    base = step_model(measurements, model, e_label, "flex" if e_kernel == "flex" else e_kernel)
    if isinstance(base, str):
        return f"{own}; nor for EAGLE-3 to scale from ({base})"
    layers = kind.capture_layer_ids(settings, view, aux)
    train = drafter.train
    mine = kind.train_flops_per_token(kind.shape(settings, view, vocab, layers), settings, train)
    theirs = eagle.train_flops_per_token(eagle.shape(eagle_settings, view, vocab, eagle_layers), eagle_settings, train)
    ratio = mine / theirs
    return StepModel(
        base.a * ratio,
        base.b * ratio,
        f"{base.source}, scaled by {kind.name}'s training FLOPs per token over EAGLE-3's ({ratio:.2f}x; no "
        f"{kind.name} measurement on {model})",
    )
