"""`snakemake -n` previews the disk the pending hidden shards will write."""

from __future__ import annotations

import re
from pathlib import Path

from aerie.disk import bytes_per_token
from conftest import snakemake


def test_demo_dry_run_previews_hidden_disk(workdir: Path) -> None:
    proc = snakemake(workdir, "-n")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    line = next(x for x in out.splitlines() if x.startswith("aerie disk preview"))
    # 3 aux layers + the final layer of the 256-wide demo target in bf16, + id (int32) + loss mask (uint8)
    assert bytes_per_token(256, 3, "bfloat16") == 2053
    assert "5 pending hidden shards" in line and "x 2,053 bytes/token" in line, line
    tokens = int(re.search(r"~([\d,]+) tokens", line).group(1).replace(",", ""))
    gib = float(re.search(r"= ~([\d.]+) GiB", line).group(1))
    assert abs(gib - tokens * 2053 / 2**30) < 0.01


def test_kimi_bytes_per_token() -> None:
    # Kimi K2.5: hidden 7168, aux [1, 29, 57] + final, bf16: 57 KiB a token (SpecForge stores the same 4 layers)
    assert bytes_per_token(7168, 3, "bfloat16") == 4 * 7168 * 2 + 5
