"""Rendering a conversation with the target's own chat template, as transformers (and the server) render it.

One job: text or prompt ids for a list of messages. Tool-call arguments go in as dicts (what most templates
iterate) and as JSON strings only where a template fails on dicts; a template failure comes out as
``ChatTemplateError`` naming the Jinja feature, the file and what to do, and a template's own
``raise_exception`` as ``TemplateRaised`` (a refusal of this conversation, not a broken template).
"""

from __future__ import annotations

import json
import re
from typing import Any

import jinja2

from aerie.tools.artifacts import FormatError


class ChatTemplateError(FormatError):
    """The target's chat template cannot be rendered as transformers renders it (message names the feature)."""


class TemplateRaised(FormatError):
    """The template's own ``raise_exception`` refused this conversation (e.g. roles must alternate)."""


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
