"""The ``vocab`` section resolved once (torch-free: parse time checks it): the draft vocabulary's size and what a
warm start (``drafter.init``) does with the folder's own vocabulary.

``warm_start``: ``keep`` the folder's ids as they are; ``follow`` the data - keep the folder's ids the run's data
uses and replace the ones it never uses by the most frequent ids the folder lacks (aerie.vocab.draft_vocab
``follow_data``; each new id's lm_head row is the target's lm_head row of that token); ``auto`` follows only when
the folder's ids cover less than ``follow_below`` of the data's generated tokens.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WARM_START_VOCAB = ("keep", "follow", "auto")


@dataclass(frozen=True)
class VocabSettings:
    draft_vocab_size: int = 32000  # capped at the target vocabulary
    warm_start: str = "keep"  # keep | follow | auto: what a warm start does with drafter.init's draft vocabulary
    follow_below: float = 0.98  # auto: follow the data when the folder's ids cover less of it than this

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 1:
            raise ValueError(f"vocab.draft_vocab_size must be at least 1, not {self.draft_vocab_size}")
        if self.warm_start not in WARM_START_VOCAB:
            raise ValueError(
                f"vocab.warm_start must be one of {', '.join(WARM_START_VOCAB)}, not {self.warm_start!r}"
                + (" (YAML reads unquoted on/off as booleans)" if isinstance(self.warm_start, bool) else "")
            )
        if not 0.0 <= self.follow_below <= 1.0:
            raise ValueError(f"vocab.follow_below is a coverage in [0, 1], not {self.follow_below}")

    @classmethod
    def of(cls, section: Mapping[str, Any] | None) -> VocabSettings:
        values = dict(section or {})
        unknown = sorted(set(values) - {"draft_vocab_size", "warm_start", "follow_below"})
        if unknown:
            raise ValueError(f"vocab.{unknown[0]} is not a setting (vocab: draft_vocab_size, warm_start, follow_below)")
        return cls(**values)

    def follows(self, coverage: float) -> bool:
        """Whether a warm start with a folder vocabulary of this coverage follows the data."""
        return self.warm_start == "follow" or (self.warm_start == "auto" and coverage < self.follow_below)

    def describe(self) -> str:
        if self.warm_start == "keep":
            return "a warm start keeps drafter.init's draft vocabulary (vocab.warm_start: keep)"
        when = (
            "always" if self.warm_start == "follow" else f"when its coverage of the data is below {self.follow_below}"
        )
        return (
            f"a warm start's draft vocabulary follows the data {when} (vocab.warm_start: {self.warm_start}): the "
            "folder's ids the data never uses are replaced by the most frequent ids it lacks, each new lm_head row "
            "the target's lm_head row of that token"
        )


def read_vocab_meta(path: str | Path) -> dict[str, Any] | None:
    """A draft-vocab file's metadata (aerie.formats.vocab), read from its safetensors header without torch (the
    dry run shows a warm start's coverage before and after following the data); None when the file is absent."""
    path = Path(path)
    if not path.exists():
        return None
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    meta = {}
    for key, value in (header.get("__metadata__") or {}).items():
        try:
            meta[key] = json.loads(value)
        except ValueError:
            meta[key] = value
    return meta


def vocab_preview_line(settings: VocabSettings, meta: Mapping[str, Any] | None) -> str:
    """The dry run's line on a warm start's draft vocabulary: the rule, and (once the draft_vocab rule has run)
    the coverage of the data before and after."""
    line = "draft vocab: " + settings.describe()
    if not meta or not str(meta.get("source", "")).startswith("drafter.init"):
        return line + " (coverage: once the draft_vocab rule has counted the data)"
    if "coverage_before" in meta:
        return line + (
            f"; last counted: coverage {meta['coverage_before']:.4f} -> {meta['coverage']:.4f} ({meta.get('replaced')} "
            f"ids replaced; counting would reach {meta.get('coverage_if_counted', 0):.4f})"
        )
    return line + (
        f"; last counted: the folder's ids cover {meta.get('coverage', 0):.4f} of the data (counting would reach "
        f"{meta.get('coverage_if_counted', 0):.4f}), kept"
    )
