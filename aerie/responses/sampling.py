"""How the in-process backend samples a dataset's answers (config ``responses.*``, merged per dataset), resolved once
by the plan (aerie.plan.resolve.sampling_settings): torch-free, so parse time builds it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Sampling:
    """One dataset's sampling for ``responses.backend: hf`` (what aerie.responses.in_process generates with)."""

    temperature: float
    top_p: float
    max_new_tokens: int
    batch_size: int  # prompts generated together (left-padded)
    seed: int  # sampling is seeded per batch from it and the batch's offset: a shard's bytes are its own

    @classmethod
    def of(cls, responses: Mapping[str, Any]) -> Sampling:
        """From a dataset's merged ``responses`` section (its other keys are the API's)."""
        return cls(**{f.name: responses[f.name] for f in fields(cls)})
