"""The template's own rendering of a generated turn: what the tokens stage trains on after the prompt.

One job: ``render_turn`` renders prompt + the finished assistant message and returns the text after the
prompt (``TurnText``), with where the model's reasoning and content lie in it and how the template changed
them. Nothing is hard-coded per model: Qwen3's ``<think>\\nR\\n</think>\\n\\nC``, GLM's
``\\n<think>R</think>\\nC``, gpt-oss's channels and Kimi K3's tags all come out of the template itself.
Where the template cannot express the turn it is refused (``TurnRefused``, with the counted reason) or, in
two cases, falls back to framing learned from the template's own renders: the reasoning framing of a
tool-call turn (``FALLBACK_TOOL_CALL_FRAMING``), or the reasoning markers where the generation prompt and
the turn's render meet (``FALLBACK_REASONING_MARKERS``). Whatever the path, the template's text of the finished
turn must be text the model writes: one that leaves the reasoning block open around the model's answer or at
the turn's end is refused (``reasoning_block_unclosed``: e.g. NVIDIA Nemotron Nano v2, whose finished turn
repeats the ``<think>\\n`` its generation prompt opened and puts the answer after it, with no ``</think>``).
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass, field
from typing import Any

from aerie.target_model.template import (
    ChatTemplateError,
    TemplateRaised,
    messages_for_template,
    render_text,
    tool_calls_for_template,
)

SENTINEL_REASONING = "\u2063aerie-reasoning\u2063"  # U+2063: not whitespace, survives strip()/trim
SENTINEL_CONTENT = "\u2063aerie-content\u2063"
# Why a turn is framed by the fallback (counted per shard): the reasoning framing of a tool-call turn the template
# renders as current (Kimi K2's history rule), or the reasoning markers where the generation prompt and the
# template's render of the turn meet (DeepSeek V3.1 thinking: the prompt opens `<think>`, the turn renders
# `</think>content`; DeepSeek V3.2 chat: the prompt holds `<think></think>`, the turn renders `</think>content`).
FALLBACK_TOOL_CALL_FRAMING = "tool_call_turn_framing"
FALLBACK_REASONING_MARKERS = "reasoning_markers"
PROBE_CALL = {"id": "call_aerie_probe_0", "type": "function", "function": {"name": "aerie_probe", "arguments": {}}}


FALLBACK_REASONING_BLOCK = "reasoning_block_framing"
PROBE_QUESTION = "aerie probe question"
PROBE_TOOL = {
    "type": "function",
    "function": {"name": "aerie_probe", "description": "probe", "parameters": {"type": "object", "properties": {}}},
}


@dataclass(frozen=True)
class ReasoningFraming:
    """How the template frames a turn's reasoning where it writes the frame only around reasoning (learned from its
    renders, never per model): Gemma 4 ``<|channel>thought\n`` R ``\n<channel|>``, Seed-OSS ``<seed:think>`` R
    ``</seed:think>\n``, MiniMax M2 ``<think>\n`` R ``\n</think>\n\n``, gpt-oss ``<|channel|>analysis<|message|>`` R
    ``<|end|><|start|>assistant``. Templates whose frame stays when the reasoning is empty (Kimi, Qwen3, GLM) have
    none: their markers are the tokenizer's ``<think>`` / ``</think>``."""

    open: str  # the template's text right before the reasoning
    close: str  # right after it
    generation_prompt: str  # the probe's generation prompt (with these template kwargs)
    after_generation_prompt: bool  # in the probe turn the block is the first thing after the generation prompt

    @property
    def start(self) -> str:
        """The marker that opens the block (the open text without surrounding whitespace)."""
        return self.open.strip()

    @property
    def end(self) -> str:
        return self.close.strip()


def _added_token_texts(tokenizer) -> list[str]:
    return [str(getattr(t, "content", t)) for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()]


def _inserted_block(with_r: str, without: str, specials: list[str]) -> tuple[str, int] | None:
    """(block, where) when ``with_r`` is ``without`` with one block holding the sentinel reasoning inserted at
    ``where``; of the equivalent alignments the one nearest the first difference that starts at a special token."""
    at, n = with_r.find(SENTINEL_REASONING), len(with_r) - len(without)
    if at < 0 or n <= len(SENTINEL_REASONING):
        return None
    p = min(_first_difference(with_r, without), at)
    if with_r[:p] + with_r[p + n :] != without:
        return None
    best = p
    for q in range(p, -1, -1):  # shift left while the block rotates over the text before it
        if q < p and with_r[q] != with_r[q + n]:
            break
        if q + n < at + len(SENTINEL_REASONING):
            break
        if any(t and with_r.startswith(t, q) for t in specials):
            best = q
            break
    return with_r[best : best + n], best


def learn_reasoning_framing(tokenizer, template_kwargs: dict[str, Any] | None = None) -> ReasoningFraming | None:
    """The template's frame around a turn's reasoning where it writes the frame only when there is reasoning:
    a finished answer turn, then a tool-call turn (Gemma 4 renders reasoning only there), each rendered with
    sentinel reasoning and without any; None when no render shows such a frame."""
    kw = dict(template_kwargs or {})
    thinking_key = "reasoning_content" not in _template_source(tokenizer)
    specials = _added_token_texts(tokenizer)
    user = [{"role": "user", "content": PROBE_QUESTION}]
    for calls, tools in ((None, None), (tool_calls_for_template([PROBE_CALL], False), [PROBE_TOOL])):
        for content in (SENTINEL_CONTENT, ""):  # gpt-oss refuses content beside reasoning in a tool-call turn
            try:
                prompt = render_text(tokenizer, user, add_generation_prompt=True, tools=tools, **kw)
                bare = render_text(tokenizer, user, add_generation_prompt=False, tools=tools, **kw)
                turns = [
                    render_text(
                        tokenizer,
                        user + [_assistant(r, content, calls, thinking_key)],
                        add_generation_prompt=False,
                        tools=tools,
                        **kw,
                    )
                    for r in (SENTINEL_REASONING, None)
                ]
            except (ChatTemplateError, TemplateRaised):
                continue
            found = _inserted_block(*turns, specials)
            if found is None:
                continue
            block, at = found
            i = block.index(SENTINEL_REASONING)
            framing = ReasoningFraming(
                open=block[:i],
                close=block[i + len(SENTINEL_REASONING) :],
                generation_prompt=prompt[len(bare) :] if prompt.startswith(bare) else "",
                after_generation_prompt=turns[0][:at] == prompt,
            )
            if framing.start and framing.end:
                return framing
    return None


_FRAMINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reasoning_framing(tokenizer, template_kwargs: dict[str, Any] | None = None) -> ReasoningFraming | None:
    """``learn_reasoning_framing``, once per tokenizer, template and template kwargs."""
    key = (_template_source(tokenizer), json.dumps(template_kwargs or {}, sort_keys=True, default=str))
    try:
        cache = _FRAMINGS.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable: learned every time
        cache = {}
    if key not in cache:
        cache[key] = learn_reasoning_framing(tokenizer, template_kwargs)
    return cache[key]


def reasoning_markers(
    tokenizer, think_start_text: str | None, think_end_text: str | None
) -> tuple[str | None, str | None]:
    """The texts that open and close a reasoning block: the template's own frame where it has one
    (``reasoning_framing``), else the tokenizer's ``<think>`` / ``</think>`` (given)."""
    framing = reasoning_framing(tokenizer)
    return (framing.start, framing.end) if framing is not None else (think_start_text, think_end_text)


class TurnRefused(Exception):
    """The template cannot express this record's turn; ``reason`` is the counted drop reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class TurnText:
    """The template's text of one generated turn, split where the model's own text lies."""

    prompt: str  # the prompt with its generation prompt, as the server renders it
    generated: str  # the template's text after the prompt for the finished turn (trailing text included)
    regions: list[tuple[str, int, int]]  # ("reasoning" | "content", start, end): the model's text in ``generated``
    path: str  # "exact" (the template renders this turn) or "fallback" (framing learned from the template's renders)
    generation_prompt: str  # what add_generation_prompt added for this record ("" when none)
    layout_known: bool = True  # False: the template changed the text in a way the regions cannot show
    normalised: list[dict[str, str]] = field(default_factory=list)  # API text vs the template's text
    arguments_as_string: bool = False  # tool-call arguments had to be passed as JSON strings
    fallback_reason: str = ""  # path "fallback": FALLBACK_TOOL_CALL_FRAMING or FALLBACK_REASONING_MARKERS

    @property
    def text_end(self) -> int:
        """Where the model's last text ends in ``generated``: the end-of-turn framing follows."""
        return max((e for _, _, e in self.regions), default=0)


def _assistant(
    reasoning: str | None, content: str | None, calls: list[dict[str, Any]] | None, thinking_key: bool
) -> dict[str, Any]:
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
        if thinking_key:  # gpt-oss reads the analysis channel from `thinking`
            m["thinking"] = reasoning
    if calls:
        m["tool_calls"] = calls
    return m


def _template_source(tokenizer) -> str:
    t = getattr(tokenizer, "chat_template", None)
    return t if isinstance(t, str) else json.dumps(t) if t else ""


def _snippet(text: str, at: int, width: int = 40) -> str:
    return repr(text[max(0, at - width) : at + width])


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def render_turn(
    tokenizer,
    messages: list[dict[str, Any]],
    reasoning: str | None,
    content: str | None,
    tool_calls: list[dict[str, Any]] | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    think_start_text: str | None = "<think>",
    think_end_text: str | None = "</think>",
) -> TurnText:
    """The template's own text of the generated turn after the prompt, or TurnRefused saying why not.

    Renders prompt + the assistant message (``reasoning_content``, ``content``, ``tool_calls`` with
    arguments as dicts, strings only where the template requires them) without a generation prompt,
    requires that it begins with the prompt rendered with this record's generation prompt, tools and
    template kwargs, and returns the suffix. A second render with sentinel texts shows where the model's
    reasoning and content lie in it (the rest is the template's framing) and whether the template changed
    them (strip/trim): such differences are listed in ``normalised``. ``think_start_text`` /
    ``think_end_text``: the tokenizer's reasoning markers (None when it has none), for the fallbacks and the
    open-block check; the template's own frame replaces them where it has one (``reasoning_markers``: Gemma 4's
    thought channel, Seed-OSS's ``<seed:think>``).
    """
    kw = dict(template_kwargs or {})
    thinking_key = "reasoning_content" not in _template_source(tokenizer)
    think_start_text, think_end_text = reasoning_markers(tokenizer, think_start_text, think_end_text)

    def render(msgs: list[dict[str, Any]], agp: bool) -> str:
        return render_text(tokenizer, msgs, add_generation_prompt=agp, tools=tools, **kw)

    def finished(r: str | None, c: str | None, cs: list[dict[str, Any]] | None) -> str:
        return render(msgs + [_assistant(r, c, cs, thinking_key)], False)

    # Tool-call arguments as dicts (what most templates iterate), in the history too; as JSON strings only
    # when the template fails on dicts (DeepSeek V3.1 joins them as text).
    has_calls = bool(tool_calls) or any(m.get("tool_calls") for m in messages)
    for as_string in (False, True):
        msgs = messages_for_template(messages, as_string)
        calls = tool_calls_for_template(tool_calls, as_string)
        try:
            prompt = render(msgs, True)
            bare = render(msgs, False)
            full = finished(reasoning, content, calls)
            break
        except (ChatTemplateError, TemplateRaised):
            if as_string or not has_calls:
                raise
    generation_prompt = prompt[len(bare) :] if prompt.startswith(bare) else ""
    if calls and full == finished(reasoning, content, None):
        raise TurnRefused(
            "template_drops_tool_calls",
            (
                "the template renders this turn the same with and without its tool calls (e.g. DeepSeek-R1-Distill "
                "renders tool calls only when the content is null): training on its rendering would drop the calls "
                "the model made"
            ),
        )
    sr = SENTINEL_REASONING if reasoning else reasoning
    sc = SENTINEL_CONTENT if content else content
    path, layout, generated, why = "exact", None, "", ""
    framed = None
    if full.startswith(prompt):
        generated = full[len(prompt) :]
        framed = finished(sr, sc, calls)
        layout = framed[len(prompt) :] if framed.startswith(prompt) else None
    if not full.startswith(prompt) or (reasoning and layout is not None and SENTINEL_REASONING not in layout):
        # The template drops reasoning it treats as history (Kimi K2: a final answer turns the whole
        # tool-call loop before it into history): frame the turn as it frames a tool-call turn, or refuse.
        # This turn with sentinel texts: the render above when it has content (one template render saved).
        own = framed if content and framed is not None else None
        framing = _framing_from_tool_call_turn(finished, prompt, reasoning, content, calls, as_string, own)
        why = FALLBACK_TOOL_CALL_FRAMING
        block = reasoning_framing(tokenizer, kw)
        if framing is None:
            framing = _framing_from_reasoning_markers(
                finished,
                bare,
                generation_prompt,
                full,
                reasoning,
                content,
                calls,
                think_start_text,
                think_end_text,
                block.close if block is not None and block.end == think_end_text else None,
            )
            why = FALLBACK_REASONING_MARKERS
        if framing is None and block is not None:
            framing = _framing_from_reasoning_block(block, prompt, generation_prompt, full, layout, reasoning)
            why = FALLBACK_REASONING_BLOCK
        if framing is None:
            raise _refusal(prompt, full, generation_prompt, reasoning, think_start_text)
        layout, generated = framing
        path = "fallback"
    turn = TurnText(
        prompt=prompt,
        generated=generated,
        regions=[],
        path=path,
        generation_prompt=generation_prompt,
        arguments_as_string=as_string,
        fallback_reason=why if path == "fallback" else "",
    )
    _locate_text(turn, layout, reasoning, content)
    unclosed = _unclosed_reasoning_block(turn, think_start_text, think_end_text)
    if unclosed:
        raise TurnRefused(
            "reasoning_block_unclosed",
            (
                f"the template's rendering of the finished turn leaves the reasoning block open ({think_start_text!r} "
                f"with no {think_end_text!r}) {unclosed}: the model closes its reasoning before it answers or ends "
                f"its turn, so this text is not what it wrote (e.g. a template whose finished turn repeats the open "
                f"block of its generation prompt {generation_prompt!r}, as NVIDIA Nemotron Nano v2's does, with a "
                f"record whose reasoning is empty or missing)"
            ),
        )
    return turn


def _unclosed_reasoning_block(turn: TurnText, start: str | None, end: str | None) -> str:
    """Where the template's text of the finished turn has the model write inside an open reasoning block ("" when
    nowhere): its content, or the end of the turn. The block's state runs through the framing only (the generation
    prompt, then the template's text between the model's texts), from the tokenizer's markers; the model's own
    text is its own (special-token text in it is counted elsewhere). A truncated turn is cut before the end."""
    if not start or not end:
        return ""

    def after(text: str, is_open: bool) -> bool:
        last_start, last_end = text.rfind(start), text.rfind(end)
        return is_open if last_start == last_end == -1 else last_start > last_end

    is_open = after(turn.generation_prompt, False)
    text, pos = turn.generated, 0
    regions = sorted(turn.regions, key=lambda r: r[1]) if turn.layout_known else []
    for name, a, b in regions:
        is_open = after(text[pos:a], is_open)
        if name == "content" and is_open:
            return "around the model's answer"
        pos = b
    return "at the end of the turn" if after(text[pos:], is_open) else ""


def _refusal(
    prompt: str, full: str, generation_prompt: str, reasoning: str | None, think_start_text: str | None
) -> TurnRefused:
    """Why the template cannot express this turn, as a counted reason and a message naming the behaviour."""
    if full.startswith(prompt):
        return TurnRefused(
            "template_drops_reasoning",
            (
                "the template does not render the reasoning of this turn (it keeps reasoning only for turns it "
                "treats as current, or never renders reasoning_content) and renders no tool-call turn whose "
                "reasoning framing could be learned: training on its rendering would drop the model's reasoning"
            ),
        )
    at = _first_difference(full, prompt)
    opened = bool(think_start_text) and generation_prompt.rstrip().endswith(think_start_text.rstrip())
    if not reasoning and opened:
        return TurnRefused(
            "no_reasoning_block_opened",
            (
                f"the generation prompt opens the reasoning block ({generation_prompt!r}) but the record has no "
                f"reasoning and the template renders the turn without that block: training it would put the "
                f"answer in the reasoning position"
            ),
        )
    return TurnRefused(
        "prefix_mismatch",
        (
            f"the template's rendering of the finished turn does not begin with the prompt it renders with the "
            f"generation prompt: from character {at} the prompt has {_snippet(prompt, at)} and the finished turn "
            f"{_snippet(full, at)} (e.g. a user turn that already ends with the assistant opener, doubled by the "
            f"generation prompt, or a final turn rendered without the block the generation prompt opens)"
        ),
    )


def _framing_from_tool_call_turn(
    finished,
    prompt: str,
    reasoning: str | None,
    content: str | None,
    calls: list[dict[str, Any]] | None,
    as_string: bool,
    own: str | None = None,
) -> tuple[str, str] | None:
    """(layout, generated) framed the way the template frames the reasoning of a tool-call turn (which it
    renders as current), with this turn's own ending; None when no such framing can be learned. ``own``: this
    turn rendered with sentinel reasoning and content, when the caller already has it."""
    try:
        tool_turn = finished(SENTINEL_REASONING, SENTINEL_CONTENT, tool_calls_for_template([PROBE_CALL], as_string))
        if own is None:
            own = finished(SENTINEL_REASONING if reasoning else reasoning, SENTINEL_CONTENT, calls)
    except (ChatTemplateError, TemplateRaised):
        return None
    body = tool_turn[len(prompt) :] if tool_turn.startswith(prompt) else ""
    if SENTINEL_REASONING not in body or SENTINEL_CONTENT not in body.split(SENTINEL_REASONING, 1)[1]:
        return None
    before, after = body.split(SENTINEL_CONTENT, 1)[0].split(SENTINEL_REASONING, 1)
    head, _, tail = own.rpartition(SENTINEL_CONTENT)
    # This turn's own render must show the same framing (reasoning kept or emptied) right before its content.
    if not (head.endswith(before + after) or head.endswith(before + SENTINEL_REASONING + after)):
        return None
    r = SENTINEL_REASONING if reasoning else ""
    c = SENTINEL_CONTENT if content else ""
    return before + r + after + c + tail, before + (reasoning or "") + after + (content or "") + tail


def _split_generation_prompt(generation_prompt: str, start: str, end: str) -> tuple[str, bool] | None:
    """(opener, opened) where the generation prompt ends by opening the reasoning block (``opener + start``, maybe
    with whitespace after it) or emptying it (``opener + [start] + end``); None otherwise."""
    tail = generation_prompt.rstrip()
    if tail.endswith(start):
        return tail[: -len(start)], True
    if tail.endswith(end):
        opener = tail[: -len(end)]
        stripped = opener.rstrip()
        return (stripped[: -len(start)] if stripped.endswith(start) else opener), False
    return None


def _framing_from_reasoning_markers(
    finished,
    bare: str,
    generation_prompt: str,
    full: str,
    reasoning: str | None,
    content: str | None,
    calls: list[dict[str, Any]] | None,
    start: str | None,
    end: str | None,
    close: str | None = None,
) -> tuple[str, str] | None:
    """(layout, generated) where the generation prompt is ``opener + start`` (the block left open for the model) or
    ``opener + [start] + end`` (an emptied block: the model answers at once) but the template renders the finished
    turn without that block: ``opener + end + content`` (DeepSeek V3.1, V3.2 chat) or ``opener + content`` with no
    reasoning at all (DeepSeek-R1-Distill, whose prompt ends ``<think>\n``; Gemma 4 without thinking, whose prompt
    empties the thought channel). The model's text is then ``reasoning + end + content ...`` after an open block
    (``close``: the template's own text closing the block where it has one, else the marker ``end``) and
    ``content ...`` after an emptied one. None when the renders do not meet this way or the template renders the
    reasoning itself; TurnRefused when the record's reasoning contradicts its prompt.
    """
    if not start or not end or not generation_prompt or not full.startswith(bare):
        return None
    split = _split_generation_prompt(generation_prompt, start, end)
    if split is None:
        return None
    opener, opened = split
    turn = full[len(bare) :]
    if not turn.startswith(opener):
        return None
    if not opened and reasoning:
        raise TurnRefused(
            "prompt_closes_reasoning",
            (
                f"the generation prompt closes the reasoning block ({generation_prompt!r}: a non-thinking mode) but "
                f"the record has reasoning, which the model cannot have written after that prompt: check the "
                f"request's chat_template_kwargs (e.g. thinking) against the provider's mode"
            ),
        )
    try:
        framed = finished(
            SENTINEL_REASONING if reasoning else reasoning, SENTINEL_CONTENT if content else content, calls
        )
    except (ChatTemplateError, TemplateRaised):
        return None
    if not framed.startswith(bare + opener) or SENTINEL_REASONING in framed[len(bare) :]:
        return None  # the template renders the reasoning (or the turn) some other way: not this case
    after, after_layout = turn[len(opener) :], framed[len(bare) + len(opener) :]
    if after.startswith(end) and after_layout.startswith(end):  # the turn renders the block's end: the model's too
        after, after_layout, close = after[len(end) :], after_layout[len(end) :], end
    elif start in after_layout or end in after_layout:
        return None  # a block somewhere else in the turn: not this case
    if not opened:
        return after_layout, after
    if reasoning is None:
        return None  # no reasoning returned for a block the prompt opened: refused (no_reasoning_block_opened)
    close = close if close is not None else end
    return (SENTINEL_REASONING if reasoning else "") + close + after_layout, reasoning + close + after


def _framing_from_reasoning_block(
    block: ReasoningFraming,
    prompt: str,
    generation_prompt: str,
    full: str,
    layout: str | None,
    reasoning: str | None,
) -> tuple[str, str] | None:
    """(layout, generated) for a turn whose reasoning the template drops (it renders the reasoning frame only in a
    tool-call turn, as Gemma 4 does) where its own renders show the frame right after the same generation prompt:
    the model writes ``open + reasoning + close`` first, then what the template renders for the turn. None when the
    turn follows another prompt (a tool result) or already holds a reasoning block."""
    if not reasoning or layout is None or not full.startswith(prompt):
        return None
    if not block.after_generation_prompt or generation_prompt != block.generation_prompt:
        return None
    if block.start in layout or block.end in layout:
        return None
    generated = full[len(prompt) :]
    return block.open + SENTINEL_REASONING + block.close + layout, block.open + reasoning + block.close + generated


def _locate_text(turn: TurnText, layout: str | None, reasoning: str | None, content: str | None) -> None:
    """Fill ``turn.regions`` (and ``normalised``) from the sentinel layout of the generated text."""
    texts = {"reasoning": reasoning, "content": content}
    sentinels = {"reasoning": SENTINEL_REASONING, "content": SENTINEL_CONTENT}
    if layout is None:
        turn.layout_known = False
        return
    found = sorted((layout.index(sentinels[k]), k) for k in sentinels if texts[k] and sentinels[k] in layout)
    if any(layout.count(sentinels[k]) != 1 for _, k in found):
        turn.layout_known = False
        return
    pieces, rest = [], layout
    for _, k in found:
        head, rest = rest.split(sentinels[k], 1)
        pieces.append(head)
    pieces.append(rest)
    # Fast path: the template wrote the API's text verbatim.
    pos, regions, verbatim = 0, [], True
    for i, (_, k) in enumerate(found):
        if not turn.generated.startswith(pieces[i], pos):
            verbatim = False
            break
        pos += len(pieces[i])
        text = texts[k] or ""
        if not turn.generated.startswith(text, pos):
            verbatim = False
            break
        regions.append((k, pos, pos + len(text)))
        pos += len(text)
    if verbatim and turn.generated[pos:] == pieces[-1]:
        turn.regions = regions
        return
    pattern = "".join(re.escape(p) + "(.*?)" for p in pieces[:-1]) + re.escape(pieces[-1])
    m = re.fullmatch(pattern, turn.generated, flags=re.DOTALL)
    if m is None:
        turn.layout_known = False
        turn.normalised.append({"field": "turn", "api": "", "template": turn.generated[:80]})
        return
    for g, (_, k) in enumerate(found, start=1):
        turn.regions.append((k, m.start(g), m.end(g)))
        if m.group(g) != texts[k]:
            api, tpl = texts[k] or "", m.group(g)
            kind = "stripped" if api.strip() == tpl.strip() else "changed"
            turn.normalised.append({"field": k, "kind": kind, "api": _edges(api), "template": _edges(tpl)})


def _edges(text: str, width: int = 24) -> str:
    return repr(text) if len(text) <= 2 * width else repr(text[:width]) + " ... " + repr(text[-width:])
