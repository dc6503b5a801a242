"""Compare the files of two workdirs byte for byte, and say what differs where they are not identical.

Used to check that a pipeline run is reproducible (two runs of the same config and code) or that a change left the
outputs alone (one run before, one after). Every file under each workdir (``.snakemake/`` excluded) is hashed with
sha256; files are grouped by their path with numbers replaced by ``*`` (``results/tasks/hidden/shard-*.safetensors``)
and a Markdown table prints, per group, how many files are byte-identical. For a file that differs, the table names
what differs: the tensors and metadata keys of a safetensors file, the key paths of a JSON or JSONL file, the
number of differing lines of a text file.

    .venv/bin/python bench/compare_runs.py /tmp/run-a /tmp/run-b [--must-match '*.safetensors' '*/prompts/*.jsonl']
        [--ignore-metadata capture_key]

Exit status 1 when a file matching a ``--must-match`` pattern (fnmatch on the path relative to the workdir, ``*``
crossing folders) differs or exists in one workdir only; 0 otherwise. A safetensors file whose tensors are identical
and whose metadata differs only in ``--ignore-metadata`` keys (values that legitimately name the run, such as the
capture key, which includes the target's mtime) does not fail the check; the table still counts it as differing.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

_SKIP_DIRS = {".snakemake", "__pycache__"}
_MAX_REASONS = 6  # per group: enough to name the differing fields without flooding the table


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def files_of(workdir: Path) -> dict[str, Path]:
    """Relative path -> file, for every regular file under ``workdir`` outside Snakemake's own folder."""
    out = {}
    for p in sorted(workdir.rglob("*")):
        rel = p.relative_to(workdir)
        if p.is_file() and not p.is_symlink() and not _SKIP_DIRS.intersection(rel.parts):
            out[rel.as_posix()] = p
    return out


def group_of(rel: str) -> str:
    return re.sub(r"\d+", "*", rel)


def _json_diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Key paths where two JSON values differ (lists compared by position)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            path = f"{prefix}.{k}" if prefix else str(k)
            if k not in a or k not in b:
                out.append(f"{path} (only in {'B' if k not in a else 'A'})")
            else:
                out += _json_diff(a[k], b[k], path)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _json_diff(x, y, f"{prefix}[{i}]")]
    return [] if a == b else [prefix or "(value)"]


def _strip_indices(path: str) -> str:
    return re.sub(r"\[\d+\]", "[]", path)


def _safetensors_diff(a: Path, b: Path) -> list[str]:
    import torch
    from safetensors import safe_open

    out = []
    with safe_open(str(a), framework="pt") as fa, safe_open(str(b), framework="pt") as fb:
        ka, kb = set(fa.keys()), set(fb.keys())
        out += [f"tensor {k} (only in A)" for k in sorted(ka - kb)] + [
            f"tensor {k} (only in B)" for k in sorted(kb - ka)
        ]
        for k in sorted(ka & kb):
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            same = x.dtype == y.dtype and x.shape == y.shape
            if same and x.numel():
                same = torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
            if not same:
                out.append(f"tensor {k}")
        ma, mb = fa.metadata() or {}, fb.metadata() or {}
    for k in sorted(set(ma) | set(mb)):
        if ma.get(k) != mb.get(k):
            out.append(f"metadata {k}")
    return out or ["same tensors and metadata, other bytes (header layout)"]


def what_differs(a: Path, b: Path) -> list[str]:
    """Short descriptions of how two differing files differ."""
    name = a.name
    try:
        if name.endswith(".safetensors"):
            return _safetensors_diff(a, b)
        if name.endswith(".json"):
            return [_strip_indices(d) for d in _json_diff(json.loads(a.read_text()), json.loads(b.read_text()))]
        if name.endswith(".jsonl"):
            la, lb = a.read_text().splitlines(), b.read_text().splitlines()
            if len(la) != len(lb):
                return [f"{len(la)} vs {len(lb)} lines"]
            return [_strip_indices(d) for x, y in zip(la, lb) for d in _json_diff(json.loads(x), json.loads(y))]
        la, lb = a.read_bytes().splitlines(), b.read_bytes().splitlines()
        changed = sum(x != y for x, y in zip(la, lb)) + abs(len(la) - len(lb))
        return [f"{changed} of {max(len(la), len(lb))} lines"]
    except (ValueError, UnicodeDecodeError, OSError) as e:  # not the format its name says: bytes differ, that's all
        return [f"bytes ({type(e).__name__})"]


def compare(a_dir: Path, b_dir: Path) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """Per group: files, identical, differing, one-sided, reasons; plus (path, status) of every non-identical file."""
    fa, fb = files_of(a_dir), files_of(b_dir)
    groups: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"files": 0, "identical": 0, "differ": 0, "one_side": 0, "why": []}
    )
    problems = []
    for rel in sorted(set(fa) | set(fb)):
        g = groups[group_of(rel)]
        g["files"] += 1
        if rel not in fa or rel not in fb:
            g["one_side"] += 1
            problems.append((rel, f"only in {'A' if rel in fa else 'B'}"))
        elif sha256(fa[rel]) == sha256(fb[rel]):
            g["identical"] += 1
        else:
            g["differ"] += 1
            reasons = what_differs(fa[rel], fb[rel])
            problems.append((rel, "; ".join(reasons)))
            g["why"] += [r for r in reasons if r not in g["why"]]
    rows = [{"group": k, **v} for k, v in sorted(groups.items())]
    return rows, problems


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| files | n | byte-identical | what differs |", "|---|---|---|---|"]
    for r in rows:
        why = r["why"][:_MAX_REASONS] + (["..."] if len(r["why"]) > _MAX_REASONS else [])
        if r["one_side"]:
            why.insert(0, f"{r['one_side']} in one run only")
        lines.append(f"| `{r['group']}` | {r['files']} | {r['identical']} | {', '.join(why) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="first workdir")
    ap.add_argument("b", type=Path, help="second workdir")
    ap.add_argument("--must-match", nargs="*", default=[], metavar="GLOB", help="paths that must be byte-identical")
    ap.add_argument(
        "--ignore-metadata",
        nargs="*",
        default=[],
        metavar="KEY",
        help="safetensors metadata keys that may differ in --must-match files",
    )
    ap.add_argument("--list", action="store_true", help="also list every non-identical file with what differs")
    args = ap.parse_args(argv)
    for d in (args.a, args.b):
        if not d.is_dir():
            ap.error(f"{d}: not a folder")
    rows, problems = compare(args.a, args.b)
    print(markdown(rows))
    n = sum(r["files"] for r in rows)
    print(f"\n{sum(r['identical'] for r in rows)} of {n} files byte-identical")
    if args.list:
        for rel, why in problems:
            print(f"- {rel}: {why}")
    allowed = {f"metadata {k}" for k in args.ignore_metadata}
    bad = [
        rel
        for rel, why in problems
        if any(fnmatch.fnmatch(rel, pat) for pat in args.must_match) and not set(why.split("; ")) <= allowed
    ]
    for rel in bad:
        print(f"MUST MATCH but differs: {rel}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
