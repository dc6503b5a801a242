"""Stage 3: responses -> token ids + loss masks (format ``aerie.tokens/2``), with a fidelity report.

The training sequence is the prompt rendered by the target's own chat template with the generation
prompt (and the request's tools and system prompt), followed by exactly what the target sampled.
Rendering the finished conversation instead would be wrong for a thinking model: Kimi's template drops
the final turn's reasoning as "history".

The generated part is rebuilt from the record's text as ``[<think>] reasoning </think> content
[tool-call section] <turn end>``: each text segment is encoded on its own and joined with the special
ids read from the tokenizer, so nothing merges or strips across a special-token boundary. The tool-call
section comes from the template itself (it renders the API's structured ``tool_calls``); tool-call
markers the model wrote into ``content`` as text (no ``tools`` sent) become their special ids again.

When the backend kept the exact sampled ids (in-process ``hf``, SGLang ``/generate``) they are trained
on, and the text rebuild is compared with them: every mismatch is classified, so each shard says how
many samples a text-only API would have reproduced exactly and why the others differ.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from aerie.artifacts import FormatError, atomic_write_json, read_jsonl
from aerie.formats.responses import RESPONSES_FORMAT
from aerie.formats.tokens import (  # noqa: F401 - re-exported for the stage's readers and tests
    REPORT_FORMAT, TOKENS_FORMAT, FidelityError, check_loss_mask, check_tokens_shard, write_tokens_shard,
)
from aerie.target.chat import ChatFormat, read_chat_format, render_prompt_ids
from aerie.target.model import load_tokenizer, read_generation_config

MAX_EXAMPLES = 5  # per mismatch class / drop reason

# Why the text rebuild of a sample differs from the ids the model sampled (see classify_mismatch).
MISMATCH_CLASSES = (
    "non_canonical",  # same text, other segmentation: the model sampled e.g. ' learn' + 'ing' for ' learning'
    "special_token_text",  # the model spelled a special token's text with ordinary pieces; re-encoding merges it
    "boundary_whitespace",  # whitespace around </think> lost between the model and the record
    "reasoning_missing",  # the model reasoned, the record has no reasoning
    "replacement_characters",  # U+FFFD in the text: bytes of a split multi-byte character were lost
    "other",  # none of the above: a bug to look at (aerie's own code must never cause one)
)
# Drops that say the data is unfaithful (not ones the config asked for, such as over-long samples).
FIDELITY_DROPS = ("empty", "no_reasoning", "reasoning_missing", "replacement_characters", "invalid_text")


# ----------------------------------------------------------------------------------------------------------
# rebuilding the generated ids from text


def tool_calls_text(tokenizer, fmt: ChatFormat, messages: list[dict[str, Any]], tool_calls: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> str:
    """The tool-call section the target wrote for ``tool_calls``, as its own template renders it.

    The template is asked to render the conversation followed by an assistant turn holding these calls
    (a tool-call turn keeps its place in the "current" part of Kimi's template), and the text between a
    sentinel content and the turn end is the section, e.g. ``<|tool_calls_section_begin|>...<|tool_calls_section_end|>``.
    """
    sentinel = "\u2063aerie-tool-calls\u2063"
    probe = messages + [{"role": "assistant", "content": sentinel, "reasoning_content": "", "tool_calls": tool_calls}]
    kwargs = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False, **kwargs)
    start = text.rfind(sentinel)
    if start < 0:
        raise FormatError("the chat template does not render an assistant turn's content: cannot place tool calls")
    after = text[start + len(sentinel):]
    end = after.find(fmt.token_text(tokenizer, fmt.turn_end_id))
    section = after if end < 0 else after[:end]
    if not section:
        raise FormatError("the chat template renders no tool-call section for an assistant turn with tool_calls")
    return section


def encode_text(tokenizer, text: str) -> list[int]:
    """Ids of ``text`` with special-token text matched as single ids (no BOS/EOS added).

    Fast tokenizers go straight to their Rust backend (the same call transformers makes, without its
    per-call bookkeeping); others (Kimi's tiktoken-based one) through ``encode``."""
    if not text:
        return []
    backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


def rebuild_output_ids(tokenizer, fmt: ChatFormat, prompt_ids: Sequence[int], reasoning: str | None, content: str,
                       tool_section: str = "") -> list[int]:
    """The ids the target would have sampled after ``prompt_ids`` for this text.

    ``<think>`` is added when the prompt does not already open the think block (Kimi-K2-Thinking's
    template; K2.5's prompt ends with it). Segments are encoded separately and joined at special ids.
    """
    ids: list[int] = []
    if reasoning is not None:
        if fmt.think_end_id is None:
            raise FormatError("the record has reasoning but the tokenizer defines no </think> token")
        if fmt.think_start_id is not None and (not prompt_ids or prompt_ids[-1] != fmt.think_start_id):
            ids.append(fmt.think_start_id)
        ids += encode_text(tokenizer, reasoning) + [fmt.think_end_id]
    ids += encode_text(tokenizer, content)
    ids += encode_text(tokenizer, tool_section)
    return ids + [fmt.turn_end_id]


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def classify_mismatch(tokenizer, fmt: ChatFormat, exact: Sequence[int], rebuilt: Sequence[int],
                      reasoning: str | None, content: str) -> str:
    """Why the text rebuild differs from the exact sampled ids: one of MISMATCH_CLASSES."""
    exact_text, rebuilt_text = _decode(tokenizer, exact), _decode(tokenizer, rebuilt)
    # First: U+FFFD decodes the same whatever bytes were lost, so equal texts prove nothing here.
    if "\ufffd" in exact_text or "\ufffd" in (reasoning or "") or "\ufffd" in content:
        return "replacement_characters"
    if exact_text == rebuilt_text:
        exact_special = sum(i in fmt.special_ids for i in exact)
        rebuilt_special = sum(i in fmt.special_ids for i in rebuilt)
        return "special_token_text" if rebuilt_special > exact_special else "non_canonical"
    if fmt.think_end_id is not None and fmt.think_end_id in exact and not reasoning:
        return "reasoning_missing"
    if fmt.think_end_id is not None and fmt.think_end_id in exact and fmt.think_end_id in rebuilt:
        e, r = list(exact), list(rebuilt)
        ei, ri = e.index(fmt.think_end_id), r.index(fmt.think_end_id)
        # Each side of </think> equal up to the whitespace around it.
        same = lambda a, b: _decode(tokenizer, a).strip() == _decode(tokenizer, b).strip()  # noqa: E731
        if same(e[:ei], r[:ri]) and same(e[ei + 1:], r[ri + 1:]):
            return "boundary_whitespace"
    return "other"


# ----------------------------------------------------------------------------------------------------------
# the stage


def _valid_text(*texts: str | None) -> bool:
    """False for text a tokenizer cannot encode (a lone surrogate from JSON ``"\\ud800"``)."""
    try:
        for t in texts:
            if t:
                t.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _reasoning_tokens(usage: dict[str, Any] | None) -> int:
    details = (usage or {}).get("completion_tokens_details") or {}
    return int(details.get("reasoning_tokens") or 0)


def _template_kwargs(record: dict[str, Any]) -> dict[str, Any]:
    return dict((record.get("params") or {}).get("chat_template_kwargs") or {})


class _Report:
    """Counts and a few examples per class, written as the shard's fidelity report."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.drop_examples: dict[str, list[str]] = defaultdict(list)
        self.mismatch_classes: Counter[str] = Counter()
        self.mismatches: list[dict[str, Any]] = []
        self.usage_deltas: Counter[int] = Counter()
        self.prompt_mismatches: list[dict[str, Any]] = []
        self.usage_mismatches: list[dict[str, Any]] = []

    def drop(self, reason: str, sample_id: str) -> None:
        self.dropped[reason] += 1
        if len(self.drop_examples[reason]) < MAX_EXAMPLES:
            self.drop_examples[reason].append(sample_id)

    def mismatch(self, cls: str, example: dict[str, Any]) -> None:
        self.mismatch_classes[cls] += 1
        if sum(m["class"] == cls for m in self.mismatches) < MAX_EXAMPLES:
            self.mismatches.append({"class": cls, **example})


def tokenize_shard(
    responses_path: Path,
    out_path: Path,
    report_path: Path,
    target_path: str,
    *,
    max_seq_len: int,
    overlong: str = "truncate",
    drop_truncated: bool = True,
    max_dropped_fraction: float = 0.25,
    log: Callable[[str], None] = print,
    tokenizer=None,
) -> dict[str, Any]:
    """Build packed ``input_ids`` / ``loss_mask`` for one responses shard and its fidelity report.

    Fails (FidelityError, nothing written) when more than ``max_dropped_fraction`` of the samples are
    dropped, e.g. a provider that returns no reasoning. ``tokenizer`` overrides loading it from the target.
    """
    tok = tokenizer if tokenizer is not None else load_tokenizer(target_path)
    fmt = read_chat_format(tok, read_generation_config(target_path))
    stop_ids = set(fmt.stop_ids)
    rep = _Report()
    all_ids, lengths, prompt_lengths, kept_ids, cut = array("i"), [], [], [], []
    records = read_jsonl(responses_path)
    for n, r in enumerate(records, start=1):
        where = f"{responses_path}:{n}"
        if r.get("format") != RESPONSES_FORMAT:
            raise FormatError(f"{where}: not an {RESPONSES_FORMAT} record (format={r.get('format')!r})")
        for key in ("id", "messages", "content", "finish_reason"):
            if key not in r:
                raise FormatError(f"{where}: missing field '{key}'")
        sid = str(r["id"])
        reasoning, content = r.get("reasoning"), r["content"] or ""
        if r["finish_reason"] == "length" and drop_truncated:
            rep.drop("truncated_response", sid)
            continue
        # API responses flagged at regeneration (empty answer, reasoning missing) are not trained on.
        bad = [f for f in r.get("flags", []) if f in ("empty", "no_reasoning")]
        if bad:
            rep.drop(bad[0], sid)
            continue
        if not _valid_text(reasoning, content):
            rep.drop("invalid_text", sid)
            continue
        exact = r.get("output_token_ids")
        if exact is None:
            # Text only: the ids must come from the text, so text that lost information is not trained on.
            if not reasoning and _reasoning_tokens(r.get("usage")) > 0:
                rep.drop("reasoning_missing", sid)  # the server counted reasoning tokens it did not return
                continue
            if "\ufffd" in (reasoning or "") or "\ufffd" in content:
                rep.drop("replacement_characters", sid)
                continue

        tools = r.get("tools") or None
        prompt_ids = render_prompt_ids(tok, r["messages"], tools=tools, **_template_kwargs(r))
        if r.get("prompt_token_ids") is not None and r["prompt_token_ids"] != prompt_ids:
            # The ids the model actually saw differ from our rendering: the template or tokenizer changed.
            raise FormatError(
                f"{where}: prompt ids recorded at generation differ from the chat template's rendering at "
                f"position {_first_diff(prompt_ids, r['prompt_token_ids'])}; was the target or its template changed?"
            )
        if len(r["messages"]) > 1 and any(m.get("role") == "assistant" for m in r["messages"]):
            rep.counts["multi_turn"] += 1
        section = ""
        if r.get("tool_calls"):
            rep.counts["tool_calls"] += 1
            section = tool_calls_text(tok, fmt, r["messages"], r["tool_calls"], tools)
        rebuilt = rebuild_output_ids(tok, fmt, prompt_ids, reasoning, content, section)
        if exact is not None:
            rep.counts["exact_ids_available"] += 1
            exact = [int(i) for i in exact]
            if rebuilt == exact:
                rep.counts["retokenized_equal"] += 1
            else:
                cls = classify_mismatch(tok, fmt, exact, rebuilt, reasoning, content)
                i = _first_diff(rebuilt, exact)
                rep.mismatch(cls, {"id": sid, "first_diff": i, "exact": exact[i:i + 8], "rebuilt": rebuilt[i:i + 8],
                                   "exact_text": _decode(tok, exact[max(0, i - 4):i + 8]),
                                   "rebuilt_text": _decode(tok, rebuilt[max(0, i - 4):i + 8])})
            output_ids = exact
        else:
            output_ids = rebuilt
            usage = r.get("usage") or {}
            # Text-only APIs: the server's own token counts are a cheap check of the prompt and the rebuild.
            if usage.get("completion_tokens") is not None:
                rep.counts["usage_length_checked"] += 1
                delta = int(usage["completion_tokens"]) - len(rebuilt)
                rep.usage_deltas[delta] += 1
                rep.counts["usage_length_equal"] += delta == 0
                if delta and len(rep.usage_mismatches) < MAX_EXAMPLES:
                    rep.usage_mismatches.append({"id": sid, "server": int(usage["completion_tokens"]),
                                                 "rebuilt": len(rebuilt)})
            if usage.get("prompt_tokens") is not None:
                rep.counts["prompt_length_checked"] += 1
                if int(usage["prompt_tokens"]) == len(prompt_ids):
                    rep.counts["prompt_length_equal"] += 1
                elif len(rep.prompt_mismatches) < MAX_EXAMPLES:
                    rep.prompt_mismatches.append({"id": sid, "server": int(usage["prompt_tokens"]), "rendered": len(prompt_ids)})
        ended = bool(output_ids) and output_ids[-1] in stop_ids
        if not ended and r["finish_reason"] != "length":
            raise FormatError(f"{where}: finish_reason is {r['finish_reason']!r} but the output does not end the turn")

        n_prompt, n_total = len(prompt_ids), len(prompt_ids) + len(output_ids)
        if n_total > max_seq_len:
            if overlong == "drop" or n_prompt >= max_seq_len:
                rep.drop("over_max_seq_len", sid)
                continue
            rep.counts["truncated_to_max_seq_len"] += 1
            ended = False
        n = min(n_total, max_seq_len)
        if not ended:
            cut.append(len(lengths))
        # One flat int32 buffer for the shard: no per-sample tensor, the mask is built from the lengths.
        all_ids.extend(prompt_ids)
        all_ids.extend(output_ids[: n - n_prompt])
        lengths.append(n)
        prompt_lengths.append(n_prompt)
        kept_ids.append(sid)
        rep.counts["prompt_tokens"] += n_prompt
        rep.counts["generated_tokens"] += n - n_prompt

    total_dropped = sum(rep.dropped.values())
    if records and (not lengths or total_dropped > max_dropped_fraction * len(records)):
        reasons = ", ".join(f"{k}: {v} (e.g. {', '.join(rep.drop_examples[k][:3])})" for k, v in rep.dropped.most_common())
        hint = ""
        if rep.dropped.keys() & {"no_reasoning", "reasoning_missing"}:
            hint = (" - the server returned no reasoning for a thinking model: the provider drops it or its reasoning "
                    "parser is off; pick a provider that returns reasoning (responses.provider) or enable it")
        elif rep.dropped.keys() & {"truncated_response", "over_max_seq_len"}:
            hint = " - raise responses.max_new_tokens / tokens.max_seq_len, or set tokens.drop_truncated: false"
        raise FidelityError(f"{responses_path}: {total_dropped} of {len(records)} samples dropped (> "
                            f"tokens.max_dropped_fraction {max_dropped_fraction}): {reasons}{hint}")
    if not lengths:
        raise FormatError(f"{responses_path}: no samples")

    input_ids = torch.frombuffer(all_ids, dtype=torch.int32).clone()
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    # 1 from each sequence's first generated position to its end: position - start >= prompt length
    starts = torch.repeat_interleave(offsets[:-1], torch.tensor(lengths))
    positions = torch.arange(len(input_ids), dtype=torch.int64) - starts
    loss_mask = (positions >= torch.repeat_interleave(torch.tensor(prompt_lengths), torch.tensor(lengths))).to(torch.uint8)
    meta = {
        "sample_ids": kept_ids,
        "target": str(target_path),
        "tokenizer_sha256": _tokenizer_sha(target_path),
        "num_dropped": total_dropped,
        "generation_prompt_ids": list(fmt.generation_prompt_ids),
        "stop_ids": list(fmt.stop_ids),
        "cut_sequences": cut,
    }
    # Self-checked before publishing: a mask bug in this stage must never reach training.
    write_tokens_shard(out_path, {"input_ids": input_ids, "loss_mask": loss_mask, "seq_offsets": offsets}, meta)

    c = rep.counts
    report = {
        "format": REPORT_FORMAT,
        "samples": len(records),
        "kept": len(kept_ids),
        "dropped": dict(rep.dropped),
        "drop_examples": dict(rep.drop_examples),
        "truncated_to_max_seq_len": c["truncated_to_max_seq_len"],
        "multi_turn": c["multi_turn"],
        "tool_calls": c["tool_calls"],
        "exact_ids_available": c["exact_ids_available"],
        "retokenized_equal": c["retokenized_equal"],
        "mismatch_classes": {k: rep.mismatch_classes[k] for k in MISMATCH_CLASSES},
        "mismatches": rep.mismatches,
        "usage_length_checked": c["usage_length_checked"],
        "usage_length_equal": c["usage_length_equal"],
        "usage_length_deltas": {str(k): v for k, v in sorted(rep.usage_deltas.items())},
        "usage_length_mismatches": rep.usage_mismatches,
        "prompt_length_checked": c["prompt_length_checked"],
        "prompt_length_equal": c["prompt_length_equal"],
        "prompt_length_mismatches": rep.prompt_mismatches,
        "prompt_tokens": c["prompt_tokens"],
        "generated_tokens": c["generated_tokens"],
    }
    atomic_write_json(report_path, report)
    classes = ", ".join(f"{k} {v}" for k, v in report["mismatch_classes"].items() if v) or "none"
    log(f"{out_path.name}: kept {len(kept_ids)}/{len(records)}, {c['generated_tokens']} generated tokens; "
        f"text rebuild exact for {c['retokenized_equal']}/{c['exact_ids_available']} samples with exact ids "
        f"(mismatches: {classes}); rebuilt length = server's count for {c['usage_length_equal']}/"
        f"{c['usage_length_checked']}, prompt length for {c['prompt_length_equal']}/{c['prompt_length_checked']}")
    if rep.mismatch_classes["other"]:
        log(f"WARNING {out_path.name}: {rep.mismatch_classes['other']} unexplained rebuild mismatches (class 'other'); "
            f"see {report_path}")
    if c["prompt_length_checked"] and c["prompt_length_equal"] < c["prompt_length_checked"]:
        log(f"WARNING {out_path.name}: the server counted a different prompt length for "
            f"{c['prompt_length_checked'] - c['prompt_length_equal']} samples: its system prompt or chat template "
            f"differs from the target's (examples in {report_path})")
    return report


def _tokenizer_sha(target_path: str) -> str:
    tokenizer_file = Path(target_path) / "tokenizer.json"
    return hashlib.sha256(tokenizer_file.read_bytes()).hexdigest() if tokenizer_file.exists() else ""

