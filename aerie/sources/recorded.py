"""Responses that already exist (``source.kind: recorded``): the target's own answers, read from a file or a Hub
dataset instead of asked of an API, at $0.

A recorded source is a prompt source whose rows also hold the answer. Three shapes (``source.shape``):

- ``sharegpt``: ``conversations`` of ``{from, value}`` turns (lightseekorg/kimi-mtp-dataset); a turn's reasoning is
  a key of the turn (``reasoning_key``) or written inline, ``<think>R</think>C`` (``think_markers``);
- ``messages``: an OpenAI chat list of ``{role, content, reasoning_content | reasoning, tool_calls, ...}``;
- ``log``: one request/response record of a serving log, e.g. an OpenAI-compatible gateway's JSONL: the request
  body's ``messages`` (and ``tools``) and the response body's ``choices[0].message``, ``finish_reason`` and
  ``usage``. Where each sits is a dotted field path (``source.paths``, :data:`LOG_PATHS`), so another log
  layout is described by settings, not code.

Which turn is the sample (``source.turns``): ``last`` (default) - the conversation's last assistant turn; ``every``
- each assistant turn that answers a user or tool turn, one sample each. The prompt is everything before the
turn, rendered later by the target's template with the generation prompt (the tokens stage); the earlier
assistant turns inside it are history, rendered as the template renders history (Kimi drops their reasoning,
as the served model saw them). The sampled turn itself is never rendered as history: it becomes
``reasoning`` / ``content`` / ``tool_calls`` of an ``aerie.responses/1`` record and goes through the same token
rebuild as an API's answer (exact, or refused with a counted reason in the fidelity report).

A row that cannot be read (not JSON, a field path that is absent or of the wrong type) fails the parse naming
``file:line`` (``on_unreadable: error``, the default; ``skip`` counts it instead); a readable row that holds no
sample (no assistant turn, an assistant turn answering nothing, an empty answer, a failed request, a role or
content the template cannot render) is left out with a counted reason, which the dry run prints.

The responses stage and the preview of these samples: aerie.responses.recorded. Parse time imports this module:
no torch. Fields: docs/formats.md ("Recorded responses").
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

from aerie.formats.prompts import CHARS_PER_TOKEN as PROMPT_CHARS_PER_TOKEN
from aerie.sources.tables import (
    FETCH_COMMAND,
    MESSAGE_KEYS,
    SHAREGPT_ROLES,
    PromptSourceError,
    dedup_key,
    hub_cache_dir,
    load_table,
    local_data_files,
    source_identity,
    source_label,
)

SHAPES = ("auto", "sharegpt", "messages", "log")
TURNS = ("last", "every")
BACKEND = "recorded"
PROVENANCE_KIND = "recorded"
# Where an OpenAI-compatible gateway's JSONL keeps each part of one request/response (``source.paths`` overrides).
LOG_PATHS: dict[str, str | None] = {
    "messages": "request.messages",
    "tools": "request.tools",
    "chat_template_kwargs": "request.chat_template_kwargs",
    "message": "response.choices.0.message",
    "finish_reason": "response.choices.0.finish_reason",
    "usage": "response.usage",
    "model": "response.model",
    "id": "response.id",
    "prompt_token_ids": None,  # a log that keeps the exact ids (SGLang /generate): the tokens stage compares them
    "output_token_ids": None,
}
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
THINK_MARKERS = ("<think>", "</think>")
CHARS_PER_TOKEN = float(PROMPT_CHARS_PER_TOKEN)  # the previews' rule (aerie.formats.prompts)


class RecordedError(PromptSourceError):
    """A recorded row that cannot be read, naming file:line (or the row of a table)."""


def is_recorded_dataset(dataset: dict[str, Any]) -> bool:
    """The dataset's source is a recorded log (its answers exist): the one place the source kind is compared."""
    return dataset["source"]["kind"] == "recorded"


def absent_optional(dataset: dict[str, Any]) -> str | None:
    """Why an optional recorded source is not here (its files, or its Hub dataset in the local cache), else None:
    the dataset then plans no shard and the dry run says so, instead of failing the parse."""
    source = dataset["source"]
    if not is_recorded_dataset(dataset) or not source.get("optional"):
        return None
    try:
        if source_identity(source) is not None:
            return None
    except PromptSourceError as e:
        return f"{e}"
    return f"'{source['name']}' is not in the local datasets cache ({hub_cache_dir(source['name'])}): {FETCH_COMMAND}"


# ---- reading rows ---------------------------------------------------------------------------------------------


def _rows(source: dict[str, Any], where: str) -> Iterator[tuple[str, Any]]:
    """(file:line or source row N, row) of every row: local JSONL files line by line (so an error names the line),
    other files and Hub datasets through HF ``datasets`` (offline)."""
    files = local_data_files(source) if not source.get("name") else []
    if files and all(f.name.endswith(".jsonl") for f in files):
        for path in files:
            with open(path, "rb") as fh:
                for lineno, raw in enumerate(fh, start=1):
                    if not raw.strip():
                        continue
                    try:
                        yield f"{path}:{lineno}", json.loads(raw)
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        yield f"{path}:{lineno}", RecordedError(f"{path}:{lineno}: not a JSON line ({e})")
        return
    table = load_table({**source, "kind": "hf"}, where)
    label = source_label(source)
    # In order, through the table's own iterator (batched Arrow reads, not one lookup per row).
    for index, row in enumerate(table):
        yield f"{label} row {index}", row


def field(row: Any, path: str | None) -> Any:
    """The value at a dotted path (``response.choices.0.message``: keys, and integers for list items); a missing
    step gives KeyError naming it."""
    if path is None:
        return None
    node = row
    for step in path.split("."):
        if isinstance(node, list) and step.lstrip("-").isdigit() and -len(node) <= int(step) < len(node):
            node = node[int(step)]
        elif isinstance(node, dict) and step in node:
            node = node[step]
        else:
            raise KeyError(step)
    return node


def _optional(row: Any, path: str | None) -> Any:
    try:
        return field(row, path)
    except KeyError:
        return None


def _text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    return None


def split_inline_reasoning(text: str, markers: tuple[str, str]) -> tuple[str | None, str]:
    """``<think>R</think>C`` -> (R, C); text without the closing marker -> (None, text). A leading opener is
    optional (K2.5's generation prompt holds it; a dump may or may not repeat it)."""
    start, end = markers
    if end not in text:
        return None, text
    reasoning, content = text.split(end, 1)
    stripped = reasoning.lstrip()
    if stripped.startswith(start):
        reasoning = stripped[len(start) :]
    return reasoning, content


class _Skip(Exception):
    """A readable row or turn that is no sample; the message is the counted reason."""


def _assistant(text: str | None, reasoning: Any, markers: tuple[str, str] | None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if isinstance(reasoning, str):
        msg["reasoning_content"] = reasoning
    elif text is not None and markers is not None:
        r, c = split_inline_reasoning(text, markers)
        if r is not None:
            msg["reasoning_content"], msg["content"] = r, c
    return msg


def _sharegpt(turns: Any, source: dict[str, Any], markers: tuple[str, str] | None) -> list[dict[str, Any]]:
    if not isinstance(turns, list):
        raise TypeError("is not a list of {from, value} turns")
    keys = [source["reasoning_key"]] if source.get("reasoning_key") else list(REASONING_KEYS)
    messages = []
    for t in turns:
        if not isinstance(t, dict) or "from" not in t or "value" not in t:
            raise TypeError("holds a turn without 'from' and 'value'")
        role = SHAREGPT_ROLES.get(str(t["from"]).lower())
        if role is None:
            raise _Skip("unknown_role")
        text = _text(t["value"])
        if text is None:
            raise _Skip("non_text_content")
        if role == "assistant":
            reasoning = next((t[k] for k in keys if isinstance(t.get(k), str)), None)
            messages.append(_assistant(text, reasoning, markers))
        else:
            messages.append({"role": role, "content": text})
    return messages


def _message(m: Any, markers: tuple[str, str] | None) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise TypeError("holds a message without a string 'role'")
    text = _text(m.get("content"))
    if text is None and m.get("content") not in (None, ""):
        raise _Skip("non_text_content")
    if m["role"] == "assistant":
        reasoning = next((m[k] for k in REASONING_KEYS if isinstance(m.get(k), str)), None)
        out = _assistant(text, reasoning, markers)
        out.update({k: m[k] for k in ("name", "tool_calls") if m.get(k)})
        return out
    return {k: m[k] for k in MESSAGE_KEYS if m.get(k) is not None} | {"content": text or ""}


def _messages(items: Any, markers: tuple[str, str] | None) -> list[dict[str, Any]]:
    if not isinstance(items, list):
        raise TypeError("is not a list of chat messages")
    return [_message(m, markers) for m in items]


def _markers(source: dict[str, Any]) -> tuple[str, str] | None:
    markers = source.get("think_markers", list(THINK_MARKERS))
    return (str(markers[0]), str(markers[1])) if markers else None


def resolve_shape(source: dict[str, Any], row: Any) -> str:
    shape = source.get("shape", "auto")
    if shape != "auto":
        return shape
    if isinstance(row, dict):
        if "conversations" in row:
            return "sharegpt"
        if "messages" in row:
            return "messages"
        try:
            field(row, LOG_PATHS["message"])
            return "log"
        except KeyError:
            pass
    raise TypeError(
        "is none of the recorded shapes (a 'conversations' or 'messages' list, or a request/response log record); "
        "set source.shape (sharegpt, messages, log) and source.field / source.paths"
    )


def _conversation(row: Any, source: dict[str, Any], shape: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the whole conversation as chat messages, what the row says about its last answer: tools, finish reason,
    usage, model, id, template kwargs, exact ids)."""
    markers = _markers(source)
    facts: dict[str, Any] = {}
    if shape == "sharegpt":
        messages = _sharegpt(field(row, source.get("field", "conversations")), source, markers)
    elif shape == "messages":
        messages = _messages(field(row, source.get("field", "messages")), markers)
    else:
        paths = {**LOG_PATHS, **(source.get("paths") or {})}
        request = _messages(field(row, paths["messages"]), markers)
        message = _optional(row, paths["message"])
        if message is None:
            raise _Skip("no_response")  # a failed request: the log has no answer
        if not isinstance(message, dict):
            raise TypeError(f"answer at '{paths['message']}' is not a message object")
        messages = [*request, {**_message({"role": "assistant", **message}, markers), "role": "assistant"}]
        for name in ("finish_reason", "usage", "model", "id", "prompt_token_ids", "output_token_ids"):
            value = _optional(row, paths.get(name))
            if value is not None:
                facts[name] = value
        for name in ("tools", "chat_template_kwargs"):
            value = _optional(row, paths.get(name))
            if value:
                facts[name] = value
        facts["last_only"] = True  # the log's answer is the response; the request's turns are history
    if shape != "log":
        tools = _optional(row, source.get("tools_field", "tools"))
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError:
                raise TypeError(f"field '{source.get('tools_field', 'tools')}' is not JSON") from None
        if tools:
            facts["tools"] = tools
    if "tools" in facts and not (isinstance(facts["tools"], list) and all(isinstance(t, dict) for t in facts["tools"])):
        raise TypeError("its tools are not a list of tool objects")
    return messages, facts


def _sample_turns(messages: list[dict[str, Any]], turns: str, last_only: bool) -> list[int]:
    """Indices of the assistant turns that become samples."""
    answers = [
        i
        for i, m in enumerate(messages)
        if m["role"] == "assistant"
        and i > 0
        and messages[i - 1]["role"] in ("user", "tool")
        and any(p["role"] == "user" for p in messages[:i])
    ]
    if not answers:
        raise _Skip("no_assistant_turn" if not any(m["role"] == "assistant" for m in messages) else "answers_nothing")
    if turns == "last" or last_only:
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        if last not in answers:
            raise _Skip("answers_nothing")
        return [last]
    return answers


def recorded_samples(name: str, source: dict[str, Any], stats: Counter | None = None) -> Iterator[tuple[dict, bytes]]:
    """(prompt-cache record, dedup key) of every sample of a recorded source, in row order.

    A record is ``{id, messages (the prompt), tools?, source: {kind: recorded, ...}, recorded: {...}}``: ``recorded``
    holds the answer (``reasoning``, ``content``, ``tool_calls``, ``finish_reason``, and what the row says:
    ``usage``, ``model``, ``chat_template_kwargs``, exact ids). ``stats`` counts ``rows``, ``samples`` and each
    skip reason (``skipped.<reason>``), and the characters of prompts and answers (``prompt_chars``,
    ``output_chars``), for the preview."""
    stats = stats if stats is not None else Counter()
    where = f"datasets.{name}"
    turns = source.get("turns", "last")
    id_field = source.get("id_field")
    on_unreadable = source.get("on_unreadable", "error")
    label = source_label(source)
    kwargs_default = source.get("chat_template_kwargs") or {}
    roles = ("system", "user", "assistant", "tool")
    shape = None if source.get("shape", "auto") == "auto" else source["shape"]
    for index, (at, row) in enumerate(_rows(source, where)):
        stats["rows"] += 1
        try:
            if isinstance(row, Exception):
                raise row
            shape = shape or resolve_shape(source, row)  # auto: the first row decides for the source
            messages, facts = _conversation(row, source, shape)
            if any(m["role"] not in roles for m in messages):
                raise _Skip("unknown_role")
            chosen = _sample_turns(messages, turns, facts.get("last_only", False))
            sid = str(field(row, id_field)) if id_field else (f"row{index}")
        except _Skip as skip:
            stats[f"skipped.{skip}"] += 1
            continue
        except (TypeError, KeyError, RecordedError) as e:
            problem = (
                str(e)
                if isinstance(e, RecordedError)
                else (f"{at}: field {e} is missing" if isinstance(e, KeyError) else f"{at}: the row {e}")
            )
            if on_unreadable == "skip":
                stats["skipped.unreadable"] += 1
                continue
            raise RecordedError(f"{where} (source.shape {source.get('shape', 'auto')}): {problem}") from None
        for i in chosen:
            answer = messages[i]
            content, reasoning = answer.get("content"), answer.get("reasoning_content")
            calls = answer.get("tool_calls") or None
            if not (content or "").strip() and not calls:
                stats["skipped.empty_answer"] += 1
                continue
            prompt = messages[:i]
            kwargs = {**kwargs_default, **(facts.get("chat_template_kwargs") or {})}
            last = i == len(messages) - 1 or facts.get("last_only")
            recorded: dict[str, Any] = {
                "reasoning": reasoning,
                "content": content or "",
                "tool_calls": calls,
                # A dump keeps finished turns: its answers ended the turn (a log says its own finish reason).
                "finish_reason": (facts.get("finish_reason") if last else None) or ("tool_calls" if calls else "stop"),
                **({"chat_template_kwargs": kwargs} if kwargs else {}),
                **{
                    k: facts[k]
                    for k in ("usage", "model", "id", "prompt_token_ids", "output_token_ids")
                    if last and k in facts
                },
            }
            record = {
                "id": sid if len(chosen) == 1 and turns == "last" else f"{sid}/turn{i}",
                "messages": prompt,
                **({"tools": facts["tools"]} if facts.get("tools") else {}),
                "source": {"kind": PROVENANCE_KIND, "dataset": label, "at": at, "turn": i},
                "recorded": recorded,
            }
            stats["samples"] += 1
            stats["prompt_chars"] += sum(len(m.get("content") or "") for m in prompt)
            stats["output_chars"] += len(reasoning or "") + len(content or "") + len(json.dumps(calls) if calls else "")
            yield record, dedup_key(prompt)
