"""What a drafter kind is: the interface every kind package implements (torch-free), and the torch side it hands
the training loop and the benchmark.

A kind is one package of ``aerie.drafter_kinds`` whose ``__init__`` defines ``KIND``, an instance of a
``DrafterKind`` subclass; ``aerie.drafter_kinds.kind_named`` finds it by the config's ``drafter.kind``, as SGLang
finds a model class by its ``EntryClass``. Nothing outside a kind's package compares kind names.

Two halves, so that parse time never imports torch:
- the ``DrafterKind`` methods (torch-free): the kind's settings (its own ``drafter.*`` keys), the drafter's shape
  for a target, the target layers it reads, what the hidden shards must hold, memory and time estimates, its
  SGLang server flags, reading and checking a folder of its kind;
- ``DrafterKind.torch_side()`` (the one import boundary: the kind's ``training`` module, torch): a new drafter,
  a warm start from a folder, the training objective on a batch, the held-out evaluation, the export, loading a
  folder for the benchmark, in-process drafting (a ``aerie.benchmark.speculative.Proposer``).
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, Protocol

GIB = 1024**3
# What a kind's held-out evaluation returns when nothing is held out (eval.json's keys, every kind's).
EMPTY_EVAL = {
    "simulated_acceptance_length": None,
    "acceptance_per_position": [],
    "simulated_acceptance_length_by_steps": [],
    "heldout_loss": None,
    "heldout_loss_per_step": [],
    "heldout_accuracy_per_step": [],
    "heldout_start_positions": 0,
}


class TrainingSettings(Protocol):
    """What a kind reads of the settings every kind trains with (aerie.drafter.config.TrainConfig), its own included
    (``kind_settings``)."""

    max_seq_len: int
    batch_size: int
    packing: bool
    device: str
    seed: int
    kind_settings: Any

    @property
    def largest_batch_tokens(self) -> int: ...


@dataclass
class TrainingMemory:
    """Estimated peak bytes of one training process on one GPU (or the CPU), by part."""

    parts: dict[str, int]
    batch_tokens: int  # padded tokens of the largest batch the settings allow
    window: int  # rows of the longest window
    activation_bytes: int  # 2 (bf16 autocast on a GPU) or 4 (fp32 on the CPU)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = ", ".join(f"{name} {size / GIB:.1f}" for name, size in self.parts.items() if size >= GIB / 20)
        dtype = "bf16" if self.activation_bytes == 2 else "fp32"
        return (
            f"drafter training: {self.total / GIB:.1f} GiB per GPU at {self.batch_tokens} tokens per batch "
            f"(windows of {self.window}, {dtype} activations; GiB: {parts})"
        )


@dataclass(frozen=True)
class TargetView:
    """What a kind may know of the target at parse time: its text config (config.json's text part) and its
    architectures (aerie.targets.planned_target)."""

    text_config: Mapping[str, Any]
    architectures: tuple[str, ...] = ()

    @property
    def num_hidden_layers(self) -> int:
        return int(self.text_config["num_hidden_layers"])

    @property
    def vocab_size(self) -> int:
        return int(self.text_config["vocab_size"])

    @property
    def hidden_size(self) -> int:
        return int(self.text_config["hidden_size"])


@dataclass
class HostMemory:
    """Host RAM the drafter job needs at its peak, all ranks together (bytes)."""

    parts: dict[str, int]
    ranks: int

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = ", ".join(f"{name} {size / GIB:,.1f}" for name, size in self.parts.items())
        return (
            f"host RAM ~{self.total / GIB:,.1f} GiB for {self.ranks} rank{'s' if self.ranks != 1 else ''} ({parts} GiB)"
        )


class DrafterKind(abc.ABC):
    """One drafter kind. Subclasses set the class attributes and implement the methods; ``KIND`` is the instance."""

    name: ClassVar[str]  # drafter.kind
    description: ClassVar[str]  # one line for previews, reports and model cards
    sglang_algorithm: ClassVar[str]  # --speculative-algorithm
    architectures: ClassVar[tuple[str, ...]]  # config.json "architectures" of its folders (what SGLang loads)
    settings_class: ClassVar[type]  # frozen dataclass of the kind's own drafter.* keys
    needs_draft_vocab: ClassVar[bool]  # trains a draft-vocabulary head (the draft_vocab rule's file)
    needs_target_distribution: ClassVar[bool]  # reads the target's next-token distribution from the hidden shards
    copies_target_embeddings: ClassVar[bool]  # holds its own copy of the target's embeddings in process (the bench)

    # -- settings ----------------------------------------------------------------------------------------------

    def setting_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.settings_class))

    def settings(self, values: Mapping[str, Any]) -> Any:
        """The kind's settings from its ``drafter.*`` keys (ValueError naming the key when one is refused)."""
        return self.settings_class(**values)

    # -- what it trains on ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def capture_layer_ids(
        self, settings: Any, target: TargetView, configured_aux_layer_ids: Sequence[int] | None
    ) -> list[int]:
        """The target layers (aerie's convention: the output of decoder layer i) whose states the drafter reads,
        in the order it concatenates them. ``configured_aux_layer_ids``: ``hidden.aux_layer_ids``."""

    @abc.abstractmethod
    def lookahead(self, settings: Any) -> int:
        """Rows past a training window's end whose tokens (and targets) a batch reads."""

    @abc.abstractmethod
    def shape(self, settings: Any, target: TargetView, draft_vocab_size: int, layer_ids: Sequence[int]) -> Any:
        """The drafter's shape (torch-free) for this target, as training builds it."""

    # -- estimates -----------------------------------------------------------------------------------------

    @abc.abstractmethod
    def trainable_parameters(self, shape: Any) -> int: ...

    @abc.abstractmethod
    def serving_weight_bytes(self, shape: Any, bytes_per_value: int) -> int:
        """Bytes of the drafter's own weights as a server holds them (no shared target embeddings or head)."""

    @abc.abstractmethod
    def training_memory(self, shape: Any, settings: Any, train: Any, *, on_gpu: bool, hidden: Mapping) -> Any:
        """Peak bytes of one training process (``TrainingMemory``); ``train``: the generic TrainConfig, ``hidden``:
        the config's hidden section (its layout says what the shards hold)."""

    @abc.abstractmethod
    def train_flops_per_token(self, shape: Any, settings: Any, train: Any) -> float:
        """Forward + backward FLOPs per training token (the time preview's unit of work)."""

    # -- serving ---------------------------------------------------------------------------------------------

    @abc.abstractmethod
    def draft_tokens(self, settings_or_shape: Any, num_draft_steps: int) -> int:
        """Tokens the drafter proposes per verify step in the benchmark (``bench.num_draft_steps`` for chains)."""

    @abc.abstractmethod
    def sglang_flags(self, folder: str | Path, config: Mapping[str, Any], sglang: Mapping[str, Any]) -> list[str]:
        """SGLang 0.5.23's ``launch_server`` flags that serve the drafter folder (its config.json ``config``)."""

    # -- folders ---------------------------------------------------------------------------------------------

    @abc.abstractmethod
    def describe_folder(self, config: Mapping[str, Any]) -> str:
        """One line on a folder of this kind from its config.json (its shape, for previews and cards)."""

    def settings_from_folder(self, settings: Any, folder: Path) -> Any:
        """The settings a warm start from ``folder`` trains with: those left derived take the folder's values
        (by default the settings as they are; the folder is checked against them by ``check_init_folder``)."""
        return settings

    # -- the torch side ----------------------------------------------------------------------------------------

    def torch_side(self) -> ModuleType:
        """The kind's ``training`` module (imports torch): build, warm start, objective, evaluate, export, load,
        drafting. The one place a kind crosses from parse-time code to torch."""
        return importlib.import_module(f"{type(self).__module__}.training")
