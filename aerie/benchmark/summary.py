"""A benchmark report's figures in the job's log: each method's, and each trained drafter's simulated vs measured
acceptance (either backend's ``aerie.bench/4`` report). Torch-free."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def log_summary(report: Mapping[str, Any], out_json: Path, log: Callable[[str], None]) -> None:
    """Each method's figures and each trained drafter's simulated vs measured acceptance (either backend's
    report)."""
    where = f" at concurrency {report['concurrency']}" if report.get("concurrency") is not None else ""
    nan = float("nan")
    for m, sm in report["methods"].items():
        kind = f", {sm['kind']}" if sm.get("kind") else ""
        log(
            f"{m} ({sm['role']}{kind}, {sm['draft_tokens']} drafts per step): speedup {sm['speedup'] or nan:.3f}x "
            f"(median paired {sm['speedup_median_paired'] or nan:.3f}x){where}, acceptance_length "
            f"{sm['acceptance_length'] or nan:.2f} (aerie's), spec_accept_length {sm['spec_accept_length'] or nan:.2f} "
            f"(SGLang's), lossless={sm['lossless']}, failed requests {sm['failed_requests']}"
        )
    for name, d in report["drafters"].items():
        log(
            f"{name}: simulated acceptance {d['simulated_acceptance_length'] or nan:.2f} (training eval) vs measured "
            f"{report['methods'][name]['acceptance_length'] or nan:.2f}"
        )
    log(
        f"{out_json}: baseline {report['baseline']['tokens_per_s'] or 0:.1f} tok/s{where}; degenerate prompts "
        f"{len(report['degenerate_prompts'])}/{report['prompts']}"
    )
