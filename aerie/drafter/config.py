"""The drafter's training settings (the config's ``drafter`` section): torch-free, so parse time can check them.

One flat section, two owners: the keys every kind trains with (``TrainConfig``'s own fields: the schedule, the
batches, the held-out split, resume, warm start ...) and the keys of the chosen kind (``drafter.kind``: its
package's settings class, e.g. EAGLE-3's ``ttt_steps`` or DFlash's ``block_size``), resolved once into
``TrainConfig.kind_settings``. A key of another kind is refused by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aerie.drafter_kinds import DEFAULT_KIND, kind_named
from aerie.drafter_kinds.kind import DrafterKind

LR_SCHEDULES = ("cosine", "constant")


@dataclass(frozen=True)
class TrainConfig:
    kind: str = DEFAULT_KIND  # the drafter kind (aerie.drafter_kinds): eagle3 or dflash
    epochs: int = 2  # passes over the training windows; the best epoch (held-out acceptance) is exported
    learning_rate: float = 1e-4  # peak AdamW learning rate (write 0.0001 or 1.0e-4 in YAML: 1e-4 is a string)
    weight_decay: float = 0.0  # applied to matrices only, never to norms
    warmup_ratio: float = 0.03  # share of the optimizer steps with a linear warmup
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    grad_clip: float = 0.5  # gradient norm clip (0 = none)
    max_seq_len: int = 2048  # longer sequences are cut into windows of this many rows
    batch_size: int = 4  # windows per optimizer step (per process under torchrun)
    max_batch_tokens: int = 0  # cap on a batch's padded tokens (rows x longest); 0 = batch_size * max_seq_len
    packing: bool = True  # several windows share a batch row of max_seq_len (false: one window per row, padded)
    eval_fraction: float = 0.05  # held-out share of sequences, chosen by hashing sample ids
    seed: int = 0  # drafter init, held-out split and batch order
    threads: int = 0  # torch CPU threads (0 = leave as is)
    log_every: int = 10  # optimizer steps between train_log.jsonl lines
    checkpoint_every: int = 500  # optimizer steps between resumable training states (0 = after epochs only)
    resume: bool = True  # continue from a compatible training state beside out_dir; false = start over
    device: str = "auto"  # auto (CUDA when visible), cpu or cuda
    tensorboard: bool = True  # TensorBoard event files of the training curves (the drafter folder's tensorboard/)
    wandb_project: str = ""  # also log the curves to this Weights & Biases project (needs the wandb package)
    # warm start (aerie.drafter.warm_start): a drafter folder of the same kind, local or a Hub id in the HF cache
    init: str = ""  # "" = train from scratch; else start from every tensor of this folder
    init_pull: float = 0.0  # L2-SP toward the start weights, decoupled: each step w -= lr * init_pull * (w - w_start)
    lr_schedule: str = "cosine"  # after the warmup: cosine to learning_rate * min_lr_ratio, or constant
    # against forgetting (aerie.drafter.loop): general data of the config mixed into every epoch
    replay_dataset: str = ""  # a dataset of the config (e.g. kimi_mtp): trained on at replay_share, held out always
    replay_share: float = 0.0  # share of each epoch's training windows drawn from replay_dataset (0: held out only)
    # the epoch choice's figure (aerie.drafter.traffic): dataset -> weight, the plan's mapping of bench.traffic;
    # empty = every held-out window pooled
    heldout_weights: tuple[tuple[str, float], ...] = ()  # written as a mapping; kept as sorted (dataset, weight)
    # the kind's own keys, resolved by its package (TrainConfig.of splits a flat section)
    kind_settings: Any = field(default=None, compare=True)

    def __post_init__(self) -> None:
        if self.kind_settings is None:
            object.__setattr__(self, "kind_settings", self.drafter_kind.settings({}))
        for name in ("epochs", "batch_size", "max_seq_len", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"drafter.{name} must be at least 1, not {getattr(self, name)}")
        if self.max_batch_tokens < 0:
            raise ValueError(f"drafter.max_batch_tokens must be >= 0 (0 = no cap), not {self.max_batch_tokens}")
        if 0 < self.max_batch_tokens < self.max_seq_len:
            raise ValueError(
                f"drafter.max_batch_tokens ({self.max_batch_tokens}) is below drafter.max_seq_len "
                f"({self.max_seq_len}): one window of max_seq_len rows would not fit a batch; raise max_batch_tokens "
                "or lower max_seq_len"
            )
        if self.checkpoint_every < 0:
            raise ValueError(f"drafter.checkpoint_every must be >= 0, not {self.checkpoint_every}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"drafter.lr_schedule must be one of {', '.join(LR_SCHEDULES)}, not {self.lr_schedule!r}")
        if self.init_pull < 0:
            raise ValueError(f"drafter.init_pull must be >= 0 (0 = no pull), not {self.init_pull}")
        if not 0.0 <= self.replay_share < 1.0:
            raise ValueError(f"drafter.replay_share must be in [0, 1) (a share of each epoch), not {self.replay_share}")
        if self.replay_share and not self.replay_dataset:
            raise ValueError("drafter.replay_share mixes in drafter.replay_dataset, which is not set")
        object.__setattr__(self, "heldout_weights", _weights_of(self.heldout_weights))
        if self.init_pull and not self.init:
            raise ValueError("drafter.init_pull pulls toward the start weights of drafter.init, which is not set")

    @classmethod
    def of(cls, values: Mapping[str, Any] | None = None, **more: Any) -> TrainConfig:
        """The settings of a flat ``drafter`` section (plus ``more``): the kind's keys go to its settings class, the
        rest to TrainConfig; a key neither knows is refused naming it and the kind."""
        values = {**(values or {}), **more}
        kind = kind_named(values.get("kind"))
        generic = {f.name for f in dataclasses.fields(cls)} - {"kind_settings"}
        own = set(kind.setting_names())
        unknown = sorted(set(values) - generic - own)
        if unknown:
            raise ValueError(
                f"drafter.{unknown[0]} is not a setting of drafter.kind {kind.name} (its keys: "
                f"{', '.join(sorted(own))}; every kind's: {', '.join(sorted(generic))})"
            )
        kind_settings = kind.settings({k: v for k, v in values.items() if k in own})
        return cls(**{k: v for k, v in values.items() if k in generic}, kind_settings=kind_settings)

    def section(self) -> dict[str, Any]:
        """The flat ``drafter`` section these settings came from (JSON-ready: torchrun's --config, the export's
        facts, the training state's compatibility check)."""
        generic = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "kind_settings"}
        return {**generic, **dataclasses.asdict(self.kind_settings)}

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some keys of the flat section changed (generic or the kind's)."""
        return TrainConfig.of({**self.section(), **changes})

    def __getattr__(self, name: str) -> Any:
        """The kind's keys read as the flat section's (``cfg.ttt_steps``), as the YAML writes them."""
        if name.startswith("__") or name == "kind_settings":
            raise AttributeError(name)
        settings = self.__dict__.get("kind_settings")
        if settings is not None and hasattr(settings, name):
            return getattr(settings, name)
        raise AttributeError(f"drafter.{name} is not a setting of drafter.kind {self.__dict__.get('kind')}")

    @property
    def drafter_kind(self) -> DrafterKind:
        return kind_named(self.kind)

    @property
    def largest_batch_tokens(self) -> int:
        """The most padded tokens (windows x rows) one batch can hold under these settings."""
        cap = self.batch_size * self.max_seq_len
        return min(cap, self.max_batch_tokens) if self.max_batch_tokens else cap


def _weights_of(value: Any) -> tuple[tuple[str, float], ...]:
    """drafter.heldout_weights as sorted (dataset, weight) pairs (hashable, JSON as a list), from a mapping or
    pairs; refused naming the key unless every weight is a number >= 0."""
    pairs = list(value.items()) if isinstance(value, Mapping) else [tuple(p) for p in (value or ())]
    out = []
    for name, weight in pairs:
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
            raise ValueError(f"drafter.heldout_weights.{name}: a weight is a number >= 0, not {weight!r}")
        out.append((str(name), float(weight)))
    return tuple(sorted(out))


# Settings a resumed run may change: they do not alter what is computed (a kind adds its own: attention_kernel).
RESUME_MAY_CHANGE = (
    "threads",
    "log_every",
    "checkpoint_every",
    "resume",
    "device",
    "tensorboard",
    "wandb_project",
    "attention_kernel",
)
