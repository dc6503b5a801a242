"""Build the rehearsal target's tokenizer files: a tiktoken BPE trained here, Kimi's special tokens at Kimi's ids.

Output (in the target folder), the way Kimi K2.5 ships its tokenizer:
- ``tiktoken.model``: ``base64(token bytes) rank`` lines; ranks 0..N-1 of a byte-level BPE trained offline
  on the demo's task language (plus role names and system prompts);
- ``tokenization_kimi.py``: the ``TikTokenTokenizer`` class (``aerie.targets.rehearsal.remote_code``);
- ``tokenizer_config.json``: ``auto_map`` -> that class, ``added_tokens_decoder`` with all 256 special ids
  163584..163839 (Kimi's named ones at Kimi's ids, ``<|reserved_token_N|>`` elsewhere), the response
  template ``transformers serve`` uses to split reasoning from content;
- ``chat_template.jinja``: the K2.5-style template (``aerie.targets.rehearsal.chat_template``).

Why fewer BPE ranks than Kimi's 163,584: a task language yields a few thousand useful merges, and a model
pre-trained for minutes cannot learn embeddings for more. The id space is still Kimi's (163,840): ids
between the last rank and 163584 exist in the model's matrices but the tokenizer never produces them.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from aerie.targets.demo.tokenizer import RESPONSE_TEMPLATE
from aerie.targets.rehearsal import remote_code
from aerie.targets.rehearsal.chat_template import CHAT_TEMPLATE
from aerie.targets.rehearsal.config import VOCAB_SIZE
from aerie.targets.rehearsal.remote_code.tokenization_kimi import CHAR_TO_BYTE, PAT_STR

SPECIAL_TOKENS_START = 163_584  # Kimi's first special id ([BOS]); 256 special ids follow

# Kimi K2.5's special tokens at the ids reported for it (shared/notes/kimi-k2.5.md). The media tokens are
# used by the template for image parts; their ids are placed after <|im_middle|> and are NOT verified
# against the real tokenizer (text-only rehearsal).
KIMI_SPECIAL_TOKEN_IDS: dict[str, int] = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|im_end|>": 163586,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "[EOT]": 163593,
    "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601,
    "<|media_start|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
    "<think>": 163606,
    "</think>": 163607,
    "[UNK]": 163838,
    "[PAD]": 163839,
}
REMOTE_TOKENIZER_FILE = "tokenization_kimi.py"


def special_tokens_table() -> dict[int, str]:
    """All 256 special ids: Kimi's named tokens, ``<|reserved_token_N|>`` for the rest (as Kimi fills them)."""
    named = {i: t for t, i in KIMI_SPECIAL_TOKEN_IDS.items()}
    return {
        i: named.get(i, f"<|reserved_token_{i - SPECIAL_TOKENS_START}|>")
        for i in range(SPECIAL_TOKENS_START, VOCAB_SIZE)
    }


def train_bpe_ranks(texts: Iterable[str], n_ranks: int) -> dict[bytes, int]:
    """Byte-level BPE with up to ``n_ranks`` tokens (256 bytes + merges), pre-tokenized by tiktoken's pattern.

    Trained with the ``tokenizers`` library (fast, deterministic); ranks follow merge order, so tiktoken's
    rank-greedy merging reproduces the trained segmentation.
    """
    if n_ranks < 256:
        raise ValueError(f"target.rehearsal.bpe_ranks {n_ranks}: a byte-level BPE needs at least the 256 bytes")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=n_ranks, min_frequency=2, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    by_id = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return {bytes(CHAR_TO_BYTE[c] for c in token): rank for rank, (token, _) in enumerate(by_id)}


def write_tiktoken_model(ranks: dict[bytes, int], path: Path) -> None:
    lines = [f"{base64.b64encode(tok).decode()} {rank}\n" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    path.write_text("".join(lines), encoding="utf-8")


def write_tokenizer(out_dir: Path, ranks: dict[bytes, int], model_max_length: int):
    """Write the tokenizer files into ``out_dir`` and load them back the way a user does (trust_remote_code)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tiktoken_model(ranks, out_dir / "tiktoken.model")
    shutil.copyfile(Path(remote_code.__file__).parent / REMOTE_TOKENIZER_FILE, out_dir / REMOTE_TOKENIZER_FILE)
    decoder = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in special_tokens_table().items()
    }
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": [f"{REMOTE_TOKENIZER_FILE[:-3]}.TikTokenTokenizer", None]},
        "added_tokens_decoder": decoder,
        "bos_token": "[BOS]",
        # As Kimi's: eos is [EOS]; the turn end <|im_end|> stops generation through generation_config.json.
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "response_template": RESPONSE_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}, indent=2)
        + "\n"
    )
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir), trust_remote_code=True)
    check_tokenizer(tokenizer)
    return tokenizer


def check_tokenizer(tokenizer) -> None:
    """Every named Kimi token is one id at Kimi's id, the id space is Kimi's, and text round-trips."""
    wrong = {
        t: tokenizer.encode(t, add_special_tokens=False)
        for t, i in KIMI_SPECIAL_TOKEN_IDS.items()
        if tokenizer.encode(t, add_special_tokens=False) != [i]
    }
    if wrong:
        raise ValueError(f"special tokens not at Kimi's ids: {wrong}")
    if len(tokenizer) != VOCAB_SIZE:
        raise ValueError(f"tokenizer id space is {len(tokenizer)}, expected Kimi's {VOCAB_SIZE}")
    probe = "Sort [3, 1, 2].<|im_end|> héllo 世界 def f(x): return x"
    if tokenizer.decode(tokenizer.encode(probe, add_special_tokens=False)) != probe:
        raise ValueError("the tokenizer does not round-trip text")
