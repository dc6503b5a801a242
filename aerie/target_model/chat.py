"""The target's chat format: the token-level facts of how its template frames a generated turn.

One job: probe the tokenizer and chat template (never a per-model table) for what ends a turn and what the
model samples around its text: the turn end (``<|im_end|>``, Kimi K3's ``<|end_of_msg|>``; for templates
that write none, like GLM, the token that opens the next turn), every stop id, the think tokens and the
generation prompt (``read_chat_format``, once per target; ``next_turn_opener``, per kind of turn).
Rendering itself is ``aerie.target_model.template``; the template's text of a whole generated turn is
``aerie.target_model.turns``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aerie.target_model.model import end_of_turn_ids
from aerie.target_model.template import ChatTemplateError, TemplateRaised, messages_for_template, render_text


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
    writes none (GLM) stops on the token that opens the next turn, when the model declares it a stop
    (``generation_config.json`` eos ids or the tokenizer's eos: what a server stops on); failing both, the
    tokenizer's eos.
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
            if turn_end not in stops:  # an opener the model does not stop on (Seed-OSS's <seed:bos>): not an end
                turn_end = None
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


def split_generated(tokenizer, output_ids: list[int], fmt: ChatFormat) -> dict[str, Any]:
    """Split exact output ids into reasoning / content text and the finish reason.

    The sampled sequence is ``[<think>] reasoning </think> content <turn end>`` (``<think>`` only when the
    prompt did not open the block itself, as with Kimi-K2-Thinking's template).
    """
    finish_reason = "stop" if output_ids and output_ids[-1] in fmt.stop_ids else "length"
    body = output_ids[:-1] if finish_reason == "stop" else output_ids
    if fmt.think_end_id is not None and fmt.think_end_id in body:
        cut = body.index(fmt.think_end_id)
        reasoning_ids, content_ids = body[:cut], body[cut + 1 :]
        if reasoning_ids[:1] == [fmt.think_start_id]:
            reasoning_ids = reasoning_ids[1:]
        reasoning = tokenizer.decode(reasoning_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    else:
        reasoning, content_ids = None, body
    # skip_special_tokens=False: tool-call markers are special tokens and must survive as text.
    content = tokenizer.decode(content_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return {"reasoning": reasoning, "content": content, "finish_reason": finish_reason}
