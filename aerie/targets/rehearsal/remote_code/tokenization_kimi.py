"""The rehearsal target's tokenizer: tiktoken BPE + Kimi's special tokens, loaded with trust_remote_code.

Shaped like Kimi K2.5's ``tokenization_kimi.py``: a slow (Python) transformers tokenizer over a tiktoken
``Encoding`` read from ``tiktoken.model`` (one ``base64(token bytes) rank`` line per token), a fixed
pre-tokenizer regex, special tokens from ``tokenizer_config.json`` ``added_tokens_decoder`` at Kimi's ids
(163584 and up), and an ``apply_chat_template`` that renders tool declarations TypeScript-style into the
template variable ``tools_ts_str`` (what K2.5's template prefers over ``tools | tojson``).

The BPE ranks are fewer than Kimi's 163,584: ids between the last rank and the first special token are never
produced. ``vocab_size`` and ``len()`` are the whole id space (163,840 for the rehearsal), as for Kimi.
Written for aerie; it imports only tiktoken and transformers, so it runs wherever the folder is loaded.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}

# Pre-tokenization (tiktoken's fancy-regex syntax): CJK runs; a word with at most one leading non-letter and
# an optional English contraction; numbers in groups of up to three digits; punctuation runs (with a
# leading space and trailing newlines); newline runs; trailing spaces; other whitespace.
PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?\p{L}+(?:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


def _bytes_to_unicode() -> dict[int, str]:
    """The usual reversible byte -> printable character map, so tokens can be dictionary keys (get_vocab)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        bos_token: str = "[BOS]",
        eos_token: str = "[EOS]",
        unk_token: str = "[UNK]",
        pad_token: str = "[PAD]",
        added_tokens_decoder: dict | None = None,
        **kwargs: Any,
    ):
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        specials = {str(tok): int(i) for i, tok in (added_tokens_decoder or {}).items()}
        self.num_base_tokens = len(ranks)
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise ValueError(f"{vocab_file}: BPE ranks must be 0..{len(ranks) - 1} without gaps")
        clash = [t for t, i in specials.items() if i < len(ranks)]
        if clash:
            raise ValueError(f"special tokens {clash[:5]} have ids inside the BPE ranks (< {len(ranks)})")
        self.model = tiktoken.Encoding(
            name=os.path.basename(vocab_file), pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials
        )
        self.n_ids = max([*specials.values(), len(ranks) - 1]) + 1
        self.encoder = {"".join(BYTE_TO_CHAR[b] for b in tok): rank for tok, rank in ranks.items()}
        self.decoder = {rank: tok for tok, rank in self.encoder.items()}
        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            added_tokens_decoder=added_tokens_decoder or {},
            **kwargs,
        )

    # ---- vocabulary ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.n_ids

    def __len__(self) -> int:
        return self.n_ids

    def get_vocab(self) -> dict[str, int]:
        return {**self.encoder, **self._added_tokens_encoder}

    # ---- encoding / decoding ---------------------------------------------------------------------
    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        # Special tokens were split off before this is called; what is left is ordinary text.
        return [self.decoder[i] for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.unk_token_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder.get(index, self.unk_token)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out, pending = [], bytearray()
        for token in tokens:
            if token in self._added_tokens_encoder:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
                out.append(token)
            else:
                pending.extend(CHAR_TO_BYTE[c] for c in token)
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        out = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            shutil.copyfile(self.vocab_file, out)
        return (out,)

    # ---- chat template ---------------------------------------------------------------------------
    def apply_chat_template(self, conversation, tools: list[dict] | None = None, **kwargs: Any):
        """Render with the folder's template, passing the tools also as a TypeScript-style declaration."""
        if tools:
            kwargs["tools_ts_str"] = tools_to_typescript(tools)
        return super().apply_chat_template(conversation, tools=tools, **kwargs)


# ---- TypeScript-style tool declarations (K2.5 declares tools as a TypeScript namespace) -----------------

_TS_TYPES = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "null": "null"}


def _ts_type(schema: Any, indent: str) -> str:
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"]) or "any"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(_ts_type(s, indent) for s in schema[key]) or "any"
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_ts_type({**schema, "type": k}, indent) for k in kind) or "any"
    if kind == "array":
        return f"Array<{_ts_type(schema.get('items'), indent)}>"
    if kind == "object" and isinstance(schema.get("properties"), dict):
        return _ts_object(schema, indent)
    return _TS_TYPES.get(kind, "any")


def _ts_object(schema: dict, indent: str) -> str:
    required = set(schema.get("required") or [])
    inner = indent + "  "
    lines = ["{"]
    for name, prop in schema["properties"].items():
        if isinstance(prop, dict) and prop.get("description"):
            lines += [f"{inner}// {line}" for line in str(prop["description"]).splitlines()]
        optional = "" if name in required else "?"
        default = f" // default: {json.dumps(prop['default'])}" if isinstance(prop, dict) and "default" in prop else ""
        lines.append(f"{inner}{name}{optional}: {_ts_type(prop, inner)},{default}")
    lines.append(indent + "}")
    return "\n".join(lines)


def tools_to_typescript(tools: list[dict]) -> str:
    """OpenAI-format tool list -> ``namespace functions { type name = (_: {...}) => any; }``."""
    out = ["# Tools", "", "## functions", "namespace functions {"]
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if not isinstance(fn, dict) or not fn.get("name"):
            continue
        if fn.get("description"):
            out += [f"// {line}" for line in str(fn["description"]).splitlines()]
        params = fn.get("parameters") or {}
        args = _ts_object(params, "") if isinstance(params.get("properties"), dict) and params["properties"] else "{}"
        out.append(f"type {fn['name']} = (_: {args}) => any;")
    out.append("} // namespace functions")
    return "\n".join(out)
