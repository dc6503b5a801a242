"""`snakemake -n` previews the disk the pending hidden shards will write."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import snakemake

from aerie.preview.disk import bytes_per_token


def test_demo_dry_run_previews_hidden_disk(workdir: Path) -> None:
    proc = snakemake(workdir, "-n")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    line = next(x for x in out.splitlines() if x.startswith("aerie disk preview"))
    # the demo's compact layout: 3 aux layers of the 256-wide demo target in fp8 + 3 fp32 scales + top-32 (int32 id,
    # fp16 log-prob), + id (int32) + loss mask (uint8); the full layout would be 4 x 256 x bf16 + 5 = 2,053
    assert bytes_per_token(256, 3, "bfloat16", "compact", 32) == 977
    assert bytes_per_token(256, 3, "bfloat16", "full") == 2053
    assert "5 pending hidden shards" in line and "x 977 bytes/token (compact:" in line, line
    tokens = int(re.search(r"~([\d,]+) tokens", line).group(1).replace(",", ""))
    gib = float(re.search(r"= ~([\d.]+) GiB", line).group(1))
    assert abs(gib - tokens * 977 / 2**30) < 0.01
    # beside it, the time preview (aerie.preview.timing): the demo trains on the CPU, where nothing is measured
    preview = out[out.index("aerie time preview") :].splitlines()[:4]
    assert [x.split()[0] for x in preview[1:]] == ["hidden", "drafter", "bench"], preview
    assert all("not estimated" in x for x in preview[1:]) and " h " not in "".join(preview), preview


def test_kimi_bytes_per_token() -> None:
    # Kimi K2.5: hidden 7168, aux [1, 29, 57] + final, bf16: 56 KiB a token (SpecForge stores the same 4 layers)
    assert bytes_per_token(7168, 3, "bfloat16", "full") == 4 * 7168 * 2 + 5
    # compact: fp8 aux + scales + top-32: 21 KiB, 0.38x
    assert bytes_per_token(7168, 3, "bfloat16", "compact", 32) == 3 * 7168 + 12 + 32 * 6 + 5
