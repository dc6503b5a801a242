"""The target's chat format: prompt rendering with its own template, and the token-level framing of a turn.

Nothing here is hard-coded per model: ids and framing are read from the tokenizer and its chat template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aerie.target.model import end_of_turn_ids


def special_token_id(tokenizer, token: str) -> int:
    """The single id of a special token, read from the tokenizer (never hard-coded)."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
        raise ValueError(f"the tokenizer does not define {token!r} as a single token (got ids {ids})")
    return ids[0]


def render_prompt_ids(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                      **template_kwargs: Any) -> list[int]:
    """Token ids of the prompt exactly as the server would build it: chat template + generation prompt.

    ``tools`` are the tool declarations the request sent (the template renders them, Kimi as a
    ``tool_declare`` turn); ``template_kwargs`` are the request's ``chat_template_kwargs``.
    """
    if tools:
        template_kwargs["tools"] = tools
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, **template_kwargs
    )
    return [int(i) for i in ids]


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
    """

    turn_end_id: int  # what the template writes after an assistant turn's content: the model samples it last
    stop_ids: tuple[int, ...]  # every id that ends generation: turn end, tokenizer eos, generation_config eos
    think_start_id: int | None
    think_end_id: int | None
    generation_prompt_ids: tuple[int, ...]  # what add_generation_prompt appends after the last turn
    special_ids: frozenset[int]  # ids of the tokenizer's added tokens

    def token_text(self, tokenizer, token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _render(tokenizer, messages: list[dict[str, Any]], **kwargs: Any):
    return tokenizer.apply_chat_template(messages, return_dict=False, **kwargs)


def read_chat_format(tokenizer, generation_config: Any | None = None) -> ChatFormat:
    """Probe the chat template with a one-question conversation to learn how a generated turn is framed."""
    special_ids = frozenset(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}) or {})
    user = [{"role": "user", "content": PROBE_USER}]
    with_prompt = [int(i) for i in _render(tokenizer, user, tokenize=True, add_generation_prompt=True)]
    without = [int(i) for i in _render(tokenizer, user, tokenize=True, add_generation_prompt=False)]
    common = next((i for i, (a, b) in enumerate(zip(with_prompt, without)) if a != b), min(len(with_prompt), len(without)))
    generation_prompt = tuple(with_prompt[common:])
    if not generation_prompt:
        raise ValueError("the chat template adds nothing for add_generation_prompt=True: cannot tell where the "
                         "generated part starts")

    stops = set(end_of_turn_ids(tokenizer, generation_config))
    turn_end = None
    try:
        text = _render(tokenizer, user + [{"role": "assistant", "content": PROBE_ANSWER}], tokenize=False,
                       add_generation_prompt=False)
        after = text[text.rindex(PROBE_ANSWER) + len(PROBE_ANSWER):]
        following = tokenizer.encode(after, add_special_tokens=False)
        if following and following[0] in special_ids:
            turn_end = int(following[0])
    except Exception:  # noqa: BLE001 - a template may raise on a final assistant turn (jinja's raise_exception)
        turn_end = None
    if turn_end is None:
        if tokenizer.eos_token_id is None:
            raise ValueError("cannot find the end-of-turn token: the template writes no special token after an "
                             "assistant turn and the tokenizer has no eos_token")
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
