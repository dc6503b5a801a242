"""aerie.preview.timing: hours per GPU stage from committed measurements only, each with its source; without a
measurement of the run's GPU it says so and estimates nothing."""

from __future__ import annotations

import json

from aerie.preview.timing import StepModel, step_model, time_preview, training_seconds

CONFIG = {
    "resources": {"drafter_gpus": 8, "gpu_model": "H200"},
    "drafter": {"epochs": 3, "attention": "mla", "max_seq_len": 32768, "max_batch_tokens": 32768},
}


def measurement(tmp_path, device="NVIDIA H200", a=2e-5, b=1e-10, toy=False):
    points = [
        {
            "kind": "mla",
            "T": T,
            "kernels": {"flex": {"step_seconds": a * T + b * T * T}, "chunked": {"step_seconds": 9}},
        }
        for T in (4096, 8192, 16384, 32768)
    ]
    (tmp_path / "gpu_check.json").write_text(
        json.dumps(
            {"format": "aerie.bench.gpu-check/1", "toy": toy, "device": device, "when": "2026-12-03", "points": points}
        )  # fmt: skip
    )
    return tmp_path


def test_training_hours_come_from_the_fitted_measurement(tmp_path) -> None:
    where = measurement(tmp_path)
    step = step_model(where, "H200", "mla", "flex")
    assert isinstance(step, StepModel) and abs(step.a - 2e-5) < 1e-12 and abs(step.b - 1e-10) < 1e-16
    samples, per_sample = {"chat": 4000, "code": 6000}, {"chat": 3800.0, "code": 1500.0}
    text = time_preview(CONFIG, samples, per_sample, measurements=where, nvidia_smi=None)
    expected = training_seconds(step, {n: (samples[n], per_sample[n]) for n in samples}, 3, 8) / 3600
    assert expected == 3 * (4000 * step.seconds(3800) + 6000 * step.seconds(1500)) / 8 / 3600
    line = next(x for x in text.splitlines() if x.strip().startswith("drafter"))
    assert f"~{expected:,.1f} h" in line and str(where / "gpu_check.json") in line and "NVIDIA H200" in line
    assert "resources.gpu_model" in line
    assert "hidden" in text and "bench" in text and text.count("not estimated") == 2  # no capture/serving figures


def test_no_measurement_of_this_gpu_estimates_nothing(tmp_path) -> None:
    where = measurement(tmp_path, device="NVIDIA A100-SXM4-80GB")
    text = time_preview(CONFIG, {"chat": 10}, {"chat": 1000.0}, measurements=where, nvidia_smi=None)
    line = next(x for x in text.splitlines() if x.strip().startswith("drafter"))
    assert "not estimated: no committed measurement for H200" in line and "A100" in line and " h " not in line
    toy = measurement(tmp_path, device="NVIDIA H200", toy=True)  # a toy run is no measurement of the real dims
    text = time_preview(CONFIG, {"chat": 10}, {"chat": 1000.0}, measurements=toy, nvidia_smi=None)
    line = next(x for x in text.splitlines() if x.strip().startswith("drafter"))
    assert "not estimated: no committed measurement for H200" in line and " h " not in line, line
    unknown = {**CONFIG, "resources": {"drafter_gpus": 8}}
    text = time_preview(unknown, {"chat": 10}, {"chat": 1000.0}, measurements=where, nvidia_smi=None)
    assert "GPU model unknown" in text and "set resources.gpu_model" in text
