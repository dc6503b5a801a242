"""Per-family table of the tokens stage on published chat templates: exact / fallback / refused per record.

Each family of tests/template_families.py (the template as published, a real 128k BPE with the family's
special tokens, text-only API records with system prompts, multi-turn history, tool calls and results,
empty and missing reasoning, edge whitespace, unicode) goes through the whole tokens stage; the table says
how many records were rebuilt as the template renders them (exact), framed by a fallback learned from the
template's renders (fallback), or refused, and why. Reasoning is requested of reasoning families (the pipeline's
default for a thinking target), so their record with missing reasoning is dropped (`no_reasoning`) before the
template; ``--not-requested`` sends every record to the template. Prints a Markdown table (the one in
bench/RESULTS.md).

Before/after a change of the tokens stage: ``--ids FILE`` writes each kept record's sha256 of its ids (prompt +
generated) per family, ``--compare FILE`` says per family how many records kept then are kept now with the same
ids, and ``--code DIR`` runs the aerie package of another checkout (e.g. ``git archive COMMIT``) on this
checkout's families and fixtures:

    python bench/template_families.py
    python bench/template_families.py --not-requested --code /tmp/aerie-old --ids before.json
    python bench/template_families.py --not-requested --compare before.json
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(requested: bool) -> tuple[list[str], dict[str, dict[str, str]]]:
    """(table rows, {family: {record id: sha256 of its kept ids}}) of every family through the tokens stage."""
    from template_families import FAMILIES, family_records, family_tokenizer

    from aerie.formats.tokens import FidelityError, read_tokens_shard
    from aerie.tokens.settings import TokenSettings
    from aerie.tokens.stage import tokenize_shard
    from aerie.tools.artifacts import split_packed, write_jsonl

    asks = "reasoning_requested" in inspect.signature(tokenize_shard).parameters  # older aerie: never asked
    work = Path(tempfile.mkdtemp(prefix="aerie-families-"))
    rows, kept_ids = [], {}
    for fam in FAMILIES:
        folder = work / str(len(rows))
        family_tokenizer(fam, folder / "target")
        records = family_records(fam)
        write_jsonl(folder / "r.jsonl", records)
        kept_ids[fam.name] = {}
        try:
            report = tokenize_shard(
                folder / "r.jsonl",
                folder / "t.safetensors",
                folder / "t.json",
                str(folder / "target"),
                TokenSettings(max_seq_len=1 << 20, max_dropped_fraction=1.0),
                log=lambda m: None,
                **({"reasoning_requested": requested and fam.reasoning} if asks else {}),
            )
            tensors, meta = read_tokens_shard(folder / "t.safetensors")
            for sid, seq in zip(meta["sample_ids"], split_packed(tensors["input_ids"], tensors["seq_offsets"])):
                kept_ids[fam.name][sid] = hashlib.sha256(json.dumps(seq.tolist()).encode()).hexdigest()[:16]
        except FidelityError as err:  # every record refused: the shard is refused
            report = err.report
        paths = report["rebuild_paths"]
        refused = ", ".join(f"{k} {v}" for k, v in sorted(report["dropped"].items())) or "-"
        rows.append(
            f"| {fam.name} | {len(records)} | {paths['exact']} | {paths['fallback']} | {paths['refused']} "
            f"| {refused} | {report['mismatch_classes']['template_normalised']} | {report['kept']} |"
        )
    return rows, kept_ids


def compare(before: dict[str, dict[str, str]], after: dict[str, dict[str, str]]) -> list[str]:
    """Per family: records kept before, of those kept now with the same ids, changed, no longer kept, new."""
    lines = []
    for fam, now in after.items():
        then = before.get(fam)
        if then is None:
            lines.append(f"{fam}: not in the earlier run; kept now {len(now)}")
            continue
        same = [r for r in then if now.get(r) == then[r]]
        changed = sorted(r for r in then if r in now and now[r] != then[r])
        lines.append(
            f"{fam}: kept before {len(then)}, kept now with the same ids {len(same)}, changed {changed or '-'}, "
            f"no longer kept {sorted(set(then) - set(now)) or '-'}, newly kept {sorted(set(now) - set(then)) or '-'}"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--not-requested", action="store_true", help="reasoning not requested: every record is rendered")
    ap.add_argument("--code", type=Path, default=REPO, help="the checkout whose aerie package runs (default: this)")
    ap.add_argument("--ids", type=Path, help="write {family: {record id: sha256 of its kept ids}} here")
    ap.add_argument("--compare", type=Path, help="an earlier --ids file: say what changed per family")
    args = ap.parse_args()
    sys.path[:0] = [str(args.code.resolve()), str(REPO / "tests")]
    rows, kept_ids = run(requested=not args.not_requested)
    print(
        "| family | records | exact | fallback | refused | refused / dropped because | text normalised by the "
        "template | kept |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.ids:
        args.ids.write_text(json.dumps(kept_ids, indent=1, sort_keys=True) + "\n")
    if args.compare:
        print("\n" + "\n".join(compare(json.loads(args.compare.read_text()), kept_ids)))


if __name__ == "__main__":
    main()
