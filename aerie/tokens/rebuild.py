"""Rebuilding the generated ids of one record from text, and classifying where they differ from the sampled ids.

One job: ``rebuild_generated`` encodes the template's text of the turn (``aerie.target_model.turns.TurnText``)
and cuts it where the model stopped, finding special-token text inside the model's own text on the way;
``classify_mismatch`` says why such a rebuild differs from the exact ids a backend kept (one of
``aerie.tokens.fidelity.MISMATCH_CLASSES``). ``rebuild_output_ids`` is the Kimi-style framing the demo
target's tests and the Kimi K2 fallback use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from aerie.target_model.chat import ChatFormat
from aerie.target_model.text_encoder import TextEncoder
from aerie.target_model.turns import TurnText
from aerie.tools.artifacts import FormatError


class Drop(Exception):
    """This record is not trained on; ``reason`` is counted."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason


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


# Where the turn end of a finished turn comes from when the template writes none after the model's text (counted
# per shard): the token that opens the next turn, which the model stops on (GLM's <|user|>), or the template's
# end of a turn with an answer (Seed-OSS writes <seed:eos> only after non-empty content).
ADDED_NEXT_TURN_OPENER = "next_turn_opener"
ADDED_TURN_END = "turn_end"


class Rebuilt:
    """The generated ids of one record and what was found in the model's text on the way."""

    def __init__(
        self, ids: list[int], special_text: list[tuple[str, str]], finished: bool, added_end: str = ""
    ) -> None:
        self.ids = ids
        self.special_text = special_text  # (field, token text) of special tokens inside the model's own text
        self.finished = finished  # ends with the stop token the model sampled
        self.added_end = added_end  # "" (the template wrote it), ADDED_NEXT_TURN_OPENER or ADDED_TURN_END


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
    turn_end: int | None = None,
) -> Rebuilt:
    """Encode the template's text of the turn and cut it where the model stopped.

    ``finished``: the model ended the turn, so the ids run to the first stop token after its text. Where the
    template writes none after it, the turn gets a token the model stops on (one of ``stops``: the model's
    declared eos ids and the template's turn end): the next turn's opener, ``opener()``, when the model stops on
    it (GLM), else ``turn_end``, the template's end of a turn with an answer (Seed-OSS, whose template writes
    its end only after non-empty content); ``Rebuilt.added_end`` says which, and a turn with neither is dropped
    (``no_turn_end``). Otherwise (truncated, filtered) the ids stop right after the model's last text: no turn
    end the model did not produce. ``policy`` is ``tokens.special_token_text`` for special-token text inside the
    model's own text; a stop token there is always dropped (it would end the turn in the middle of a trained
    sequence).
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
        raise Drop("stop_token_in_text", f"stop token {in_text_stops[0]!r} inside the model's text")
    if special_text and policy == "drop":
        raise Drop("special_token_text", f"special-token text {special_text[0][1]!r} in {special_text[0][0]}")
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
        return Rebuilt(_no_stop_before_end(ids[:tail], stops), special_text, False)
    end = next((i for i in range(tail, len(ids)) if ids[i] in stops), None)
    if end is not None:
        return Rebuilt(_no_stop_before_end(ids[:end], stops) + [ids[end]], special_text, True)
    _no_stop_before_end(ids, stops)
    stop = opener()
    if stop is not None and stop in stops:
        return Rebuilt(ids + [stop], special_text, True, ADDED_NEXT_TURN_OPENER)
    if turn_end is not None and turn_end in stops:
        return Rebuilt(ids + [turn_end], special_text, True, ADDED_TURN_END)
    raise Drop(
        "no_turn_end",
        (
            "the template writes no end after this finished turn, and neither the token that opens the next turn "
            f"({'none found' if stop is None else f'id {stop}'}) nor a turn end of the template is a token the model "
            "stops on (generation_config.json eos_token_id, the tokenizer's eos): add the model's stop token to "
            "its generation_config.json"
        ),
    )


def _no_stop_before_end(ids: list[int], stops: set[int]) -> list[int]:
    """``ids`` (the trained turn before its end), or Drop when the template's framing puts a token the model stops on
    inside them - e.g. an R1-Distill-shaped render of text before a tool call, ``...<｜tool▁calls▁end｜>
    <｜end▁of▁sentence｜><｜Assistant｜>Let me check.<｜end▁of▁sentence｜>``: the model never writes on after its
    stop token, so a drafter trained on it would learn to end the turn mid-way (a stop token inside the model's own
    text is ``stop_token_in_text``)."""
    early = next((i for i, t in enumerate(ids) if t in stops), None)
    if early is not None:
        raise Drop(
            "stop_token_in_framing",
            (
                f"the template's text of this turn has a token the model stops on (id {ids[early]}) at position "
                f"{early} of {len(ids) + 1}, before the turn's end: the model stops there, so what follows is not "
                "what it wrote (e.g. a tool-call block closed with the end of a sentence, the content after it)"
            ),
        )
    return ids


def first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first position where ``a`` and ``b`` differ (the shorter length when one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def classify_mismatch(
    tokenizer, fmt: ChatFormat, exact: Sequence[int], rebuilt: Sequence[int], reasoning: str | None, content: str
) -> str:
    """Why the text rebuild differs from the exact sampled ids: one of aerie.tokens.fidelity.MISMATCH_CLASSES."""
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


def mismatch_example(tokenizer, exact: Sequence[int], rebuilt: Sequence[int]) -> dict[str, Any]:
    """Where the rebuild first differs from the sampled ids: a few ids and their text on each side."""
    i = first_diff(rebuilt, exact)
    return {
        "first_diff": i,
        "exact": exact[i : i + 8],
        "rebuilt": rebuilt[i : i + 8],
        "exact_text": _decode(tokenizer, exact[max(0, i - 4) : i + 8]),
        "rebuilt_text": _decode(tokenizer, rebuilt[max(0, i - 4) : i + 8]),
    }
