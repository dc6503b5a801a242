"""Byte-level BPE tokenizer with Kimi K2.5's chat special tokens and a Kimi-structured chat template.

The demo target must exercise the same mechanics as Kimi: special tokens that are single ids, turns
without newlines between them, a default system prompt injected when none is given, assistant history
rendered with an empty `<think></think>`, and a generation prompt that ends with `<think>` (so `<think>`
belongs to the prompt and the model samples `reasoning</think>answer<|im_end|>`). Token ids are never
hard-coded: read them from the tokenizer (``special_token_ids``).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from aerie.sources.synthetic import FAMILIES, TaskExample, make_example

# Kimi K2.5's chat and control tokens (same spelling; our ids are whatever the trainer assigns).
SPECIAL_TOKENS: tuple[str, ...] = (
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "[EOT]",
    "<|im_system|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
    "[UNK]",
    "[PAD]",
)
END_OF_TURN = "<|im_end|>"
THINK_END = "</think>"
DEFAULT_SYSTEM_PROMPT = "You are a helpful demo assistant built by aerie."
# Pre-tokenization: contractions, numbers with an optional leading space, words with one optional leading
# non-letter (so "has_close_elements" -> "has", "_close", "_elements"), punctuation runs, whitespace.
PRETOKENIZE_PATTERN = (
    r"'(?:[sdmt]|ll|ve|re)| ?\p{N}+|[^\r\n\p{L}\p{N}]?\p{L}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Written for aerie, following the structure described in docs (see the kimi-k2.5 note). Rules:
# - role name between the role token and <|im_middle|> is message.name or message.role;
# - assistant turns up to the last one without tool calls are history: reasoning dropped (<think></think>);
#   later assistant turns (the current tool-call loop) keep <think>{reasoning}</think>;
# - `thinking=False` (instant mode) closes the think block in the generation prompt.
CHAT_TEMPLATE = (
    "{%- macro text(m) -%}"
    "{%- if m.content is string -%}{{ m.content }}"
    "{%- elif m.content is not none -%}"
    "{%- for part in m.content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro header(m) -%}"
    "{%- if m.role == 'user' -%}<|im_user|>"
    "{%- elif m.role == 'assistant' -%}<|im_assistant|>"
    "{%- else -%}<|im_system|>{%- endif -%}"
    "{{ m.get('name') or m.role }}<|im_middle|>"
    "{%- endmacro -%}"
    "{%- macro calls(m) -%}"
    "<|tool_calls_section_begin|>"
    "{%- for tc in m.tool_calls -%}"
    "<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>"
    "{%- if tc.function.arguments is string -%}{{ tc.function.arguments }}"
    "{%- else -%}{{ tc.function.arguments | tojson }}{%- endif -%}"
    "<|tool_call_end|>"
    "{%- endfor -%}"
    "<|tool_calls_section_end|>"
    "{%- endmacro -%}"
    # index of the last assistant turn without tool calls: it and everything before it is history
    "{%- set ns = namespace(last_plain=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and not m.get('tool_calls') -%}{%- set ns.last_plain = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- if not messages or messages[0].role != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{{- header(m) -}}"
    "{%- if m.role == 'assistant' -%}"
    "<think>"
    "{%- if loop.index0 > ns.last_plain -%}{{ m.get('reasoning_content') or m.get('reasoning') or '' }}{%- endif -%}"
    "</think>{{- text(m) -}}"
    "{%- if m.get('tool_calls') -%}{{- calls(m) -}}{%- endif -%}"
    "{%- elif m.role == 'tool' -%}"
    "{{ '## Return of ' ~ m.tool_call_id ~ '\\n' }}{{- text(m) -}}"
    "{%- else -%}{{- text(m) -}}"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "<|im_assistant|>assistant<|im_middle|><think>"
    "{%- if thinking is defined and not thinking -%}</think>{%- endif -%}"
    "{%- endif -%}"
)


# How an OpenAI-compatible server (`transformers serve`) splits a generated turn into reasoning and
# content, like SGLang's kimi_k2 reasoning parser. No stripping: the text must rebuild the exact ids.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_assistant|>assistant<|im_middle|>",
    "fields": {
        "reasoning_content": {
            "open": "<think>",
            "close": "</think>",
            "content": "text",
            "content_args": {"strip": False},
        },
        "content": {"close_pattern": r"<\|im_end\|>", "content": "text", "content_args": {"strip": False}},
    },
}


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 2048, model_max_length: int = 2048
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it with Kimi's special tokens and chat template."""
    tok = Tokenizer(models.BPE())
    # Split like cl100k/Kimi (a word keeps one leading non-letter: " close", "_close"), then byte level, so
    # any text (HumanEval prompts, unicode) encodes without an unknown token.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),  # added as special tokens: never split, one id each
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="[BOS]",
        eos_token=END_OF_TURN,  # ends every turn, so generation stops there (as with Kimi)
        unk_token="[UNK]",
        pad_token="[PAD]",
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    wrapped.response_template = RESPONSE_TEMPLATE  # saved into tokenizer_config.json
    return wrapped


def special_token_ids(tokenizer) -> dict[str, int]:
    """Each special token's id, read from the tokenizer; raises if one is not a single id."""
    ids = {}
    for t in SPECIAL_TOKENS:
        enc = tokenizer.encode(t, add_special_tokens=False)
        if len(enc) != 1:
            raise ValueError(f"special token {t!r} encodes to {len(enc)} ids {enc}, expected one")
        ids[t] = enc[0]
    return ids


def tokenizer_corpus(n_examples: int, seed: int, stdlib_chars: int = 0) -> Iterator[str]:
    """Texts to train the BPE on: task examples (plus, optionally, some Python standard library source)."""
    rng = random.Random(seed)
    for i in range(n_examples):
        ex = make_example(FAMILIES[i % len(FAMILIES)], rng)
        # Role names and system prompts appear in every rendered prompt: give them merges (few tokens each).
        yield rng.choice(("system", "user", "assistant", DEFAULT_SYSTEM_PROMPT) + SYSTEM_PROMPTS)
        yield ex.user
        yield ex.reasoning + " " + ex.answer
    if stdlib_chars > 0:
        # The stdlib is on every machine, offline; a little of it gives code-like merges beyond our word lists.
        left = stdlib_chars
        for path in sorted(Path(random.__file__).parent.glob("*.py")):
            text = path.read_text(encoding="utf-8", errors="ignore")[:left]
            left -= len(text)
            yield text
            if left <= 0:
                break


# A few alternative system prompts, so the model does not depend on the default one being present.
SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a careful assistant. Think step by step.",
    "You are a concise assistant.",
    "Answer the question after thinking.",
)


def example_messages(
    ex: TaskExample, rng: random.Random | None = None, *, system_prob: float = 0.0, history: Sequence[TaskExample] = ()
) -> list[dict]:
    """Chat messages that prompt ``ex``: optional system message, optional finished turns, the user turn."""
    messages: list[dict] = []
    if rng is not None and rng.random() < system_prob:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for h in history:
        messages.append({"role": "user", "content": h.user})
        messages.append({"role": "assistant", "content": h.answer, "reasoning_content": h.reasoning})
    messages.append({"role": "user", "content": ex.user})
    return messages


def completion_text(ex: TaskExample) -> str:
    """What the model samples after the prompt's `<think>`."""
    return f"{ex.reasoning}{THINK_END}{ex.answer}{END_OF_TURN}"


def encode_examples(
    tokenizer, examples: Sequence[TaskExample], messages: Sequence[list[dict]]
) -> list[tuple[list[int], int]]:
    """(ids, prompt_len) per example: rendered prompt with generation prompt, then
    reasoning + </think> + answer + <|im_end|>.

    Prompt and completion are encoded separately and concatenated; the prompt ends with the special
    `<think>`, and special tokens split pre-tokenization, so this equals encoding the whole text.
    """
    prompts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer([completion_text(ex) for ex in examples], add_special_tokens=False)["input_ids"]
    return [(p + c, len(p)) for p, c in zip(p_ids, c_ids)]
