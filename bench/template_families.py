"""Per-family table of the tokens stage on published chat templates: exact / fallback / refused per record.

Each family of tests/template_families.py (the template as published, a real 128k BPE with the family's
special tokens, text-only API records with system prompts, multi-turn history, tool calls and results,
empty and missing reasoning, edge whitespace, unicode) goes through the whole tokens stage; the table says
how many records were rebuilt as the template renders them (exact), framed as a tool-call turn (fallback),
or refused, and why. Prints a Markdown table (the one in bench/RESULTS.md).

    python bench/template_families.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from template_families import FAMILIES, family_records, family_tokenizer  # noqa: E402

from aerie.artifacts import write_jsonl  # noqa: E402
from aerie.formats.tokens import FidelityError  # noqa: E402
from aerie.tokens.stage import tokenize_shard  # noqa: E402


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="aerie-families-"))
    rows = []
    for fam in FAMILIES:
        folder = work / str(len(rows))
        family_tokenizer(fam, folder / "target")
        records = family_records(fam)
        write_jsonl(folder / "r.jsonl", records)
        try:
            report = tokenize_shard(
                folder / "r.jsonl",
                folder / "t.safetensors",
                folder / "t.json",
                str(folder / "target"),
                max_seq_len=1 << 20,
                max_dropped_fraction=1.0,
                log=lambda m: None,
            )
        except FidelityError as err:  # every record refused: the shard is refused
            report = err.report
        paths = report["rebuild_paths"]
        refused = ", ".join(f"{k} {v}" for k, v in sorted(report["dropped"].items())) or "-"
        rows.append(
            f"| {fam.name} | {len(records)} | {paths['exact']} | {paths['fallback']} | {paths['refused']} "
            f"| {refused} | {report['mismatch_classes']['template_normalised']} | {report['kept']} |"
        )
    print(
        "| family | records | exact | fallback | refused | refused / dropped because | text normalised by the "
        "template | kept |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
