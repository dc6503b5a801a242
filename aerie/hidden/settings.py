"""The hidden stage's settings (config ``hidden.*``, ``target.*`` for the load), resolved once by the plan
(aerie.plan.resolve.hidden_settings): torch-free, so parse time builds them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CaptureSettings:
    """How shards are captured, checked and stored (config ``hidden.*``; ``target.*`` for the load): what
    aerie.hidden.shard.capture_shard and aerie.hidden.run.capture_shards take."""

    aux_layer_ids: Sequence[int] | None  # None: the target's default ids (aerie.target_model.config)
    layout: str = "compact"  # checked by the schema, and again by the writer (aerie.formats.hidden)
    target_topk: int = 32
    backend: str = "hf"
    backend_options: dict[str, Any] | None = None  # hidden.sglang, for the sglang backend
    batch_tokens: int = 8192
    storage_dtype: str = "bfloat16"
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    threads: int | None = None
    min_next_token_agreement: float = 0.0
    min_next_token_in_topk: float = 0.0
