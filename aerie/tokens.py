"""Stage 3: responses -> token ids + loss masks (format ``aerie.tokens/3``), with a fidelity report.

The training sequence is the prompt rendered by the target's own chat template with the generation
prompt (and the request's tools, system prompt and ``chat_template_kwargs``), followed by what the target
generated. The generated part of a text-only record is the template's own rendering of the finished turn
(``aerie.target.chat.render_turn``): prompt + assistant message rendered without a generation prompt must
begin with the prompt, and the rest is encoded in one piece (special tokens single ids, nothing merged
across the prompt boundary) and cut after the stop token the model samples (the template's turn end, or
the opener of the next turn for templates that write none). So Qwen3's ``<think>\\nR\\n</think>\\n\\nC``,
GLM's ``\\n<think>R</think>\\nC<|user|>``, gpt-oss's channels and Kimi K3's tags need no code of their own.
Each record's prompt length is its loss-mask boundary.

Where the template cannot express the turn the record is refused with a counted reason, or - only for
a template that drops the final turn's reasoning but renders reasoning in a tool-call turn (Kimi K2's
history rule) - framed as that tool-call turn frames it (path ``fallback``). Every other anomaly is a
counted decision too: special-token text written by the model (``tokens.special_token_text``), a stop
token inside the text (always dropped), truncated and filtered answers (never given a turn end),
degenerate loops, text the template normalises (strip/trim), per provider.

When the backend kept the exact sampled ids (in-process ``hf``, SGLang ``/generate``) they are trained
on, and the text rebuild is compared with them: every mismatch is classified.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from array import array
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from aerie.artifacts import FormatError, atomic_write_json, read_jsonl
from aerie.bench.degenerate import degenerate_flags
from aerie.formats.responses import RESPONSES_FORMAT
from aerie.formats.tokens import (
    REPORT_FORMAT,
    FidelityError,
    write_tokens_shard,
)
from aerie.target.chat import (
    PROBE_USER,
    ChatFormat,
    TemplateRaised,
    TextEncoder,
    TurnRefused,
    TurnText,
    next_turn_opener,
    read_chat_format,
    render_turn,
    tool_calls_for_template,
)
from aerie.target.model import load_tokenizer, read_generation_config

MAX_EXAMPLES = 5  # per mismatch class / drop reason

# Why the text rebuild of a sample differs from the ids the model sampled (see classify_mismatch), plus
# ``template_normalised``: the template rendered the API's text changed (stripped, trimmed), so the trained
# text is the template's, not exactly what the provider returned.
MISMATCH_CLASSES = (
    "non_canonical",  # same text, other segmentation: the model sampled e.g. ' learn' + 'ing' for ' learning'
    "special_token_text",  # the model spelled a special token's text with ordinary pieces; re-encoding merges it
    "boundary_whitespace",  # whitespace around </think> lost between the model and the record
    "reasoning_missing",  # the model reasoned, the record has no reasoning
    "replacement_characters",  # U+FFFD in the text: bytes of a split multi-byte character were lost
    "template_normalised",  # the template strips/trims the API's text: the trained text is the template's
    "other",  # none of the above: a bug to look at (aerie's own code must never cause one)
)
# Drops that say the data is unfaithful (not ones the config asked for, such as over-long samples).
FIDELITY_DROPS = (
    "empty",
    "no_reasoning",
    "reasoning_missing",
    "replacement_characters",
    "invalid_text",
    "prefix_mismatch",
    "template_drops_reasoning",
    "no_reasoning_block_opened",
    "no_turn_end",
    "template_raised",
    "stop_token_in_text",
)
SPECIAL_TOKEN_TEXT_POLICIES = ("keep", "plain", "drop")
FILTERED_FINISH_REASONS = ("content_filter", "error")


class _Drop(Exception):
    """This record is not trained on; ``reason`` is counted."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason


# ----------------------------------------------------------------------------------------------------------
# rebuilding the generated ids from text


def encode_text(tokenizer, text: str) -> list[int]:
    """Ids of ``text`` with special-token text matched as single ids (no BOS/EOS added)."""
    return TextEncoder(tokenizer).encode(text)


def rebuild_output_ids(
    tokenizer, fmt: ChatFormat, prompt_ids: Sequence[int], reasoning: str | None, content: str, tool_section: str = ""
) -> list[int]:
    """The Kimi-style framing ``[<think>] reasoning </think> content [tool section] <turn end>``.

    Not the stage's rebuild (that is the template's own rendering, ``rebuild_generated``): kept for the
    demo target's tests and as the framing the Kimi K2 fallback reproduces.
    """
    enc = TextEncoder(tokenizer)
    ids: list[int] = []
    if reasoning is not None:
        if fmt.think_end_id is None:
            raise FormatError("the record has reasoning but the tokenizer defines no </think> token")
        if fmt.think_start_id is not None and (not prompt_ids or prompt_ids[-1] != fmt.think_start_id):
            ids.append(fmt.think_start_id)
        ids += enc.encode(reasoning) + [fmt.think_end_id]
    ids += enc.encode(content) + enc.encode(tool_section)
    return ids + [fmt.turn_end_id]


class Rebuilt:
    """The generated ids of one record and what was found in the model's text on the way."""

    def __init__(self, ids: list[int], special_text: list[tuple[str, str]], finished: bool) -> None:
        self.ids = ids
        self.special_text = special_text  # (field, token text) of special tokens inside the model's own text
        self.finished = finished  # ends with the stop token the model sampled


def _token_index(offsets: list[tuple[int, int]], char: int) -> int:
    """Index of the first token starting at or after character ``char``."""
    lo, hi = 0, len(offsets)
    while lo < hi:
        mid = (lo + hi) // 2
        if offsets[mid][0] < char:
            lo = mid + 1
        else:
            hi = mid
    return lo


def rebuild_generated(
    enc: TextEncoder,
    turn: TurnText,
    stops: set[int],
    *,
    finished: bool,
    policy: str,
    opener: Callable[[], int | None],
    api_texts: dict[str, str | None],
) -> Rebuilt:
    """Encode the template's text of the turn and cut it where the model stopped.

    ``finished``: the model ended the turn, so the ids run to the first stop token after its text (or get
    the next turn's opener, ``opener()``, for templates that write no end). Otherwise (truncated, filtered)
    they stop right after the model's last text: no turn end the model did not produce. ``policy`` is
    ``tokens.special_token_text`` for special-token text inside the model's own text; a stop token there is
    always dropped (it would end the turn in the middle of a trained sequence).
    """
    text = turn.generated
    ids = enc.encode(text)
    special = enc.special_ids
    regions = sorted(turn.regions, key=lambda r: r[1])
    # The template's framing between the model's texts, encoded alone: short, and exact at special tokens.
    framing = [text[e0:a] for (_, _, e0), (_, a, _) in zip([("", 0, 0)] + regions, regions + [("", len(text), 0)])]
    framing_special = sum(sum(map(special.__contains__, enc.encode(f))) for f in framing)
    found: list[tuple[str, int]] = []  # (field, id) of special tokens inside the model's own text
    offsets = None
    if not turn.layout_known:  # the template changed the text beyond strip/trim: look in the API's text instead
        for name, value in api_texts.items():
            found += [(name, t) for t in enc.encode(value or "") if t in special]
    elif regions and sum(map(special.__contains__, ids)) != framing_special:
        # Special tokens beyond the framing's: find the ones inside the model's text (rare, so slower).
        ids, offsets = enc.encode_offsets(text)
        if offsets is not None:
            for i in [i for i, t in enumerate(ids) if t in special]:
                start = offsets[i][0]
                found += [(name, ids[i]) for name, a, b in regions if a <= start < b]
        else:
            for name, a, b in regions:
                found += [(name, t) for t in enc.encode(text[a:b]) if t in special]
    special_text = [(name, enc.decode([t])) for name, t in found]
    in_text_stops = [enc.decode([t]) for _, t in found if t in stops]
    if in_text_stops:
        raise _Drop("stop_token_in_text", f"stop token {in_text_stops[0]!r} inside the model's text")
    if special_text and policy == "drop":
        raise _Drop("special_token_text", f"special-token text {special_text[0][1]!r} in {special_text[0][0]}")
    if special_text and policy == "plain":
        ids, pos = [], 0
        for _, a, b in sorted(turn.regions, key=lambda r: r[1]):
            ids += enc.encode(text[pos:a]) + enc.encode_plain(text[a:b])
            pos = b
        tail = len(ids)
        ids += enc.encode(text[pos:])
    elif offsets is not None:
        tail = _token_index(offsets, turn.text_end)
    else:
        end_ids = enc.encode(framing[-1])  # the framing after the model's last text
        if end_ids and ids[len(ids) - len(end_ids) :] == end_ids:
            tail = len(ids) - len(end_ids)
        else:  # the last text and the framing merged across their boundary: locate it by offsets
            ids, offsets = enc.encode_offsets(text)
            tail = (
                _token_index(offsets, turn.text_end) if offsets is not None else len(enc.encode(text[: turn.text_end]))
            )
    if not finished:
        return Rebuilt(ids[:tail], special_text, False)
    end = next((i for i in range(tail, len(ids)) if ids[i] in stops), None)
    if end is not None:
        return Rebuilt(ids[: end + 1], special_text, True)
    stop = opener()
    if stop is None:
        raise _Drop("no_turn_end", "the template writes no end of turn and no next-turn opener was found")
    return Rebuilt(ids + [stop], special_text, True)


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def classify_mismatch(
    tokenizer, fmt: ChatFormat, exact: Sequence[int], rebuilt: Sequence[int], reasoning: str | None, content: str
) -> str:
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
        if same(e[:ei], r[:ri]) and same(e[ei + 1 :], r[ri + 1 :]):
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


def _percentile(sorted_values: list[int], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return float(sorted_values[k])


class _ProviderStats:
    """Per provider: what it returned, as rates the report and the outlier check compare."""

    def __init__(self) -> None:
        self.samples = 0
        self.kept = 0
        self.dropped = 0
        self.reasoning_present = 0
        self.truncated = 0
        self.degenerate = 0
        self.mismatched = 0
        self.checked = 0
        self.lengths: list[int] = []

    def summary(self) -> dict[str, Any]:
        n, lengths = self.samples, sorted(self.lengths)
        rate = lambda k: round(k / n, 6) if n else None  # noqa: E731
        return {
            "samples": n,
            "kept": self.kept,
            "dropped": self.dropped,
            "generated_tokens_mean": round(statistics.fmean(lengths), 2) if lengths else None,
            "generated_tokens_p50": _percentile(lengths, 0.5),
            "generated_tokens_p90": _percentile(lengths, 0.9),
            "generated_tokens_p99": _percentile(lengths, 0.99),
            "reasoning_present_rate": rate(self.reasoning_present),
            "truncation_rate": rate(self.truncated),
            "loop_rate": round(self.degenerate / self.checked, 6) if self.checked else None,
            "mismatch_rate": round(self.mismatched / self.checked, 6) if self.checked else None,
            "drop_rate": rate(self.dropped),
            "generated_tokens": lengths,
        }


class _Report:
    """Counts and a few examples per class, written as the shard's fidelity report."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.drop_examples: dict[str, list[str]] = defaultdict(list)
        self.refusal_messages: dict[str, str] = {}
        self.mismatch_classes: Counter[str] = Counter()
        self.mismatches: list[dict[str, Any]] = []
        self.usage_deltas: Counter[int] = Counter()
        self.prompt_mismatches: list[dict[str, Any]] = []
        self.usage_mismatches: list[dict[str, Any]] = []
        self.paths: Counter[str] = Counter()
        self.finish_reasons: Counter[str] = Counter()
        self.special_text_examples: list[dict[str, Any]] = []
        self.providers: dict[str, _ProviderStats] = defaultdict(_ProviderStats)

    def drop(self, reason: str, sample_id: str, provider: str, message: str = "") -> None:
        self.dropped[reason] += 1
        self.providers[provider].dropped += 1
        if len(self.drop_examples[reason]) < MAX_EXAMPLES:
            self.drop_examples[reason].append(sample_id)
        if message and reason not in self.refusal_messages:
            self.refusal_messages[reason] = message

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
    drop_filtered: bool = True,
    drop_degenerate: bool = True,
    special_token_text: str = "keep",
    max_dropped_fraction: float = 0.25,
    trust_remote_code: bool = False,
    log: Callable[[str], None] = print,
    tokenizer=None,
) -> dict[str, Any]:
    """Build packed ``input_ids`` / ``loss_mask`` for one responses shard and its fidelity report.

    Fails (FidelityError, nothing written) when more than ``max_dropped_fraction`` of the samples are
    dropped beyond chance (``too_many_dropped``), e.g. a provider that returns no reasoning or a template that
    cannot express the turns.
    ``tokenizer`` overrides loading it from the target. The other settings are ``tokens.*`` (docs/formats.md).
    """
    if special_token_text not in SPECIAL_TOKEN_TEXT_POLICIES:
        raise ValueError(
            f"tokens.special_token_text must be one of {SPECIAL_TOKEN_TEXT_POLICIES}, not {special_token_text!r}"
        )
    tok = tokenizer if tokenizer is not None else load_tokenizer(target_path, trust_remote_code)
    fmt = read_chat_format(tok, read_generation_config(target_path))
    enc = TextEncoder(tok)  # private backend copies: no state left by earlier transformers calls
    stop_ids = set(fmt.stop_ids)
    think_start_text = enc.decode([fmt.think_start_id]) if fmt.think_start_id is not None else None
    openers: dict[tuple, int | None] = {}
    rep = _Report()
    all_ids, lengths, prompt_lengths, kept_ids, cut = array("i"), [], [], [], []
    gen_prompts: dict[tuple[int, ...], int] = {}
    gen_prompt_index: list[int] = []
    records = read_jsonl(responses_path)
    dataset = ""
    for n, r in enumerate(records, start=1):
        where = f"{responses_path}:{n}"
        if r.get("format") != RESPONSES_FORMAT:
            raise FormatError(f"{where}: not an {RESPONSES_FORMAT} record (format={r.get('format')!r})")
        for key in ("id", "messages", "content", "finish_reason"):
            if key not in r:
                raise FormatError(f"{where}: missing field '{key}'")
        sid = str(r["id"])
        dataset = dataset or str(r.get("dataset") or "")
        provider = str(r.get("provider") or r.get("backend") or "unknown")
        stats = rep.providers[provider]
        stats.samples += 1
        reasoning, content = r.get("reasoning"), r["content"] or ""
        finish = str(r["finish_reason"])
        rep.finish_reasons[finish] += 1
        # Empty and missing reasoning are different facts: a provider that strips it vs a model that wrote none.
        if reasoning is None:
            rep.counts["no_reasoning"] += 1
        elif not reasoning.strip():
            rep.counts["empty_reasoning"] += 1
        else:
            rep.counts["reasoning_present"] += 1
            stats.reasoning_present += 1
        if finish == "length":
            stats.truncated += 1
            if drop_truncated:
                rep.drop("truncated_response", sid, provider)
                continue
        if finish in FILTERED_FINISH_REASONS and drop_filtered:
            rep.drop(f"finish_{finish}", sid, provider)  # a filtered or failed answer is not the model's turn
            continue
        finished = finish not in ("length", *FILTERED_FINISH_REASONS)
        # API responses flagged at regeneration (empty answer, reasoning missing) are not trained on.
        bad = [f for f in r.get("flags", []) if f in ("empty", "no_reasoning")]
        if bad:
            rep.drop(bad[0], sid, provider)
            continue
        if not _valid_text(reasoning, content):
            rep.drop("invalid_text", sid, provider)
            continue
        exact = r.get("output_token_ids")
        if exact is None:
            # Text only: the ids must come from the text, so text that lost information is not trained on.
            if not reasoning and _reasoning_tokens(r.get("usage")) > 0:
                rep.drop("reasoning_missing", sid, provider)  # the server counted reasoning tokens it did not return
                continue
            if "\ufffd" in (reasoning or "") or "\ufffd" in content:
                rep.drop("replacement_characters", sid, provider)
                continue

        tools = r.get("tools") or None
        kwargs = _template_kwargs(r)
        try:
            turn = render_turn(
                tok,
                r["messages"],
                reasoning,
                content,
                r.get("tool_calls"),
                tools,
                kwargs,
                think_start_text=think_start_text,
            )
        except (TurnRefused, TemplateRaised) as refused:
            rep.paths["refused"] += 1
            reason = getattr(refused, "reason", "template_raised")
            if exact is None:
                rep.drop(reason, sid, provider, str(refused))
                continue
            turn = None  # exact ids: trained as sampled, the template's view of the turn is only reported
            if reason not in rep.refusal_messages:
                rep.refusal_messages[reason] = str(refused)
        prompt_ids = enc.encode(turn.prompt) if turn is not None else [int(i) for i in r["prompt_token_ids"]]
        if r.get("prompt_token_ids") is not None and r["prompt_token_ids"] != prompt_ids:
            # The ids the model actually saw differ from our rendering: the template or tokenizer changed.
            raise FormatError(
                f"{where}: prompt ids recorded at generation differ from the chat template's rendering at "
                f"position {_first_diff(prompt_ids, r['prompt_token_ids'])}; was the target or its template changed?"
            )
        if len(r["messages"]) > 1 and any(m.get("role") == "assistant" for m in r["messages"]):
            rep.counts["multi_turn"] += 1
        if r.get("tool_calls"):
            rep.counts["tool_calls"] += 1
        rebuilt = None
        if turn is not None:
            rep.paths[turn.path] += 1
            rep.counts["tool_arguments_as_string"] += turn.arguments_as_string
            for change in turn.normalised[:1]:  # one count per sample, the first change as the example
                stats.mismatched += exact is None
                rep.mismatch("template_normalised", {"id": sid, **change})

            record_calls = r.get("tool_calls")

            def opener(calls=record_calls, kw=kwargs, tl=tools) -> int | None:
                # Learned on a one-question probe: the record's own history may change when a turn follows.
                key = (bool(calls), repr(sorted(kw.items())), bool(tl))
                if key not in openers:
                    layout = {
                        "role": "assistant",
                        "content": "x",
                        **({"tool_calls": tool_calls_for_template(calls, False)} if calls else {}),
                    }
                    openers[key] = next_turn_opener(
                        tok, [{"role": "user", "content": PROBE_USER}], layout, enc.special_ids, tl, kw
                    )
                return openers[key]

            try:
                rb = rebuild_generated(
                    enc,
                    turn,
                    stop_ids,
                    finished=finished,
                    policy=special_token_text,
                    opener=opener,
                    api_texts={"reasoning": reasoning, "content": content},
                )
            except _Drop as dropped:
                if exact is None:
                    rep.drop(dropped.reason, sid, provider, str(dropped))
                    continue
                rb = None
            if rb is not None:
                rebuilt = rb.ids
                if rb.special_text:
                    rep.counts["special_token_text"] += 1
                    if len(rep.special_text_examples) < MAX_EXAMPLES:
                        rep.special_text_examples.append(
                            {"id": sid, "tokens": [f"{f}: {t}" for f, t in rb.special_text[:5]]}
                        )
                if rb.ids and rb.ids[-1] not in stop_ids and finished:
                    stop_ids.add(rb.ids[-1])  # the next turn's opener (GLM): it ends the turn in this shard
        if exact is not None:
            rep.counts["exact_ids_available"] += 1
            exact = [int(i) for i in exact]
            if not stop_ids.isdisjoint(exact[:-1]):  # a turn end mid-sequence: never trained
                rep.drop("stop_token_in_text", sid, provider, "a stop token inside the sampled ids, before their end")
                continue
            stats.checked += 1
            if rebuilt == exact:
                rep.counts["retokenized_equal"] += 1
            elif rebuilt is not None:
                cls = classify_mismatch(tok, fmt, exact, rebuilt, reasoning, content)
                stats.mismatched += 1
                i = _first_diff(rebuilt, exact)
                rep.mismatch(
                    cls,
                    {
                        "id": sid,
                        "first_diff": i,
                        "exact": exact[i : i + 8],
                        "rebuilt": rebuilt[i : i + 8],
                        "exact_text": _decode(tok, exact[max(0, i - 4) : i + 8]),
                        "rebuilt_text": _decode(tok, rebuilt[max(0, i - 4) : i + 8]),
                    },
                )
            output_ids = exact
        else:
            stats.checked += 1
            output_ids = rebuilt
            usage = r.get("usage") or {}
            # Text-only APIs: the server's own token counts are a cheap check of the prompt and the rebuild.
            if usage.get("completion_tokens") is not None:
                rep.counts["usage_length_checked"] += 1
                delta = int(usage["completion_tokens"]) - len(rebuilt)
                rep.usage_deltas[delta] += 1
                rep.counts["usage_length_equal"] += delta == 0
                if delta and len(rep.usage_mismatches) < MAX_EXAMPLES:
                    rep.usage_mismatches.append(
                        {"id": sid, "server": int(usage["completion_tokens"]), "rebuilt": len(rebuilt)}
                    )
            if usage.get("prompt_tokens") is not None:
                rep.counts["prompt_length_checked"] += 1
                if int(usage["prompt_tokens"]) == len(prompt_ids):
                    rep.counts["prompt_length_equal"] += 1
                elif len(rep.prompt_mismatches) < MAX_EXAMPLES:
                    rep.prompt_mismatches.append(
                        {"id": sid, "server": int(usage["prompt_tokens"]), "rendered": len(prompt_ids)}
                    )
        ended = bool(output_ids) and output_ids[-1] in stop_ids
        if not ended and finished:
            raise FormatError(f"{where}: finish_reason is {finish!r} but the output does not end the turn")
        # A looping answer is trivially predictable: it would teach the drafter, and flatter it, on loops.
        if degenerate_flags(output_ids[:-1] if ended else output_ids):
            stats.degenerate += 1
            rep.counts["degenerate"] += 1
            if drop_degenerate:
                rep.drop("degenerate_output", sid, provider)
                continue

        n_prompt, n_total = len(prompt_ids), len(prompt_ids) + len(output_ids)
        if n_total > max_seq_len:
            if overlong == "drop" or n_prompt >= max_seq_len:
                rep.drop("over_max_seq_len", sid, provider)
                continue
            rep.counts["truncated_to_max_seq_len"] += 1
            ended = False
        if not output_ids:
            rep.drop("empty", sid, provider)
            continue
        n = min(n_total, max_seq_len)
        if not ended:
            cut.append(len(lengths))
        # One flat int32 buffer for the shard: no per-sample tensor, the mask is built from the lengths.
        all_ids.extend(prompt_ids)
        all_ids.extend(output_ids[: n - n_prompt])
        lengths.append(n)
        prompt_lengths.append(n_prompt)
        gp = enc.encode(turn.generation_prompt) if turn is not None else []
        gp = tuple(gp) if prompt_ids[len(prompt_ids) - len(gp) :] == gp else ()
        gen_prompt_index.append(gen_prompts.setdefault(gp, len(gen_prompts)))
        kept_ids.append(sid)
        stats.kept += 1
        stats.lengths.append(n - n_prompt)
        rep.counts["prompt_tokens"] += n_prompt
        rep.counts["generated_tokens"] += n - n_prompt

    total_dropped = sum(rep.dropped.values())
    if records and (not lengths or too_many_dropped(total_dropped, len(records), max_dropped_fraction)):
        reasons = ", ".join(
            f"{k}: {v} (e.g. {', '.join(rep.drop_examples[k][:3])})" for k, v in rep.dropped.most_common()
        )
        hint = ""
        if rep.dropped.keys() & {"no_reasoning", "reasoning_missing"}:
            hint = (
                " - the server returned no reasoning for a thinking model: the provider drops it or its reasoning "
                "parser is off; pick a provider that returns reasoning (responses.provider) or enable it"
            )
        elif rep.dropped.keys() & set(rep.refusal_messages):
            top = next(k for k, _ in rep.dropped.most_common() if k in rep.refusal_messages)
            hint = f" - the chat template cannot express these turns ({top}): {rep.refusal_messages[top]}"
        elif rep.dropped.keys() & {"truncated_response", "over_max_seq_len"}:
            hint = " - raise responses.max_new_tokens / tokens.max_seq_len, or set tokens.drop_truncated: false"
        err = FidelityError(
            f"{responses_path}: {total_dropped} of {len(records)} samples dropped (more than "
            f"tokens.max_dropped_fraction {max_dropped_fraction} allows, beyond chance): {reasons}{hint}"
        )
        err.report = {
            "samples": len(records),
            "kept": 0,
            "dropped": dict(rep.dropped),  # type: ignore[attr-defined]
            "rebuild_paths": {k: rep.paths[k] for k in ("exact", "fallback", "refused")},
            "mismatch_classes": {k: rep.mismatch_classes[k] for k in MISMATCH_CLASSES},
        }
        raise err
    # No records at all is a valid shard: its dataset reached its output-token quota before the shard began
    # (aerie.api: the shard is published empty with its completion record). It yields an empty tokens shard.
    input_ids = torch.frombuffer(all_ids, dtype=torch.int32).clone() if lengths else torch.zeros(0, dtype=torch.int32)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    # 1 from each sequence's first generated position to its end: position - start >= prompt length
    counts = torch.tensor(lengths, dtype=torch.int64)
    starts = torch.repeat_interleave(offsets[:-1], counts)
    positions = torch.arange(len(input_ids), dtype=torch.int64) - starts
    prompt_starts = torch.repeat_interleave(torch.tensor(prompt_lengths, dtype=torch.int64), counts)
    loss_mask = (positions >= prompt_starts).to(torch.uint8)
    prompts_table = [list(gp) for gp, _ in sorted(gen_prompts.items(), key=lambda kv: kv[1])]
    meta = {
        "sample_ids": kept_ids,
        "target": str(target_path),
        "tokenizer_sha256": _tokenizer_sha(target_path),
        "num_dropped": total_dropped,
        "prompt_lengths": prompt_lengths,
        "generation_prompts": prompts_table,
        "generation_prompt_index": gen_prompt_index,
        # /2 readers: the generation prompt when every sequence shares one, else [] (no check of it)
        "generation_prompt_ids": prompts_table[0] if len(prompts_table) == 1 else [],
        "stop_ids": sorted(stop_ids),
        "cut_sequences": cut,
    }
    # Self-checked before publishing: a mask bug in this stage must never reach training.
    write_tokens_shard(out_path, {"input_ids": input_ids, "loss_mask": loss_mask, "seq_offsets": offsets}, meta)

    c = rep.counts
    report = {
        "format": REPORT_FORMAT,
        "dataset": dataset,
        "samples": len(records),
        "kept": len(kept_ids),
        "dropped": dict(rep.dropped),
        "drop_examples": dict(rep.drop_examples),
        "refusal_messages": rep.refusal_messages,
        "rebuild_paths": {k: rep.paths[k] for k in ("exact", "fallback", "refused")},
        "finish_reasons": dict(rep.finish_reasons),
        "reasoning_present": c["reasoning_present"],
        "empty_reasoning": c["empty_reasoning"],
        "no_reasoning": c["no_reasoning"],
        "special_token_text_policy": special_token_text,
        "special_token_text": c["special_token_text"],
        "special_token_text_examples": rep.special_text_examples,
        "degenerate": c["degenerate"],
        "tool_arguments_as_string": c["tool_arguments_as_string"],
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
        "providers": {p: s.summary() for p, s in sorted(rep.providers.items())},
    }
    atomic_write_json(report_path, report)
    classes = ", ".join(f"{k} {v}" for k, v in report["mismatch_classes"].items() if v) or "none"
    paths = report["rebuild_paths"]
    log(
        f"{out_path.name}: kept {len(kept_ids)}/{len(records)}, {c['generated_tokens']} generated tokens; "
        f"template rebuild exact {paths['exact']}, fallback {paths['fallback']}, refused {paths['refused']}; "
        f"text rebuild exact for {c['retokenized_equal']}/{c['exact_ids_available']} samples with exact ids "
        f"(mismatches: {classes}); rebuilt length = server's count for {c['usage_length_equal']}/"
        f"{c['usage_length_checked']}, prompt length for {c['prompt_length_equal']}/{c['prompt_length_checked']}"
    )
    if rep.dropped:
        log(f"{out_path.name}: dropped " + ", ".join(f"{k} {v}" for k, v in rep.dropped.most_common()))
    for o in provider_outliers(provider_stats([report])):
        log(
            f"WARNING {out_path.name}: provider {o['provider']} differs from the others ({'; '.join(o['reasons'])}); "
            f"to exclude it: {o['ignore']}"
        )
    if rep.mismatch_classes["other"]:
        log(
            f"WARNING {out_path.name}: {rep.mismatch_classes['other']} unexplained rebuild mismatches (class 'other'); "
            f"see {report_path}"
        )
    if c["prompt_length_checked"] and c["prompt_length_equal"] < c["prompt_length_checked"]:
        log(
            f"WARNING {out_path.name}: the server counted a different prompt length for "
            f"{c['prompt_length_checked'] - c['prompt_length_equal']} samples: its system prompt or chat template "
            f"differs from the target's (examples in {report_path})"
        )
    return report


def _tokenizer_sha(target_path: str) -> str:
    tokenizer_file = Path(target_path) / "tokenizer.json"
    return hashlib.sha256(tokenizer_file.read_bytes()).hexdigest() if tokenizer_file.exists() else ""


# ----------------------------------------------------------------------------------------------------------
# provider equivalence across shards (issue 12 item 7)

PROVIDER_RATES = ("reasoning_present_rate", "truncation_rate", "loop_rate", "mismatch_rate", "drop_rate")
OUTLIER_RATE_GAP = 0.2  # a rate this far (absolute) from the other providers' median names the provider
OUTLIER_LENGTH_FACTOR = 2.0  # mean generated length this many times shorter or longer than the others'
OUTLIER_MIN_SAMPLES = 20  # fewer samples than this say nothing about a provider


def provider_stats(reports: Sequence[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (dataset, provider): the ``providers`` entries of tokens reports pooled over shards."""
    pooled: dict[tuple[str, str], dict[str, Any]] = {}
    for rep in reports:
        for provider, s in (rep.get("providers") or {}).items():
            p = pooled.setdefault(
                (str(rep.get("dataset") or ""), provider),
                {"samples": 0, "kept": 0, "dropped": 0, "lengths": [], "weighted": Counter(), "checked": 0},
            )
            n = int(s.get("samples") or 0)
            p["samples"] += n
            p["kept"] += int(s.get("kept") or 0)
            p["dropped"] += int(s.get("dropped") or 0)
            p["lengths"] += list(s.get("generated_tokens") or [])
            for k in PROVIDER_RATES:  # rates pooled by their shard's sample count
                if s.get(k) is not None:
                    p["weighted"][k] += float(s[k]) * n
                    p["weighted"][k + "_n"] += n
    out = {}
    for key, p in pooled.items():
        lengths = sorted(p["lengths"])
        out[key] = {
            "samples": p["samples"],
            "kept": p["kept"],
            "dropped": p["dropped"],
            "generated_tokens_mean": round(statistics.fmean(lengths), 2) if lengths else None,
            "generated_tokens_p50": _percentile(lengths, 0.5),
            "generated_tokens_p90": _percentile(lengths, 0.9),
            "generated_tokens_p99": _percentile(lengths, 0.99),
            "generated_tokens": lengths,
            **{
                k: (round(p["weighted"][k] / p["weighted"][k + "_n"], 6) if p["weighted"][k + "_n"] else None)
                for k in PROVIDER_RATES
            },
        }
    return out


def provider_outliers(stats: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """Providers whose rates are far from the median over all providers of the same dataset (with two
    providers both are named when they differ: nothing says which is right), with the config line that would
    exclude each (OpenRouter's provider routing, ``responses.provider``)."""
    out = []
    datasets = sorted({d for d, _ in stats})
    for d in datasets:
        rows = {p: s for (dd, p), s in stats.items() if dd == d and s["samples"] >= OUTLIER_MIN_SAMPLES}
        if len(rows) < 2:
            continue
        for p, s in sorted(rows.items()):
            others = list(rows.values())
            why = []
            for k in PROVIDER_RATES:
                vals = [o[k] for o in others if o[k] is not None]
                if s[k] is not None and vals and abs(s[k] - statistics.median(vals)) > OUTLIER_RATE_GAP:
                    name = k.removesuffix("_rate").replace("_", " ")
                    why.append(f"{name} {s[k]:.0%} vs {statistics.median(vals):.0%}")
            means = [o["generated_tokens_mean"] for o in others if o["generated_tokens_mean"]]
            m = s["generated_tokens_mean"]
            if m and means:
                ref = statistics.median(means)
                if m * OUTLIER_LENGTH_FACTOR < ref or m > ref * OUTLIER_LENGTH_FACTOR:
                    why.append(f"mean length {m:.0f} vs {ref:.0f} tokens")
            if why:
                out.append(
                    {"dataset": d, "provider": p, "reasons": why, "ignore": f'responses.provider: {{ignore: ["{p}"]}}'}
                )
    return out
