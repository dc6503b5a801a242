"""``aerie-sglang-capture`` (also ``python -m aerie.hidden.sglang_check``): GPU-host checks of the SGLang capture.

``make-tiny KIND OUT`` writes a random-weight target (``kimi``: Kimi K2.5's wrapper, code and tokenizer);
``check --target T --layers ...`` opens the capture exactly as the hidden rule does (the lm_head copy placed
first, then SGLang's workers, ``--tp`` of them) and compares every aux and final state, and the top-1 of the
copy's top-k targets, with transformers' (exit 1 on a mismatch). Run ``check`` first on a new GPU host and
after any change of the SGLang pin in envs/sglang.yaml.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from aerie.hidden.backends import open_sglang_capture
from aerie.hidden.sglang.capture import SGLangCapture
from aerie.hidden.sglang.mapping import SGLangMappingError, target_dims
from aerie.hidden.sglang.worker import backend_reference, resolve_backend
from aerie.hidden.sglang_check.check import TINY_KINDS, compare_with_transformers, make_tiny_target
from aerie.target_model.config import read_config

PROG = "aerie-sglang-capture"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description="GPU-host checks of aerie's SGLang capture backend (also: python -m aerie.hidden.sglang_check).",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser(
        "make-tiny", help="write a random-weight target folder (llama, deepseek, or kimi: K2.5's wrapper and code)"
    )
    mk.add_argument("kind", choices=TINY_KINDS)
    mk.add_argument("out", type=Path)
    ck = sub.add_parser("check", help="capture with SGLang and compare with transformers (exit 1 on a mismatch)")
    ck.add_argument(
        "--target",
        type=Path,
        required=True,
        help="a model transformers can also load on one GPU in fp32 (make-tiny, the demo target)",
    )
    ck.add_argument("--layers", type=int, nargs="+", required=True, help="aerie aux ids (decoder-layer outputs)")
    ck.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (GPUs), as hidden.sglang.tp_size")
    ck.add_argument(
        "--device",
        default="auto",
        help="where the lm_head copy goes, as target.device (auto: SGLang's rank-0 GPU)",
    )
    ck.add_argument("--seqs", type=int, default=4)
    ck.add_argument("--len", type=int, default=96, help="tokens per sequence (lengths vary from len/2 to len)")
    ck.add_argument("--trust-remote-code", action="store_true")
    ck.add_argument("--mem-fraction-static", type=float, default=0.5)
    ck.add_argument(
        "--expect-refusal",
        action="store_true",
        help="the ids must be refused by the check on the LOADED model (the early prediction is skipped)",
    )
    ck.add_argument(
        "--backend",
        metavar="MODULE:CLASS",
        default=backend_reference(SGLangCapture.backend),
        help="the class that drives SGLang (default %(default)s); an adapter for another SGLang "
        "version is checked with this before the pin in envs/sglang.yaml changes",
    )
    ck.add_argument("--out", type=Path, help="write the report (JSON), with the flat output shapes SGLang returned")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``make-tiny`` or ``check``; returns the exit status (0: passed)."""
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.cmd == "make-tiny":
        print(make_tiny_target(a.kind, a.out))
        return 0
    try:
        backend = resolve_backend(a.backend)
    except (ValueError, ImportError) as e:
        ap.error(f"--backend: {e}")
    kwargs = {"tp_size": a.tp, "mem_fraction_static": a.mem_fraction_static, "trust_remote_code": a.trust_remote_code}
    # --expect-refusal exercises the check on the loaded model, so the prediction before loading is skipped.
    options = {"backend": backend, "early_mapping_check": not a.expect_refusal}
    if a.expect_refusal:
        try:
            SGLangCapture(str(a.target), a.layers, **options, **kwargs).close()
        except SGLangMappingError as e:  # only this refusal passes: a worker that died proves nothing
            print(f"PASS: refused as expected:\n{e}")
            return 0
        print("FAIL: SGLang accepted ids it maps differently")
        return 1
    dims = target_dims(read_config(a.target))
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(2, a.len // 2), a.len + 1, (a.seqs,), generator=gen).tolist()
    seqs = [torch.randint(0, dims["vocab_size"], (n,), generator=gen) for n in lengths]
    started = time.perf_counter()
    # As the hidden rule opens it: the lm_head copy on its GPU first, then SGLang's workers.
    cap, head, head_facts = open_sglang_capture(
        str(a.target), a.layers, device=a.device, options={**options, **kwargs}, log=lambda m: print(m, flush=True)
    )
    with cap:
        load_s = time.perf_counter() - started
        t0 = time.perf_counter()
        captured = cap.capture(seqs)
        capture_s = time.perf_counter() - t0
        info = cap.info
    report = compare_with_transformers(
        a.target, cap.layer_ids, captured, seqs, trust_remote_code=a.trust_remote_code, lm_head_copy=head
    )
    report.update(
        {
            "sglang_version": cap.sglang_version,
            "backend": a.backend,
            "target": str(a.target),
            "layer_ids": a.layers,
            "tp": a.tp,
            "tp_rank_agreement": cap.rank_agreement,  # largest difference of a rank's states from rank 0's
            "lm_head_copy": head_facts,  # where the hidden rule keeps it, and what it holds there
            "lengths": lengths,
            "runner_info": info,
            "load_s": round(load_s, 1),
            "capture_s": round(capture_s, 3),
            "shapes": [{"aux": list(x.shape), "final": list(f.shape), "dtype": str(x.dtype)} for x, f in captured],
        }
    )
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    print("PASS" if report["ok"] else "FAIL")
    return 0 if report["ok"] else 1
