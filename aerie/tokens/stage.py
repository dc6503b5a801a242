"""The tokens stage for one shard: responses records in, packed token ids + loss masks and a report out.

One job: ``tokenize_shard``, the rule's one call. It reads and checks each ``aerie.responses/1`` record,
decides whether it is trained on (finish reason, flags, text, the template's rendering of its turn through
``aerie.target_model.turns.render_turn``, the rebuild in ``aerie.tokens.rebuild``, degenerate loops, length),
applies the drop gate (``too_many_dropped``: a shard fails only on drops beyond chance), packs the kept
sequences into one flat buffer with their loss masks and writes the ``aerie.tokens/3`` shard
(``aerie.formats.tokens``) and its fidelity report (``aerie.tokens.fidelity``).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aerie.formats.responses import RESPONSES_FORMAT
from aerie.formats.tokens import FidelityError, write_tokens_shard
from aerie.target_model.chat import PROBE_USER, next_turn_opener, read_chat_format
from aerie.target_model.markers import check_template_markers
from aerie.target_model.model import load_tokenizer, read_generation_config
from aerie.target_model.template import TemplateRaised, tool_calls_for_template
from aerie.target_model.text_encoder import TextEncoder
from aerie.target_model.turns import TurnRefused, TurnText, render_turn
from aerie.tokens.fidelity import MAX_EXAMPLES, MISMATCH_CLASSES, ShardReport
from aerie.tokens.reasoning import reasoning_requested as _reasoning_requested
from aerie.tokens.rebuild import Drop, classify_mismatch, first_diff, mismatch_example, rebuild_generated
from aerie.tokens.settings import TokenSettings
from aerie.tools.artifacts import FormatError, atomic_write_json, read_jsonl
from aerie.tools.degenerate import degenerate_flags

FILTERED_FINISH_REASONS = ("content_filter", "error")


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


def _malformed(record: Any) -> str:
    """What makes this line no responses record ("" for a well-formed one)."""
    if not isinstance(record, dict) or record.get("format") != RESPONSES_FORMAT:
        got = record.get("format") if isinstance(record, dict) else type(record).__name__
        return f"not an {RESPONSES_FORMAT} record (format={got!r})"
    missing = [k for k in ("id", "messages", "content", "finish_reason") if k not in record]
    return f"missing field '{missing[0]}'" if missing else ""


def _early_drop(
    record: dict[str, Any], *, drop_truncated: bool, drop_filtered: bool, missing_reasoning_dropped: bool
) -> str:
    """The drop reason a record gets before its turn is rendered ("" when it goes on to the template).
    ``missing_reasoning_dropped``: this record's request asked for reasoning and the setting drops it missing."""
    reasoning, content = record.get("reasoning"), record["content"] or ""
    finish = str(record["finish_reason"])
    if finish == "length" and drop_truncated:
        return "truncated_response"
    if finish in FILTERED_FINISH_REASONS and drop_filtered:
        return f"finish_{finish}"  # a filtered or failed answer is not the model's turn
    if "empty" in record.get("flags", []):  # flagged at regeneration: finished without an answer
        return "empty"
    if not _valid_text(reasoning, content):
        return "invalid_text"
    if record.get("output_token_ids") is None:
        # Text only: the ids must come from the text, so text that lost information is not trained on.
        if not reasoning and _reasoning_tokens(record.get("usage")) > 0:
            return "reasoning_missing"  # the server counted reasoning tokens it did not return
        if reasoning is None and missing_reasoning_dropped:
            return "no_reasoning"  # requested, not returned: the provider stripped it (empty "" is the model's)
        if "\ufffd" in (reasoning or "") or "\ufffd" in content:
            return "replacement_characters"
    return ""


# Records rendered and encoded together: about this many characters of model text (a few hundred thousand
# tokens), so a chunk's ids stay small beside the shard while each batch is big enough to spread over threads.
CHUNK_CHARS = 1 << 20


def _rendered_ahead(
    records: list[Any],
    render: Callable[[Any], TurnText | Exception | str | None],
    enc: TextEncoder,
    *,
    chunk_chars: int = CHUNK_CHARS,
) -> Iterator[tuple[Any, TurnText | Exception | str | None]]:
    """(record, its rendered turn) in file order, with the turn's prompt and generated text already encoded.

    Records go in chunks: the caller's thread renders chunk k+1 while a worker thread encodes chunk k's
    texts (``TextEncoder.encode_many``: the tokenizer's own threads, the GIL released), and ``enc`` answers
    them from memory while the caller handles chunk k. The output does not depend on the chunking.
    """

    def chunks() -> Iterator[list[Any]]:
        chunk: list[Any] = []
        size = 0
        for r in records:
            chunk.append(r)
            if isinstance(r, dict):
                size += len(r.get("reasoning") or "") + len(str(r.get("content") or ""))
            if size >= chunk_chars:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk

    with ThreadPoolExecutor(1, thread_name_prefix="aerie-tokens-encode") as worker:
        pending: deque[tuple[list[Any], list[Any], Future]] = deque()

        def hand_out() -> Iterator[tuple[Any, TurnText | Exception | str | None]]:
            chunk, rendered, encoded = pending.popleft()
            enc.remember(encoded.result())
            yield from zip(chunk, rendered)
            enc.remember({})

        for chunk in chunks():
            rendered = [render(r) for r in chunk]
            texts = [t for x in rendered if isinstance(x, TurnText) for t in (x.prompt, x.generated)]
            pending.append((chunk, rendered, worker.submit(enc.encode_many, texts)))
            if len(pending) > 1:
                yield from hand_out()
        while pending:
            yield from hand_out()


# A shard fails on drops only when they exceed the tolerated fraction by more than chance explains: with a
# quota-cut shard of 2 samples one truncated answer is 50 %, which says nothing about the provider.
DROP_GATE_SIGNIFICANCE = 0.05


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in log space (no overflow for shards of any size)."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        for i in range(k, n + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def too_many_dropped(dropped: int, samples: int, max_fraction: float) -> bool:
    """The tokens stage's drop gate: True when a shard must fail.

    A shard fails when it keeps nothing, or when more than ``max_fraction`` of its samples were dropped and
    that excess is unlikely under a true drop rate of ``max_fraction`` (one-sided binomial test at
    ``DROP_GATE_SIGNIFICANCE``). Large shards fail at about the fraction itself (1,000 samples at 0.25: 273
    or more drops); tiny ones need clearer evidence (2 samples: one drop passes, two fail: nothing kept).
    """
    if samples == 0:
        return False
    if dropped >= samples:
        return True
    if dropped <= max_fraction * samples:
        return False
    return binomial_tail(dropped, samples, max_fraction) < DROP_GATE_SIGNIFICANCE


def _drop_gate_error(
    rep: ShardReport, responses_path: Path, samples: int, max_dropped_fraction: float
) -> FidelityError:
    """The drop gate's failure: each reason with examples, and what to do about the commonest."""
    total_dropped = sum(rep.dropped.values())
    reasons = ", ".join(f"{k}: {v} (e.g. {', '.join(rep.drop_examples[k][:3])})" for k, v in rep.dropped.most_common())
    hint = ""
    if rep.dropped.keys() & {"no_reasoning", "reasoning_missing"}:
        hint = (
            " - the server returned no reasoning although it was requested: the provider drops it or its reasoning "
            "parser is off; pick a provider that returns reasoning (responses.provider; the report counts each "
            "provider's missing reasoning) or enable it (tokens.keep_missing_reasoning: true trains the answers "
            "alone, as if the model had not thought)"
        )
    elif rep.dropped.keys() & set(rep.refusal_messages):
        top = next(k for k, _ in rep.dropped.most_common() if k in rep.refusal_messages)
        hint = f" - the chat template cannot express these turns ({top}): {rep.refusal_messages[top]}"
    elif rep.dropped.keys() & {"truncated_response", "over_max_seq_len"}:
        hint = " - raise responses.max_new_tokens / tokens.max_seq_len, or set tokens.drop_truncated: false"
    err = FidelityError(
        f"{responses_path}: {total_dropped} of {samples} samples dropped (more than "
        f"tokens.max_dropped_fraction {max_dropped_fraction} allows, beyond chance): {reasons}{hint}"
    )
    err.report = {
        "samples": samples,
        "kept": 0,
        "dropped": dict(rep.dropped),  # type: ignore[attr-defined]
        "rebuild_paths": {k: rep.paths[k] for k in ("exact", "fallback", "refused")},
        "mismatch_classes": {k: rep.mismatch_classes[k] for k in MISMATCH_CLASSES},
    }
    return err


class _Dropped(Exception):
    """This record is not trained on: ``reason`` is counted, ``message`` kept as the reason's first explanation."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message or reason)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class _Settings:
    """One shard's settings: ``tokens.*`` and the dataset's ``reasoning_requested``."""

    tokens: TokenSettings
    reasoning_requested: bool


class _Target:
    """What the stage knows of the target: its tokenizer, chat format, stop ids, reasoning markers, and the
    next-turn openers learned so far (per kind of turn, for templates that write no end)."""

    def __init__(self, target_path: str, tokenizer, trust_remote_code: bool) -> None:
        tok = tokenizer if tokenizer is not None else load_tokenizer(target_path, trust_remote_code)
        check_template_markers(tok, target_path, as_server=False)  # rule tokenizer_check did it at the run's start
        self.tok = tok
        self.fmt = read_chat_format(tok, read_generation_config(target_path))
        self.enc = TextEncoder(tok)  # private backend copies: no state left by earlier transformers calls
        self.stop_ids = set(self.fmt.stop_ids)
        ids = (self.fmt.think_start_id, self.fmt.think_end_id)
        self.think_start_text, self.think_end_text = (self.enc.decode([i]) if i is not None else None for i in ids)
        self._openers: dict[tuple, int | None] = {}

    def opener(self, calls: list[dict[str, Any]] | None, kwargs: dict[str, Any], tools: Any) -> int | None:
        """The first special token of the turn the template renders next, learned on a one-question probe (the
        record's own history may change when a turn follows)."""
        key = (bool(calls), repr(sorted(kwargs.items())), bool(tools))
        if key not in self._openers:
            layout = {
                "role": "assistant",
                "content": "x",
                **({"tool_calls": tool_calls_for_template(calls, False)} if calls else {}),
            }
            self._openers[key] = next_turn_opener(
                self.tok, [{"role": "user", "content": PROBE_USER}], layout, self.enc.special_ids, tools, kwargs
            )
        return self._openers[key]


class _Packer:
    """The kept sequences of a shard in one flat int32 buffer (no per-sample tensor; the mask is built from the
    lengths), with each one's id, prompt length and generation prompt."""

    def __init__(self) -> None:
        self.all_ids = array("i")
        self.lengths: list[int] = []
        self.prompt_lengths: list[int] = []
        self.kept_ids: list[str] = []
        self.cut: list[int] = []  # sequences that do not end their turn
        self.gen_prompts: dict[tuple[int, ...], int] = {}
        self.gen_prompt_index: list[int] = []

    def add(self, sid: str, prompt_ids: list[int], output_ids: list[int], n: int, ended: bool, gp: tuple) -> None:
        if not ended:
            self.cut.append(len(self.lengths))
        self.all_ids.extend(prompt_ids)
        self.all_ids.extend(output_ids[: n - len(prompt_ids)])
        self.lengths.append(n)
        self.prompt_lengths.append(len(prompt_ids))
        self.gen_prompt_index.append(self.gen_prompts.setdefault(gp, len(self.gen_prompts)))
        self.kept_ids.append(sid)

    def write(self, out_path: Path, target_path: str, num_dropped: int, stop_ids: set[int]) -> None:
        """The ``aerie.tokens/3`` shard, self-checked before publishing: a mask bug here must never reach training."""
        prompts_table = [list(gp) for gp, _ in sorted(self.gen_prompts.items(), key=lambda kv: kv[1])]
        meta = {
            "sample_ids": self.kept_ids,
            "target": str(target_path),
            "tokenizer_sha256": _tokenizer_sha(target_path),
            "num_dropped": num_dropped,
            "prompt_lengths": self.prompt_lengths,
            "generation_prompts": prompts_table,
            "generation_prompt_index": self.gen_prompt_index,
            # /2 readers: the generation prompt when every sequence shares one, else [] (no check of it)
            "generation_prompt_ids": prompts_table[0] if len(prompts_table) == 1 else [],
            "stop_ids": sorted(stop_ids),
            "cut_sequences": self.cut,
        }
        write_tokens_shard(out_path, _packed(self.all_ids, self.lengths, self.prompt_lengths), meta)


def tokenize_shard(
    responses_path: Path,
    out_path: Path,
    report_path: Path,
    target_path: str,
    settings: TokenSettings,
    *,
    reasoning_requested: bool = True,
    log: Callable[[str], None] = print,
    tokenizer=None,
    chunk_chars: int = CHUNK_CHARS,
) -> dict[str, Any]:
    """Build packed ``input_ids`` / ``loss_mask`` for one responses shard and its fidelity report.

    Fails (FidelityError, nothing written) when more than ``settings.max_dropped_fraction`` of the samples are
    dropped beyond chance (``too_many_dropped``), e.g. a provider that returns no reasoning or a template that
    cannot express the turns.
    ``reasoning_requested``: the dataset's responses settings asked the target for its reasoning
    (``aerie.tokens.reasoning.requested_by_config``; a record's own flags and request say it first): a text-only
    record whose reasoning is then missing (``null``) is dropped (``no_reasoning``) unless
    ``settings.keep_missing_reasoning``.
    ``tokenizer`` overrides loading it from the target; ``chunk_chars``: how much model text is rendered and
    encoded together (``_rendered_ahead``; the output is the same for any value). ``settings``: ``tokens.*``
    (aerie.tokens.settings; docs/formats.md).
    """
    shard = _Settings(settings, reasoning_requested)
    target = _Target(target_path, tokenizer, settings.trust_remote_code)
    records = read_jsonl(responses_path)
    rep, packer = ShardReport(), _Packer()
    dataset = ""

    def render(r: Any) -> TurnText | Exception | str | None:
        return _render_record(r, target, shard)

    for n, (r, rendered) in enumerate(_rendered_ahead(records, render, target.enc, chunk_chars=chunk_chars), start=1):
        problem = _malformed(r)
        if problem:
            raise FormatError(f"{responses_path}:{n}: {problem}")
        dataset = dataset or str(r.get("dataset") or "")
        provider = _count_record(r, rep, shard)
        try:
            _tokenize_record(r, rendered, f"{responses_path}:{n}", target, shard, rep, packer)
        except _Dropped as dropped:
            rep.drop(dropped.reason, str(r["id"]), provider, dropped.message)

    total_dropped = sum(rep.dropped.values())
    if records and (not packer.lengths or too_many_dropped(total_dropped, len(records), settings.max_dropped_fraction)):
        raise _drop_gate_error(rep, responses_path, len(records), settings.max_dropped_fraction)
    # No records at all is a valid shard: its dataset reached its output-token quota before the shard began
    # (aerie.responses.api: the shard is published empty with its completion record). It yields an empty tokens shard.
    packer.write(out_path, target_path, total_dropped, target.stop_ids)
    report = rep.as_dict(
        dataset,
        samples=len(records),
        kept=len(packer.kept_ids),
        special_token_text_policy=settings.special_token_text,
        missing_reasoning_policy="keep" if settings.keep_missing_reasoning else "drop",
    )
    atomic_write_json(report_path, report)
    rep.log_summary(report, out_path.name, report_path, log)
    return report


def _render_record(r: Any, target: _Target, settings: _Settings) -> TurnText | Exception | str | None:
    """The template's text of this record's turn or why not: the exception, the drop reason of a record dropped
    before rendering, None for a malformed line. Runs a chunk ahead of the stage's loop, which counts or raises
    each at its record."""
    if _malformed(r):
        return None
    early = _early_drop(
        r,
        drop_truncated=settings.tokens.drop_truncated,
        drop_filtered=settings.tokens.drop_filtered,
        missing_reasoning_dropped=not settings.tokens.keep_missing_reasoning
        and _reasoning_requested(r, settings.reasoning_requested),
    )
    if early:
        return early
    try:
        return render_turn(
            target.tok,
            r["messages"],
            r.get("reasoning"),
            r["content"] or "",
            r.get("tool_calls"),
            r.get("tools") or None,
            _template_kwargs(r),
            think_start_text=target.think_start_text,
            think_end_text=target.think_end_text,
        )
    except Exception as err:  # noqa: BLE001 - any failure belongs to its record, in order
        return err


def _provider(r: dict[str, Any]) -> str:
    return str(r.get("provider") or r.get("backend") or "unknown")


def _count_record(r: dict[str, Any], rep: ShardReport, settings: _Settings) -> str:
    """Count what the record is before deciding on it (finish reason, reasoning present, empty or missing, per
    provider); its provider."""
    provider = _provider(r)
    stats = rep.providers[provider]
    stats.samples += 1
    reasoning, finish = r.get("reasoning"), str(r["finish_reason"])
    rep.finish_reasons[finish] += 1
    rep.counts["reasoning_requested"] += _reasoning_requested(r, settings.reasoning_requested)
    # Empty and missing reasoning are different facts: a provider that strips it vs a model that wrote none.
    if reasoning is None:
        rep.counts["no_reasoning"] += 1
        stats.no_reasoning += 1
    elif not reasoning.strip():
        rep.counts["empty_reasoning"] += 1
    else:
        rep.counts["reasoning_present"] += 1
        stats.reasoning_present += 1
    if finish == "length":
        stats.truncated += 1
    return provider


def _tokenize_record(
    r: dict[str, Any],
    rendered: TurnText | Exception | str | None,
    where: str,
    target: _Target,
    settings: _Settings,
    rep: ShardReport,
    packer: _Packer,
) -> None:
    """One record's decision: its turn as the template renders it, the prompt ids, the generated ids (the exact
    sampled ones when kept, else the rebuild from text), the loop and length checks, then packed. Raises
    _Dropped (counted by the caller) or FormatError (the record contradicts the target)."""
    if isinstance(rendered, str):  # dropped before rendering (_early_drop)
        raise _Dropped(rendered)
    sid = str(r["id"])
    finished = str(r["finish_reason"]) not in ("length", *FILTERED_FINISH_REASONS)
    turn = _turn_or_refusal(rendered, r, rep)
    prompt_ids = target.enc.encode(turn.prompt) if turn is not None else [int(i) for i in r["prompt_token_ids"]]
    if r.get("prompt_token_ids") is not None and r["prompt_token_ids"] != prompt_ids:
        # The ids the model actually saw differ from our rendering: the template or tokenizer changed.
        raise FormatError(
            f"{where}: prompt ids recorded at generation differ from the chat template's rendering at "
            f"position {first_diff(prompt_ids, r['prompt_token_ids'])}; was the target or its template changed?"
        )
    if len(r["messages"]) > 1 and any(m.get("role") == "assistant" for m in r["messages"]):
        rep.counts["multi_turn"] += 1
    if r.get("tool_calls"):
        rep.counts["tool_calls"] += 1
    rebuilt = _rebuilt_ids(r, turn, finished, target, settings, rep) if turn is not None else None
    output_ids = _output_ids(r, rebuilt, prompt_ids, target, rep)
    ended = bool(output_ids) and output_ids[-1] in target.stop_ids
    if not ended and finished:
        raise FormatError(f"{where}: finish_reason is {r['finish_reason']!r} but the output does not end the turn")
    stats = rep.providers[_provider(r)]
    # A looping answer is trivially predictable: it would teach the drafter, and flatter it, on loops.
    if degenerate_flags(output_ids[:-1] if ended else output_ids):
        stats.degenerate += 1
        rep.counts["degenerate"] += 1
        if settings.tokens.drop_degenerate:
            raise _Dropped("degenerate_output")
    n_prompt, n_total = len(prompt_ids), len(prompt_ids) + len(output_ids)
    if n_total > settings.tokens.max_seq_len:
        if settings.tokens.overlong == "drop" or n_prompt >= settings.tokens.max_seq_len:
            raise _Dropped("over_max_seq_len")
        rep.counts["truncated_to_max_seq_len"] += 1
        ended = False
    if not output_ids:
        raise _Dropped("empty")
    n = min(n_total, settings.tokens.max_seq_len)
    gp = target.enc.encode(turn.generation_prompt) if turn is not None else []
    gp = tuple(gp) if prompt_ids[len(prompt_ids) - len(gp) :] == gp else ()
    packer.add(sid, prompt_ids, output_ids, n, ended, gp)
    stats.kept += 1
    stats.lengths.append(n - n_prompt)
    rep.counts["prompt_tokens"] += n_prompt
    rep.counts["generated_tokens"] += n - n_prompt


def _turn_or_refusal(rendered: TurnText | Exception | None, r: dict[str, Any], rep: ShardReport) -> TurnText | None:
    """The rendered turn; a refusal drops a text-only record and leaves one with exact ids to train as sampled (the
    template's view of its turn is only reported: None)."""
    try:
        if isinstance(rendered, Exception):
            raise rendered  # found a chunk ahead; counted or raised here, at its record
        return rendered
    except (TurnRefused, TemplateRaised) as refused:
        rep.paths["refused"] += 1
        reason = getattr(refused, "reason", "template_raised")
        if r.get("output_token_ids") is None:
            raise _Dropped(reason, str(refused)) from None
        if reason not in rep.refusal_messages:
            rep.refusal_messages[reason] = str(refused)
        return None


def _rebuilt_ids(
    r: dict[str, Any], turn: TurnText, finished: bool, target: _Target, settings: _Settings, rep: ShardReport
) -> list[int] | None:
    """The generated ids rebuilt from the template's text of the turn (``rebuild_generated``), with what the
    rebuild found counted; None where a record with exact ids cannot be rebuilt (its ids are trained)."""
    sid, exact = str(r["id"]), r.get("output_token_ids")
    stats = rep.providers[_provider(r)]
    rep.paths[turn.path] += 1
    if turn.fallback_reason:
        rep.fallback_reasons[turn.fallback_reason] += 1
    rep.counts["tool_arguments_as_string"] += turn.arguments_as_string
    for change in turn.normalised[:1]:  # one count per sample, the first change as the example
        stats.mismatched += exact is None
        rep.mismatch("template_normalised", {"id": sid, **change})
    calls, kwargs, tools = r.get("tool_calls"), _template_kwargs(r), r.get("tools") or None
    try:
        rb = rebuild_generated(
            target.enc,
            turn,
            target.stop_ids,
            finished=finished,
            policy=settings.tokens.special_token_text,
            opener=lambda: target.opener(calls, kwargs, tools),
            api_texts={"reasoning": r.get("reasoning"), "content": r["content"] or ""},
            turn_end=target.fmt.turn_end_id,
        )
    except Drop as dropped:
        if exact is None:
            raise _Dropped(dropped.reason, str(dropped)) from None
        return None
    if rb.special_text:
        rep.counts["special_token_text"] += 1
        if len(rep.special_text_examples) < MAX_EXAMPLES:
            rep.special_text_examples.append({"id": sid, "tokens": [f"{f}: {t}" for f, t in rb.special_text[:5]]})
    if rb.added_end:  # the template wrote no end after this turn: the stop token added is counted
        rep.added_turn_ends[rb.added_end] += 1
    return rb.ids


def _output_ids(
    r: dict[str, Any], rebuilt: list[int] | None, prompt_ids: list[int], target: _Target, rep: ShardReport
) -> list[int]:
    """The generated ids trained on: the exact sampled ids when the backend kept them (the rebuild compared with
    them, each mismatch classified), else the rebuild, checked against the server's own token counts."""
    sid, exact = str(r["id"]), r.get("output_token_ids")
    stats = rep.providers[_provider(r)]
    if exact is not None:
        rep.counts["exact_ids_available"] += 1
        exact = [int(i) for i in exact]
        if not target.stop_ids.isdisjoint(exact[:-1]):  # a turn end mid-sequence: never trained
            raise _Dropped("stop_token_in_text", "a stop token inside the sampled ids, before their end")
        stats.checked += 1
        if rebuilt == exact:
            rep.counts["retokenized_equal"] += 1
        elif rebuilt is not None:
            cls = classify_mismatch(target.tok, target.fmt, exact, rebuilt, r.get("reasoning"), r["content"] or "")
            stats.mismatched += 1
            rep.mismatch(cls, {"id": sid, **mismatch_example(target.tok, exact, rebuilt)})
        return exact
    assert rebuilt is not None  # a text-only record without a rebuild was dropped
    stats.checked += 1
    usage = r.get("usage") or {}
    # Text-only APIs: the server's own token counts are a cheap check of the prompt and the rebuild.
    if usage.get("completion_tokens") is not None:
        rep.counts["usage_length_checked"] += 1
        delta = int(usage["completion_tokens"]) - len(rebuilt)
        rep.usage_deltas[delta] += 1
        rep.counts["usage_length_equal"] += delta == 0
        if delta and len(rep.usage_mismatches) < MAX_EXAMPLES:
            rep.usage_mismatches.append({"id": sid, "server": int(usage["completion_tokens"]), "rebuilt": len(rebuilt)})
    if usage.get("prompt_tokens") is not None:
        rep.counts["prompt_length_checked"] += 1
        if int(usage["prompt_tokens"]) == len(prompt_ids):
            rep.counts["prompt_length_equal"] += 1
        elif len(rep.prompt_mismatches) < MAX_EXAMPLES:
            rep.prompt_mismatches.append(
                {"id": sid, "server": int(usage["prompt_tokens"]), "rendered": len(prompt_ids)}
            )
    return rebuilt


def _packed(all_ids: array, lengths: list[int], prompt_lengths: list[int]) -> dict[str, torch.Tensor]:
    """The shard's tensors from one flat buffer of ids and each sequence's length and prompt length."""
    input_ids = torch.frombuffer(all_ids, dtype=torch.int32).clone() if lengths else torch.zeros(0, dtype=torch.int32)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    # 1 from each sequence's first generated position to its end: position - start >= prompt length
    counts = torch.tensor(lengths, dtype=torch.int64)
    starts = torch.repeat_interleave(offsets[:-1], counts)
    positions = torch.arange(len(input_ids), dtype=torch.int64) - starts
    prompt_starts = torch.repeat_interleave(torch.tensor(prompt_lengths, dtype=torch.int64), counts)
    loss_mask = (positions >= prompt_starts).to(torch.uint8)
    return {"input_ids": input_ids, "loss_mask": loss_mask, "seq_offsets": offsets}


def _tokenizer_sha(target_path: str) -> str:
    tokenizer_file = Path(target_path) / "tokenizer.json"
    return hashlib.sha256(tokenizer_file.read_bytes()).hexdigest() if tokenizer_file.exists() else ""
