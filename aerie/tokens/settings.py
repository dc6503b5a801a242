"""The tokens stage's settings (config ``tokens.*``; ``target.trust_remote_code`` for the tokenizer), resolved once by
the plan (aerie.plan.resolve.token_settings): torch-free, so parse time builds them."""

from __future__ import annotations

from dataclasses import dataclass

SPECIAL_TOKEN_TEXT_POLICIES = ("keep", "plain", "drop")


@dataclass(frozen=True)
class TokenSettings:
    """How a responses shard becomes token ids and loss masks (docs/formats.md, config/README.md ``tokens``): what
    aerie.tokens.stage.tokenize_shard takes."""

    max_seq_len: int
    overlong: str = "truncate"  # truncate | drop a sample longer than max_seq_len
    drop_truncated: bool = True  # finish_reason length
    drop_filtered: bool = True  # finish_reason content_filter / error
    drop_degenerate: bool = True  # answers the degenerate-output detector flags (loops)
    special_token_text: str = "keep"  # keep | plain | drop: special-token text written inside reasoning/content
    max_dropped_fraction: float = 0.25  # more dropped beyond chance fails the shard (nothing written)
    keep_missing_reasoning: bool = False  # keep text-only answers whose requested reasoning is missing
    trust_remote_code: bool = False  # target.trust_remote_code, for the tokenizer

    def __post_init__(self) -> None:
        if self.special_token_text not in SPECIAL_TOKEN_TEXT_POLICIES:
            raise ValueError(
                f"tokens.special_token_text must be one of {', '.join(SPECIAL_TOKEN_TEXT_POLICIES)}, not "
                f"{self.special_token_text!r}"
            )
        if self.overlong not in ("truncate", "drop"):
            raise ValueError(f"tokens.overlong must be truncate or drop, not {self.overlong!r}")
        if self.max_seq_len < 2:
            raise ValueError(f"tokens.max_seq_len must be at least 2, not {self.max_seq_len}")
