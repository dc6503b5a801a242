"""EAGLE-3 as SGLang 0.5.23 serves it (``--speculative-algorithm EAGLE3``): one decoder layer fed the target's aux
layers through ``fc``, drafting a chain one token per forward, trained with the training-time test (TTT) against the
target's next-token distribution over a draft vocabulary.

Modules: ``settings`` (its drafter.* keys), ``shape`` (``DrafterConfig`` and SGLang's config.json, torch-free),
``model`` with ``layers`` / ``llama_layer`` / ``mla_layer`` (the two attention kinds SGLang serves:
``LlamaForCausalLMEagle3``, ``Eagle3DeepseekV2ForCausalLM``), ``ttt`` / ``ttt_flex`` (the objective), ``evaluate``
(simulated acceptance), ``memory`` (training memory, torch-free), ``folder`` (any tool's folder, torch-free),
``drafting`` (in-process chain drafting), ``training`` (the torch side the loop and the benchmark call).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from aerie.drafter_kinds.eagle3 import memory
from aerie.drafter_kinds.eagle3.folder import (
    EMBED_NAME,
    DrafterFolderError,
    check_drafter_folder,
    read_drafter_folder,
    served_aux_layer_ids,
)
from aerie.drafter_kinds.eagle3.settings import Eagle3Settings
from aerie.drafter_kinds.eagle3.shape import SGLANG_ARCHITECTURES, DrafterConfig
from aerie.drafter_kinds.kind import DrafterKind, HostMemory, TargetView, TrainingMemory, TrainingSettings
from aerie.target_model.config import resolve_aux_layer_ids


class Eagle3(DrafterKind):
    name = "eagle3"
    description = "EAGLE-3: one layer fed the target's aux layers, a chain of drafts (SGLang EAGLE3)"
    sglang_algorithm = "EAGLE3"
    architectures = tuple(SGLANG_ARCHITECTURES.values())
    settings_class = Eagle3Settings
    needs_draft_vocab = True
    copies_target_embeddings = True
    needs_target_distribution = True

    # -- what it trains on ---------------------------------------------------------------------------------

    def capture_layer_ids(
        self, settings: Eagle3Settings, target: TargetView, configured_aux_layer_ids: Sequence[int] | None
    ) -> list[int]:
        """hidden.aux_layer_ids (null: SGLang's default for the target's depth), refused unless SGLang serves them."""
        return resolve_aux_layer_ids(configured_aux_layer_ids, target.num_hidden_layers, target.architectures)

    def lookahead(self, settings: Eagle3Settings) -> int:
        return settings.ttt_steps + 1  # the last row's later TTT steps read the tokens (and targets) after it

    def shape(
        self, settings: Eagle3Settings, target: TargetView, draft_vocab_size: int, layer_ids: Sequence[int]
    ) -> DrafterConfig:
        tc = SimpleNamespace(**target.text_config)
        return DrafterConfig.from_target(tc, draft_vocab_size, list(layer_ids), **settings.shape_overrides())

    # -- estimates -----------------------------------------------------------------------------------------

    def trainable_parameters(self, shape: DrafterConfig) -> int:
        return memory.trainable_parameters(shape)

    def attention_cost_rows(self, shape: DrafterConfig) -> float:
        return memory.attention_cost_rows(shape)

    def serving_weight_bytes(self, shape: DrafterConfig, bytes_per_value: int) -> int:
        return memory.trainable_parameters(shape) * bytes_per_value

    def training_memory(
        self,
        train: TrainingSettings,
        target: TargetView,
        draft_vocab_size: int,
        layer_ids: Sequence[int],
        *,
        on_gpu: bool,
        hidden: Mapping[str, Any],
    ) -> TrainingMemory:
        return memory.estimate_training_memory(
            train,
            dict(target.text_config),
            draft_vocab_size,
            1 if on_gpu else 0,
            num_aux_layers=len(layer_ids),
            hidden_layout=hidden.get("layout", "compact"),
            target_topk=hidden.get("target_topk", 32),
        )

    def host_memory(
        self,
        train: TrainingSettings,
        target: TargetView,
        draft_vocab_size: int,
        layer_ids: Sequence[int],
        ranks: int,
        *,
        hidden: Mapping[str, Any],
    ) -> HostMemory:
        return memory.estimate_host_memory(
            train,
            dict(target.text_config),
            draft_vocab_size,
            ranks,
            num_aux_layers=len(layer_ids),
            hidden_layout=hidden.get("layout", "compact"),
            target_topk=hidden.get("target_topk", 32),
        )

    def train_flops_per_token(self, shape: DrafterConfig, settings: Eagle3Settings, train: TrainingSettings) -> float:
        return memory.train_flops_per_token(shape, settings.ttt_steps, train.max_seq_len)

    def measurement_key(self, settings: Eagle3Settings, target: TargetView) -> tuple[str, str]:
        """(the drafter label of bench/gpu_check.py's rows, its attention kernel) this run's steps are timed by."""
        attention = settings.attention
        if attention == "auto":
            attention = "mla" if target.text_config.get("kv_lora_rank") else "llama"
        return attention, "chunked" if settings.attention_kernel == "chunked" else "flex"

    # -- serving ---------------------------------------------------------------------------------------------

    def draft_tokens(self, settings: Eagle3Settings | None, num_draft_steps: int) -> int:
        return num_draft_steps  # one token per chained draft step

    def sglang_flags(self, folder: str | Path, config: Mapping[str, Any], sglang: Mapping[str, Any]) -> list[str]:
        return [
            "--speculative-algorithm",
            self.sglang_algorithm,
            "--speculative-draft-model-path",
            str(folder),
            "--speculative-num-steps",
            str(sglang["speculative_num_steps"]),
            "--speculative-eagle-topk",
            str(sglang["speculative_eagle_topk"]),
            "--speculative-num-draft-tokens",
            str(sglang["speculative_num_draft_tokens"]),
        ]

    # -- folders ---------------------------------------------------------------------------------------------

    def describe_folder(self, folder: Path) -> str:
        return read_drafter_folder(folder).describe()

    def folder_weight_bytes(self, folder: Path, bytes_per_value: int) -> int:
        stored = read_drafter_folder(folder).tensors
        return sum(_numel(t.shape) * bytes_per_value for n, t in stored.items() if n != EMBED_NAME)

    def reference_problems(self, folder: Path, target: TargetView | None) -> list[str]:
        """Why SGLang could not serve this reference folder on the target (empty: it fits as far as parse time
        knows). Its aux layers are its own: SGLang feeds each drafter the layers its config names."""
        text = target.text_config if target else {}
        layers = text.get("num_hidden_layers")
        architectures = target.architectures if target else ()
        try:
            info = read_drafter_folder(folder)
            check_drafter_folder(
                info,
                aux_layer_ids=None,
                num_hidden_layers=layers,
                architectures=architectures,
                target_hidden_size=text.get("hidden_size"),
                target_vocab_size=text.get("vocab_size"),
            )
        except DrafterFolderError as e:
            return e.problems
        if layers:
            served = served_aux_layer_ids(info.stated_aux_layer_ids, layers, architectures)
            if max(served) >= layers or min(served) < 0:
                return [f"SGLang would feed it the outputs of layers {served}, outside the target's {layers} layers"]
        return []

    def check_init_folder(
        self,
        folder: Path,
        settings: Eagle3Settings,
        target: TargetView | None,
        layer_ids: Sequence[int] | None,
        draft_vocab_size: int | None,
    ) -> None:
        """A warm-start folder against this run (DrafterFolderError naming every reason): the target's sizes, the
        layers SGLang would serve it, the draft vocabulary (kept: vocab.draft_vocab_size must be the folder's),
        the shape settings."""
        text = target.text_config if target else {}
        check_drafter_folder(
            read_drafter_folder(folder),
            aux_layer_ids=list(layer_ids) if layer_ids is not None else None,
            num_hidden_layers=text.get("num_hidden_layers"),
            architectures=target.architectures if target else (),
            target_hidden_size=text.get("hidden_size"),
            target_vocab_size=text.get("vocab_size"),
            draft_vocab_size=draft_vocab_size,
            shape=settings.drafter_shape(),
        )

    def init_preview(self, folder: Path, settings: Eagle3Settings) -> list[str]:
        info = read_drafter_folder(folder)
        lines = [
            info.describe(),
            f"training starts from every one of its tensors (checked against this config); draft vocab: taken from "
            f"its d2t/t2d ({info.draft_vocab_size} ids), not counted from the data (vocab.warm_start follow/auto "
            "replaces the ids the data never uses: the recipe lines)",
        ]
        upgrade = info.eagle31_upgrade(settings.drafter_shape())
        if upgrade:
            norms = f"; its {info.num_aux_layers} fc_norm weights start at 1" if "fc_norm" in upgrade else ""
            lines.append(f"EAGLE 3.1: {', '.join(upgrade)} switched on, which the folder lacks{norms}")
        return lines


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


KIND = Eagle3()
