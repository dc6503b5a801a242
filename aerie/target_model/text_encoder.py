"""Text -> token ids with the target's added tokens matched as single ids, or as plain text on request.

One job: encoding the template's text exactly, whatever state earlier transformers calls left on the
tokenizer (``TextEncoder``). The tokens stage encodes every turn through it, a chunk of texts at a time
(``encode_many`` in a worker thread, then ``remember``) so that encoding runs beside the template renders.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tokenizers import Tokenizer


class TextEncoder:
    """Text -> ids with every added token matched as one id (``encode``) or as plain text (``encode_plain``).

    Independent of transformers' per-call state: a fast tokenizer's Rust backend is used directly only when
    nothing is set on it (``split_special_tokens`` leaves ``encode_special_tokens``, and truncation or
    padding from earlier calls); otherwise a private copy with those cleared is used. Slow tokenizers
    (Kimi's tiktoken-based one) go through ``encode`` with the flag passed explicitly on every call.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self.fast = backend is not None
        self._plain = None
        if self.fast:
            clean = (
                not getattr(backend, "encode_special_tokens", False)
                and backend.truncation is None
                and backend.padding is None
            )
            if clean:
                self._special = backend
            else:
                self._special = Tokenizer.from_str(backend.to_str())
                self._special.no_truncation()
                self._special.no_padding()
                self._special.encode_special_tokens = False
            self._backend = backend
        self.special_ids = frozenset(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self._known: dict[str, list[int]] = {}

    def encode_many(self, texts: Iterable[str]) -> dict[str, list[int]]:
        """Ids of each distinct text, for ``remember``. Safe to call from a worker thread: a fast backend
        encodes the batch on its own thread pool (``RAYON_NUM_THREADS``, default every core) with the GIL
        released, so the caller's thread keeps rendering meanwhile. Slow tokenizers: {} (``encode`` does the
        work when asked, on the caller's thread)."""
        if not self.fast:
            return {}
        distinct = list(dict.fromkeys(t for t in texts if t))
        if not distinct:
            return {}
        batch = getattr(self._special, "encode_batch_fast", None) or self._special.encode_batch  # no offsets: less work
        return {t: e.ids for t, e in zip(distinct, batch(distinct, add_special_tokens=False))}

    def remember(self, encoded: dict[str, list[int]]) -> None:
        """``encode`` answers these texts from ``encoded`` (an ``encode_many`` result) until the next call;
        ``remember({})`` forgets them. The returned lists are shared: callers must not modify them."""
        self._known = encoded

    def _plain_backend(self):
        """A copy of the backend that matches no added token (built on first use: only the ``plain`` policy
        needs it). ``encode_special_tokens`` would not do: it only splits tokens flagged special, and
        DeepSeek's ``<think>`` is an added token that is not."""
        if self._plain is None:
            bare = json.loads(self._backend.to_str())
            bare["added_tokens"] = []
            self._plain = Tokenizer.from_str(json.dumps(bare))
            self._plain.no_truncation()
            self._plain.no_padding()
        return self._plain

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        known = self._known.get(text)
        if known is not None:
            return known
        if self.fast:
            return self._special.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=False))

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
        """(ids, character offsets of each id) - offsets None for slow tokenizers."""
        if not text:
            return [], []
        if self.fast:
            enc = self._special.encode(text, add_special_tokens=False)
            return enc.ids, enc.offsets
        return self.encode(text), None

    def encode_plain(self, text: str) -> list[int]:
        """Ids of ``text`` with special-token text encoded as ordinary pieces."""
        if not text:
            return []
        if self.fast:
            return self._plain_backend().encode(text, add_special_tokens=False).ids
        # Slow tokenizers: split_special_tokens covers the tokens flagged special.
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
