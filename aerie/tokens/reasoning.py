"""Whether a responses record's request asked the target for its reasoning (torch-free: the rules read it).

One job: the tokens stage drops a text-only record whose reasoning is missing (``null``) when reasoning was
requested (``tokens.keep_missing_reasoning`` keeps it): the provider stripped the trace, and training on the
answer alone would teach "the model did not think". Empty reasoning (``""``) is what the model wrote and stays.

What the record says comes first: its ``chat_template_kwargs`` turning the template's thinking mode off
(``thinking`` / ``enable_thinking``: false: not requested), the ``no_reasoning`` flag (the responses stage was
told to require reasoning, ``responses.require_reasoning``, and got none), then the request's own
``params.reasoning`` (OpenRouter's reasoning object: asked unless ``enabled: false`` or ``effort: none``;
``exclude: true`` asks the model to think and return nothing, so the trace is missing too). Records that say
none of these (an OpenAI-compatible server, or records written before) take the dataset's responses settings
(``requested_by_config``).
"""

from __future__ import annotations

from typing import Any

# chat_template_kwargs that switch a template's thinking mode (Kimi, DeepSeek: thinking; Qwen3: enable_thinking)
THINKING_SWITCHES = ("thinking", "enable_thinking")


def _asked(reasoning: Any) -> bool | None:
    """What an OpenRouter reasoning object asks for: True, False (turned off), None (not an object)."""
    if not isinstance(reasoning, dict):
        return None
    return reasoning.get("enabled") is not False and reasoning.get("effort") != "none"


def requested_by_config(responses: dict[str, Any]) -> bool:
    """Reasoning asked of the target by a dataset's responses settings: ``require_reasoning`` (default true: a
    thinking target), unless the reasoning object sent turns it off."""
    return bool(responses.get("require_reasoning", True)) and _asked(responses.get("reasoning")) is not False


def reasoning_requested(record: dict[str, Any], default: bool) -> bool:
    """Whether this record's request asked for reasoning (``default``: the dataset's settings, for records that
    do not say)."""
    params = record.get("params") or {}
    kwargs = params.get("chat_template_kwargs") or {}
    if any(kwargs.get(k) is False for k in THINKING_SWITCHES):
        return False  # the request turned the template's thinking mode off
    if "no_reasoning" in (record.get("flags") or ()):
        return True
    asked = _asked(params.get("reasoning"))
    return default if asked is None else asked
