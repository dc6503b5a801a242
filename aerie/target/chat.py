"""The target's chat format: prompt rendering with its own template, and the template's own rendering of a turn.

Nothing here is hard-coded per model: ids and framing are read from the tokenizer and its chat template.
The generated part of a training sequence is what the template renders for the finished assistant turn
after the prompt with its generation prompt (``render_turn``): Qwen3's ``<think>\\nR\\n</think>\\n\\nC``,
GLM's ``\\n<think>R</think>\\nC``, gpt-oss's channels and Kimi K3's tags all come out of the template
itself. Where the template cannot express the turn it is refused (``TurnRefused``) or, for one named case,
falls back to framing learned from a turn the template does render.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from aerie.artifacts import FormatError
from aerie.target.model import end_of_turn_ids


def special_token_id(tokenizer, token: str) -> int:
    """The single id of a special token, read from the tokenizer (never hard-coded)."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
        raise ValueError(f"the tokenizer does not define {token!r} as a single token (got ids {ids})")
    return ids[0]


def optional_token_id(tokenizer, token: str) -> int | None:
    """The single id of ``token`` when the tokenizer defines it as one token, else None."""
    try:
        return special_token_id(tokenizer, token)
    except ValueError:
        return None


# ----------------------------------------------------------------------------------------------------------
# rendering with the template, with errors that say what to do


class ChatTemplateError(FormatError):
    """The target's chat template cannot be rendered as transformers renders it (message names the feature)."""


def _template_file(tokenizer) -> str:
    where = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    return f"{where} (chat_template.jinja or tokenizer_config.json 'chat_template')"


def _explain(tokenizer, err: Exception) -> ChatTemplateError:
    """A template failure turned into: which template feature, in which file, what to do."""
    text = f"{type(err).__name__}: {err}"
    file = _template_file(tokenizer)
    if "unsafe" in text and "append" in text or "SecurityError" in text:
        what = (
            "uses `list.append` (a llama.cpp/minja idiom); transformers renders templates in a sandboxed "
            "Jinja that forbids mutating a list. Rewrite it as `{% set ns.items = ns.items + [x] %}`"
        )
    elif "No filter named" in text or "no filter named" in text:
        name = re.search(r"[Nn]o filter named '([^']+)'", text)
        what = (
            f"uses the filter `{name.group(1) if name else '?'}`, which transformers' Jinja does not define "
            f"(llama.cpp-only filters such as `fromjson`). Replace it with plain Jinja"
        )
    elif "concatenate" in text:
        what = (
            "joins a non-text value as text (e.g. tool-call arguments as a dict where it expects a JSON "
            "string). Pass the value the template expects"
        )
    elif "TemplateSyntaxError" in text:
        what = "does not parse as Jinja. Fix its syntax"
    else:
        what = "fails to render this conversation. Check the conversation against what the template expects"
    return ChatTemplateError(f"the chat template of {file} {what}, then rerun the tokens stage ({text})")


def render_text(
    tokenizer,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """The template's text for ``messages`` (raises ChatTemplateError naming the failing feature)."""
    import jinja2

    if tools:
        template_kwargs["tools"] = tools
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
    except jinja2.exceptions.TemplateError as err:  # SecurityError, UndefinedError, syntax, raise_exception
        if type(err).__name__ == "TemplateError":  # the template's own raise_exception: about this conversation
            raise TemplateRaised(str(err)) from err
        raise _explain(tokenizer, err) from err
    except TypeError as err:  # e.g. `'...' + arguments` with arguments a dict
        raise _explain(tokenizer, err) from err


class TemplateRaised(FormatError):
    """The template's own ``raise_exception`` refused this conversation (e.g. roles must alternate)."""


def render_prompt_ids(
    tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **template_kwargs: Any
) -> list[int]:
    """Token ids of the prompt exactly as the server would build it: chat template + generation prompt.

    ``tools`` are the tool declarations the request sent (the template renders them, Kimi as a
    ``tool_declare`` turn); ``template_kwargs`` are the request's ``chat_template_kwargs``.
    """
    if tools:
        template_kwargs["tools"] = tools
    # Tool-call arguments as dicts, or JSON strings where the template needs them: as render_turn does.
    for as_string in (False, True):
        try:
            ids = tokenizer.apply_chat_template(
                messages_for_template(messages, as_string),
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                **template_kwargs,
            )
            break
        except Exception:  # noqa: BLE001 - any template failure on dicts: retry with strings, then raise
            if as_string or not any(m.get("tool_calls") for m in messages):
                raise
    return [int(i) for i in ids]


# ----------------------------------------------------------------------------------------------------------
# encoding, independent of transformers' per-call state


class TextEncoder:
    """Text -> ids with every added token matched as one id (``encode``) or as plain text (``encode_plain``).

    Independent of transformers' per-call state: a fast tokenizer's Rust backend is used directly only when
    nothing is set on it (``split_special_tokens`` leaves ``encode_special_tokens``, and truncation or
    padding from earlier calls); otherwise a private copy with those cleared is used. Slow tokenizers
    (Kimi's tiktoken-based one) go through ``encode`` with the flag passed explicitly on every call.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self.fast = backend is not None
        self._plain = None
        if self.fast:
            clean = (
                not getattr(backend, "encode_special_tokens", False)
                and backend.truncation is None
                and backend.padding is None
            )
            if clean:
                self._special = backend
            else:
                from tokenizers import Tokenizer

                self._special = Tokenizer.from_str(backend.to_str())
                self._special.no_truncation()
                self._special.no_padding()
                self._special.encode_special_tokens = False
            self._backend = backend
        self.special_ids = frozenset(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}) or {})

    def _plain_backend(self):
        """A copy of the backend that matches no added token (built on first use: only the ``plain`` policy
        needs it). ``encode_special_tokens`` would not do: it only splits tokens flagged special, and
        DeepSeek's ``<think>`` is an added token that is not."""
        if self._plain is None:
            from tokenizers import Tokenizer

            bare = json.loads(self._backend.to_str())
            bare["added_tokens"] = []
            self._plain = Tokenizer.from_str(json.dumps(bare))
            self._plain.no_truncation()
            self._plain.no_padding()
        return self._plain

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self.fast:
            return self._special.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=False))

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
        """(ids, character offsets of each id) - offsets None for slow tokenizers."""
        if not text:
            return [], []
        if self.fast:
            enc = self._special.encode(text, add_special_tokens=False)
            return enc.ids, enc.offsets
        return self.encode(text), None

    def encode_plain(self, text: str) -> list[int]:
        """Ids of ``text`` with special-token text encoded as ordinary pieces."""
        if not text:
            return []
        if self.fast:
            return self._plain_backend().encode(text, add_special_tokens=False).ids
        # Slow tokenizers: split_special_tokens covers the tokens flagged special.
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


# ----------------------------------------------------------------------------------------------------------
# the chat format, probed once per target


PROBE_USER = "aerie probe question"
PROBE_ANSWER = "aerie probe answer"


@dataclass(frozen=True)
class ChatFormat:
    """Token-level facts of a target's chat format, read from its tokenizer and template (never hard-coded).

    Kimi K2.5: turn_end ``<|im_end|>``; generation prompt ``<|im_assistant|>assistant<|im_middle|><think>``
    (``<think>`` belongs to the prompt, so the model samples ``reasoning </think> content <|im_end|>``);
    Kimi-K2-Thinking's template stops at ``<|im_middle|>`` and the model samples ``<think>`` itself.
    GLM renders no end of turn: the model stops on the token that opens the next turn (``<|user|>``).
    """

    turn_end_id: int  # the last special token the template writes for a finished answer, or the next turn's opener
    stop_ids: tuple[int, ...]  # every id that ends generation: turn end, tokenizer eos, generation_config eos
    think_start_id: int | None
    think_end_id: int | None
    generation_prompt_ids: tuple[int, ...]  # what add_generation_prompt appends after a user turn (may be empty)
    special_ids: frozenset[int]  # ids of the tokenizer's added tokens

    def token_text(self, tokenizer, token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _render(tokenizer, messages: list[dict[str, Any]], **kwargs: Any):
    return tokenizer.apply_chat_template(messages, return_dict=False, **kwargs)


def _last_special(ids: list[int], special_ids: frozenset[int]) -> int | None:
    return next((int(i) for i in reversed(ids) if i in special_ids), None)


def _first_special(ids: list[int], special_ids: frozenset[int]) -> int | None:
    return next((int(i) for i in ids if i in special_ids), None)


def read_chat_format(tokenizer, generation_config: Any | None = None) -> ChatFormat:
    """Probe the chat template with a one-question conversation to learn how a generated turn is framed.

    The turn end is the last special token the template writes after a finished answer (Kimi K3 writes
    ``<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>``: ``<|end_of_msg|>``); a template that
    writes none (GLM) stops on the token that opens the next turn; failing both, the tokenizer's eos.
    """
    special_ids = frozenset(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}) or {})
    user = [{"role": "user", "content": PROBE_USER}]
    with_prompt = [int(i) for i in _render(tokenizer, user, tokenize=True, add_generation_prompt=True)]
    without = [int(i) for i in _render(tokenizer, user, tokenize=True, add_generation_prompt=False)]
    common = next(
        (i for i, (a, b) in enumerate(zip(with_prompt, without)) if a != b), min(len(with_prompt), len(without))
    )
    generation_prompt = tuple(with_prompt[common:])

    stops = set(end_of_turn_ids(tokenizer, generation_config))
    turn_end = None
    finished = user + [{"role": "assistant", "content": PROBE_ANSWER}]
    try:
        text = _render(tokenizer, finished, tokenize=False, add_generation_prompt=False)
        after = text[text.rindex(PROBE_ANSWER) + len(PROBE_ANSWER) :]
        turn_end = _last_special(tokenizer.encode(after, add_special_tokens=False), special_ids)
        if turn_end is None:  # no end written: the next turn's opener is what the model samples to stop
            nxt = _render(
                tokenizer,
                finished + [{"role": "user", "content": PROBE_USER}],
                tokenize=False,
                add_generation_prompt=False,
            )
            if nxt.startswith(text):
                turn_end = _first_special(tokenizer.encode(nxt[len(text) :], add_special_tokens=False), special_ids)
    except Exception:  # noqa: BLE001 - a template may raise on a final assistant turn (jinja's raise_exception)
        turn_end = None
    if turn_end is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "cannot find the end-of-turn token: the template writes no special token after an "
                "assistant turn and the tokenizer has no eos_token"
            )
        turn_end = int(tokenizer.eos_token_id)
    stops.add(turn_end)
    return ChatFormat(
        turn_end_id=turn_end,
        stop_ids=tuple(sorted(stops)),
        think_start_id=optional_token_id(tokenizer, "<think>"),
        think_end_id=optional_token_id(tokenizer, "</think>"),
        generation_prompt_ids=generation_prompt,
        special_ids=special_ids,
    )


# ----------------------------------------------------------------------------------------------------------
# the template's own rendering of a generated turn


SENTINEL_REASONING = "\u2063aerie-reasoning\u2063"  # U+2063: not whitespace, survives strip()/trim
SENTINEL_CONTENT = "\u2063aerie-content\u2063"
PROBE_CALL = {"id": "call_aerie_probe_0", "type": "function", "function": {"name": "aerie_probe", "arguments": {}}}


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
    path: str  # "exact" (the template renders this turn) or "fallback" (reasoning framing from a tool-call turn)
    generation_prompt: str  # what add_generation_prompt added for this record ("" when none)
    layout_known: bool = True  # False: the template changed the text in a way the regions cannot show
    normalised: list[dict[str, str]] = field(default_factory=list)  # API text vs the template's text
    arguments_as_string: bool = False  # tool-call arguments had to be passed as JSON strings

    @property
    def text_end(self) -> int:
        """Where the model's last text ends in ``generated``: the end-of-turn framing follows."""
        return max((e for _, _, e in self.regions), default=0)


def tool_calls_for_template(tool_calls: list[dict[str, Any]] | None, as_string: bool) -> list[dict[str, Any]] | None:
    """API tool calls with ``arguments`` parsed to dicts (what most templates iterate), or left as strings."""
    if not tool_calls:
        return None
    out = []
    for call in tool_calls:
        call = dict(call)
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if not as_string and isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # not JSON: the template gets the text the model wrote
        elif as_string and not isinstance(args, str):
            fn["arguments"] = json.dumps(args, ensure_ascii=False)
        call["function"] = fn
        out.append(call)
    return out


def messages_for_template(messages: list[dict[str, Any]], as_string: bool) -> list[dict[str, Any]]:
    """The conversation with every assistant turn's tool-call arguments as dicts (or JSON strings)."""
    return [
        {**m, "tool_calls": tool_calls_for_template(m["tool_calls"], as_string)} if m.get("tool_calls") else m
        for m in messages
    ]


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
) -> TurnText:
    """The template's own text of the generated turn after the prompt, or TurnRefused saying why not.

    Renders prompt + the assistant message (``reasoning_content``, ``content``, ``tool_calls`` with
    arguments as dicts, strings only where the template requires them) without a generation prompt,
    requires that it begins with the prompt rendered with this record's generation prompt, tools and
    template kwargs, and returns the suffix. A second render with sentinel texts shows where the model's
    reasoning and content lie in it (the rest is the template's framing) and whether the template changed
    them (strip/trim): such differences are listed in ``normalised``.
    """
    kw = dict(template_kwargs or {})
    thinking_key = "reasoning_content" not in _template_source(tokenizer)

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
    sr = SENTINEL_REASONING if reasoning else reasoning
    sc = SENTINEL_CONTENT if content else content
    path, layout, generated = "exact", None, ""
    if full.startswith(prompt):
        generated = full[len(prompt) :]
        framed = finished(sr, sc, calls)
        layout = framed[len(prompt) :] if framed.startswith(prompt) else None
    if not full.startswith(prompt) or (reasoning and layout is not None and SENTINEL_REASONING not in layout):
        # The template drops reasoning it treats as history (Kimi K2: a final answer turns the whole
        # tool-call loop before it into history): frame the turn as it frames a tool-call turn, or refuse.
        framing = _framing_from_tool_call_turn(finished, prompt, reasoning, content, calls, as_string)
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
    )
    _locate_text(turn, layout, reasoning, content)
    return turn


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
) -> tuple[str, str] | None:
    """(layout, generated) framed the way the template frames the reasoning of a tool-call turn (which it
    renders as current), with this turn's own ending; None when no such framing can be learned."""
    try:
        tool_turn = finished(SENTINEL_REASONING, SENTINEL_CONTENT, tool_calls_for_template([PROBE_CALL], as_string))
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


def next_turn_opener(
    tokenizer,
    messages: list[dict[str, Any]],
    layout_turn: dict[str, Any],
    special_ids: frozenset[int],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> int | None:
    """For templates that write no end of turn (GLM): the first special token of the turn the template
    renders next (a tool result after tool calls, a user turn otherwise) - the stop the model samples."""
    kw = dict(template_kwargs or {})
    calls = layout_turn.get("tool_calls")
    nxt = (
        {"role": "tool", "tool_call_id": str(calls[0].get("id") or "call_aerie_probe_0"), "content": "ok"}
        if calls
        else {"role": "user", "content": PROBE_USER}
    )
    for as_string in (False, True):
        msgs = messages_for_template(messages + [layout_turn], as_string)
        try:
            a = render_text(tokenizer, msgs, add_generation_prompt=False, tools=tools, **kw)
            b = render_text(tokenizer, msgs + [nxt], add_generation_prompt=False, tools=tools, **kw)
            break
        except (ChatTemplateError, TemplateRaised):
            if as_string:
                return None
    if not b.startswith(a):
        return None
    return _first_special(tokenizer.encode(b[len(a) :], add_special_tokens=False), special_ids)
