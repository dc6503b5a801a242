"""Stage 3: responses -> token ids + loss masks (format ``aerie.tokens/1``), with a fidelity report.

The training sequence is the prompt rendered by the target's own chat template with the generation
prompt, followed by exactly what the target sampled. Rendering the finished conversation instead would
be wrong for a thinking model: Kimi's template drops the final turn's reasoning as "history".

When the backend kept the exact sampled ids they are used; the text rebuild
(``reasoning </think> content <eot>``) is computed too and compared, so every shard reports how many
samples a text-only API would have reproduced exactly.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from aerie.artifacts import FormatError, atomic_write_json, pack_sequences, read_jsonl, save_packed
from aerie.responses import RESPONSES_FORMAT
from aerie.target import end_of_turn_ids, load_tokenizer, render_prompt_ids, special_token_id

TOKENS_FORMAT = "aerie.tokens/1"
REPORT_FORMAT = "aerie.tokens-report/1"
MAX_EXAMPLES = 5


def rebuild_output_ids(tokenizer, reasoning: str | None, content: str, think_end_id: int, eot_id: int) -> list[int]:
    """The ids the target would have sampled for this text: reasoning, ``</think>``, content, end of turn.

    Segments are encoded separately and joined at special tokens, which split pre-tokenization, so the
    join is exact. Tool-call markers written as text in ``content`` become their special ids again.
    """
    ids: list[int] = []
    if reasoning is not None:
        ids += tokenizer.encode(reasoning, add_special_tokens=False) + [think_end_id]
    ids += tokenizer.encode(content, add_special_tokens=False)
    return ids + [eot_id]


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tokenize_shard(
    responses_path: Path,
    out_path: Path,
    report_path: Path,
    target_path: str,
    *,
    max_seq_len: int,
    overlong: str = "truncate",
    drop_truncated: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build packed ``input_ids`` / ``loss_mask`` for one responses shard and its fidelity report."""
    tok = load_tokenizer(target_path)
    think_end_id = special_token_id(tok, "</think>")
    eot_ids = end_of_turn_ids(tok)
    eot_id = eot_ids[0]

    seqs, masks, kept_ids = [], [], []
    dropped: Counter[str] = Counter()
    mismatches: list[dict[str, Any]] = []
    exact_available = retok_equal = prompt_tokens = generated_tokens = truncated_to_fit = 0
    usage_checked = usage_equal = 0
    records = read_jsonl(responses_path)
    for n, r in enumerate(records, start=1):
        where = f"{responses_path}:{n}"
        if r.get("format") != RESPONSES_FORMAT:
            raise FormatError(f"{where}: not an {RESPONSES_FORMAT} record (format={r.get('format')!r})")
        for key in ("id", "messages", "content", "finish_reason"):
            if key not in r:
                raise FormatError(f"{where}: missing field '{key}'")
        if r["finish_reason"] == "length" and drop_truncated:
            dropped["truncated_response"] += 1
            continue
        # API responses flagged at regeneration (empty answer, reasoning missing) are not trained on.
        bad = [f for f in r.get("flags", []) if f in ("empty", "no_reasoning")]
        if bad:
            dropped[bad[0]] += 1
            continue

        prompt_ids = render_prompt_ids(tok, r["messages"])
        if r.get("prompt_token_ids") is not None and r["prompt_token_ids"] != prompt_ids:
            # The ids the model actually saw differ from our rendering: the template or tokenizer changed.
            raise FormatError(
                f"{where}: prompt ids recorded at generation differ from the chat template's rendering at "
                f"position {_first_diff(prompt_ids, r['prompt_token_ids'])}; was the target or its template changed?"
            )
        rebuilt = rebuild_output_ids(tok, r.get("reasoning"), r["content"], think_end_id, eot_id)
        exact = r.get("output_token_ids")
        if exact is not None:
            exact_available += 1
            if rebuilt == exact:
                retok_equal += 1
            elif len(mismatches) < MAX_EXAMPLES:
                i = _first_diff(rebuilt, exact)
                mismatches.append({"id": r["id"], "first_diff": i, "exact": exact[i : i + 8], "rebuilt": rebuilt[i : i + 8]})
            output_ids = list(exact)
        else:
            output_ids = rebuilt
            # Text-only APIs: the server's own completion count is a cheap check of the rebuild.
            reported = (r.get("usage") or {}).get("completion_tokens")
            if reported is not None:
                usage_checked += 1
                usage_equal += int(reported) == len(rebuilt)
        if output_ids[-1] not in eot_ids and r["finish_reason"] != "length":
            raise FormatError(f"{where}: finish_reason is {r['finish_reason']!r} but the output does not end the turn")

        ids = prompt_ids + output_ids
        mask = [0] * len(prompt_ids) + [1] * len(output_ids)
        if len(ids) > max_seq_len:
            if overlong == "drop" or len(prompt_ids) >= max_seq_len:
                dropped["over_max_seq_len"] += 1
                continue
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
            truncated_to_fit += 1
        seqs.append(torch.tensor(ids, dtype=torch.int32))
        masks.append(torch.tensor(mask, dtype=torch.uint8))
        kept_ids.append(r["id"])
        prompt_tokens += len(prompt_ids)
        generated_tokens += sum(mask)

    if not seqs:
        raise FormatError(f"{responses_path}: no usable samples (dropped: {dict(dropped)})")
    input_ids, offsets = pack_sequences(seqs)
    loss_mask, _ = pack_sequences(masks)
    tokenizer_file = Path(target_path) / "tokenizer.json"
    tok_sha = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest() if tokenizer_file.exists() else None
    save_packed(
        out_path,
        {"input_ids": input_ids, "loss_mask": loss_mask, "seq_offsets": offsets},
        {
            "format": TOKENS_FORMAT,
            "sample_ids": kept_ids,
            "target": str(target_path),
            "tokenizer_sha256": tok_sha or "",
            "num_dropped": sum(dropped.values()),
        },
    )
    report = {
        "format": REPORT_FORMAT,
        "samples": len(records),
        "kept": len(kept_ids),
        "dropped": dict(dropped),
        "truncated_to_max_seq_len": truncated_to_fit,
        "exact_ids_available": exact_available,
        "retokenized_equal": retok_equal,
        "usage_length_checked": usage_checked,
        "usage_length_equal": usage_equal,
        "mismatches": mismatches,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated_tokens,
    }
    atomic_write_json(report_path, report)
    log(f"{out_path.name}: kept {len(kept_ids)}/{len(records)}, {generated_tokens} generated tokens, "
        f"text rebuild exact for {retok_equal}/{exact_available}, rebuilt length = server's count for "
        f"{usage_equal}/{usage_checked}")
    return report
