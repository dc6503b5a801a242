"""DFlash (z-lab's block-diffusion drafter) as SGLang 0.5.23 serves it: ``--speculative-algorithm DFLASH``.

One forward of the drafter over ``[last verified token, MASK x (B-1)]`` proposes B-1 tokens at once, conditioned
on the target's features of every committed token (written into each draft layer's keys and values).

Modules: ``shape`` (torch-free: the shape, SGLang's config.json and flags, size/memory/FLOP estimates), ``rotary``
(SGLang's RoPE/YaRN numbers), ``model`` (the drafter, named as SGLang loads it), ``objective`` (the training loss
on a batch, simulated acceptance), ``drafting`` (in-process block drafting for the benchmark), ``folder``
(read and check a folder, torch-free), ``weights`` (export and load one), ``settings`` (its drafter.* keys),
``training`` (the torch side the loop and the benchmark call).

What the kind needs from the rest of aerie:

- capture: the outputs of ``shape.target_layer_ids`` (aerie's convention, ``capture_layer_ids``), concatenated in
  that order - the hidden shards must store these K layers for every token of every sequence;
- no draft vocabulary: drafts are projected through the target's own lm_head over the full vocabulary;
- no target final hidden state and no target top-k distribution: the labels are the sequence's own tokens (the
  target's greedy/sampled outputs), so hidden shards for DFlash need neither ``final`` states nor logits;
- the target's input embedding matrix (embeds the block, MASK included) and lm_head weight, both frozen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aerie.drafter_kinds.dflash.folder import check_dflash_folder, read_dflash_folder
from aerie.drafter_kinds.dflash.settings import DFlashSettings
from aerie.drafter_kinds.dflash.shape import (
    SGLANG_ARCHITECTURE,
    SGLANG_DFLASH_TARGETS,
    DFlashShape,
    default_target_layer_ids,
    parameter_count,
    sglang_flags,
    train_flops_per_token,
    training_memory,
)
from aerie.drafter_kinds.folders import DrafterFolderError
from aerie.drafter_kinds.kind import DrafterKind, HostMemory, TargetView, TrainingMemory, TrainingSettings

NEEDS_DRAFT_VOCAB = False
NEEDS_TARGET_FINAL_HIDDEN = False
NEEDS_TARGET_TOPK = False


class DFlash(DrafterKind):
    name = "dflash"
    description = (
        "DFlash: block diffusion, a whole block of drafts per forward from the target's features (SGLang DFLASH)"
    )
    sglang_algorithm = "DFLASH"
    architectures = (SGLANG_ARCHITECTURE,)
    settings_class = DFlashSettings
    needs_draft_vocab = NEEDS_DRAFT_VOCAB
    copies_target_embeddings = False
    needs_target_distribution = NEEDS_TARGET_FINAL_HIDDEN or NEEDS_TARGET_TOPK

    # -- what it trains on ---------------------------------------------------------------------------------

    def capture_layer_ids(
        self, settings: DFlashSettings, target: TargetView, configured_aux_layer_ids: Sequence[int] | None
    ) -> list[int]:
        """drafter.target_layer_ids, else SGLang 0.5.23's default for (the target's depth, the draft's layers);
        refused for a target SGLang does not serve DFLASH on, or ids it cannot capture."""
        depth = target.num_hidden_layers
        ids = list(settings.target_layer_ids) or default_target_layer_ids(depth, settings.layers)
        served = [a for a in target.architectures if a in SGLANG_DFLASH_TARGETS]
        if target.architectures and not served:
            raise ValueError(
                f"drafter.kind dflash: the target's architectures {list(target.architectures)} are none of those "
                f"SGLang 0.5.23 serves DFLASH on ({', '.join(SGLANG_DFLASH_TARGETS)})"
            )
        bad = [i for i in ids if not 0 <= i < depth - 1]
        if bad or any(b <= a for a, b in zip(ids, ids[1:])):
            raise ValueError(
                f"drafter.target_layer_ids {ids} must be ascending ids in 0..{depth - 2} for a target of {depth} "
                "layers (SGLang captures layer i's output at layer i+1's input: the last layer's never)"
            )
        return ids

    def lookahead(self, settings: DFlashSettings) -> int:
        return 0  # a block's labels lie inside its window: nothing past it is read

    def shape(
        self, settings: DFlashSettings, target: TargetView, draft_vocab_size: int, layer_ids: Sequence[int]
    ) -> DFlashShape:
        """The drafter for this target. An unresolved mask id (-1: the tokenizer's, known once the target is here)
        is sized with the vocabulary's last id: no size depends on it."""
        mask = settings.mask_token_id if settings.mask_token_id >= 0 else target.vocab_size - 1
        return shape_for(settings, target.text_config, layer_ids, mask)

    # -- estimates -----------------------------------------------------------------------------------------

    def trainable_parameters(self, shape: DFlashShape) -> int:
        return parameter_count(shape)

    def attention_cost_rows(self, shape: DFlashShape) -> float:
        """The context length at which a block's attention costs as much as its layers' matmuls."""
        return parameter_count(shape) / (shape.num_attention_heads * 2 * shape.head_dim * shape.block_size)

    def serving_weight_bytes(self, shape: DFlashShape, bytes_per_value: int) -> int:
        return parameter_count(shape) * bytes_per_value

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
        """Per GPU, a replica (DDP): fp32 weights, gradients and AdamW, the target's embeddings and lm_head, the
        largest batch's context features and its blocks' activations (aerie.drafter_kinds.dflash.shape)."""
        settings: DFlashSettings = train.kind_settings
        shape = self.shape(settings, target, draft_vocab_size, layer_ids)
        tokens = train.largest_batch_tokens
        blocks = min(settings.num_anchors * max(1, tokens // train.max_seq_len) * train.batch_size, tokens)
        a = 2 if on_gpu else 4
        m = training_memory(
            shape,
            batch_tokens=tokens,
            num_anchors=blocks,
            compute_bytes=a,
            feature_bytes=a,
            checkpoint_layers=settings.checkpoint_layers,
        )
        parts = {
            "parameters": m.weights,
            "gradients": m.gradients,
            "optimizer state": m.optimizer,
            "target embeddings + lm_head": m.frozen_target,
            "batch": m.batch,
            "activations": m.activations,
            "loss logits chunk": m.logits,
        }
        return TrainingMemory(parts=parts, batch_tokens=tokens, window=train.max_seq_len, activation_bytes=a)

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
        """Each rank builds its drafter on the host (fp32) beside the target's embeddings and lm_head as stored
        (bf16), then holds two batches (one loading while the other trains)."""
        shape = self.shape(train.kind_settings, target, draft_vocab_size, layer_ids)
        start = 4 * parameter_count(shape) + 2 * 2 * shape.vocab_size * shape.hidden_size
        aux = len(layer_ids) * shape.hidden_size * (1 if hidden.get("layout", "compact") == "compact" else 2)
        batches = 2 * train.largest_batch_tokens * (aux + 4 * len(layer_ids) + 8 + 1 + 8 + 8)
        return HostMemory({"drafters built on the host (start)": ranks * max(start, batches)}, ranks)

    def train_flops_per_token(self, shape: DFlashShape, settings: DFlashSettings, train: TrainingSettings) -> float:
        return train_flops_per_token(shape, settings.num_anchors, train.max_seq_len)

    def measurement_key(self, settings: DFlashSettings, target: TargetView) -> tuple[str, str]:
        return "dflash", "reference" if settings.attention_kernel == "reference" else "flex"

    # -- serving ---------------------------------------------------------------------------------------------

    def draft_tokens(self, settings: DFlashSettings | None, num_draft_steps: int) -> int:
        """A block drafts block_size - 1 tokens in one forward, whatever the chain kinds' num_draft_steps."""
        return settings.block - 1 if settings is not None else num_draft_steps

    def sglang_flags(self, folder: str | Path, config: Mapping[str, Any], sglang: Mapping[str, Any]) -> list[str]:
        shape = DFlashShape.from_sglang_config(config, vocab_size=2**62, num_target_layers=2**62)
        return sglang_flags(str(folder), shape)  # the verify window: the folder's block_size

    # -- folders ---------------------------------------------------------------------------------------------

    def describe_folder(self, folder: Path) -> str:
        shape, tensors = read_dflash_folder(folder)
        return (
            f"{SGLANG_ARCHITECTURE} (dflash), {shape.num_hidden_layers} layers, hidden {shape.hidden_size}, block "
            f"{shape.block_size}, mask id {shape.mask_token_id}, target layers {list(shape.target_layer_ids)}, "
            f"{len(tensors)} tensors"
        )

    def folder_weight_bytes(self, folder: Path, bytes_per_value: int) -> int:
        shape, _ = read_dflash_folder(folder)
        return parameter_count(shape) * bytes_per_value

    def reference_problems(self, folder: Path, target: TargetView | None) -> list[str]:
        if not _described(target):
            return []  # nothing to check against before the target is described (the job checks again)
        try:
            check_dflash_folder(folder, dict(target.text_config))
        except DrafterFolderError as e:
            return e.problems
        return []

    def check_init_folder(
        self,
        folder: Path,
        settings: DFlashSettings,
        target: TargetView | None,
        layer_ids: Sequence[int] | None,
        draft_vocab_size: int | None,
    ) -> None:
        """A warm-start folder against this run (DrafterFolderError naming every reason): it must fit the target,
        read the layers this run captures, and have the shape the settings ask for (a set one must equal it)."""
        if not _described(target):
            read_dflash_folder(folder)  # readable at least; checked against the target when training starts
            return
        shape = check_dflash_folder(folder, dict(target.text_config)).shape
        problems = folder_setting_problems(shape, settings, layer_ids)
        if problems:
            raise DrafterFolderError(folder, problems)

    def settings_from_folder(self, settings: DFlashSettings, folder: Path) -> DFlashSettings:
        """A warm start keeps the folder's shape: the settings left derived (0, -1, ()) take its values."""
        shape, _ = read_dflash_folder(folder)
        taken = {
            "num_layers": shape.num_hidden_layers,
            "block_size": shape.block_size,
            "target_layer_ids": tuple(shape.target_layer_ids),
            "mask_token_id": shape.mask_token_id,
            "num_attention_heads": shape.num_attention_heads,
            "num_key_value_heads": shape.num_key_value_heads,
            "head_dim": shape.head_dim,
            "intermediate_size": shape.intermediate_size,
        }
        unset = {k: v for k, v in taken.items() if getattr(settings, k) in (0, -1, ())}
        return dataclasses.replace(settings, **unset)

    def init_preview(self, folder: Path, settings: DFlashSettings) -> list[str]:
        return [
            self.describe_folder(folder),
            "training starts from every one of its tensors (checked against this config); no draft vocabulary (it "
            "projects through the target's lm_head)",
        ]


def shape_for(
    settings: DFlashSettings, text_config: Mapping[str, Any], layer_ids: Sequence[int], mask_token_id: int
) -> DFlashShape:
    """The drafter the settings ask for on a target (its text config), reading ``layer_ids``."""
    derived = lambda v: v or None  # noqa: E731 - 0 means "the target's"
    return DFlashShape.from_target(
        dict(text_config),
        num_layers=settings.layers,
        block_size=settings.block,
        mask_token_id=mask_token_id,
        target_layer_ids=list(layer_ids),
        num_attention_heads=derived(settings.num_attention_heads),
        num_key_value_heads=derived(settings.num_key_value_heads),
        head_dim=derived(settings.head_dim),
        intermediate_size=derived(settings.intermediate_size),
        sliding_window=derived(settings.sliding_window),
    )


def folder_setting_problems(shape: DFlashShape, settings: DFlashSettings, layer_ids: Sequence[int] | None) -> list[str]:
    """What in a folder's shape differs from what the settings ask for (each named): a warm start keeps the
    folder's shape, so a setting the user set must be the folder's."""
    problems = []
    if layer_ids is not None and list(shape.target_layer_ids) != list(layer_ids):
        problems.append(
            f"it reads target layers {list(shape.target_layer_ids)}, this run captures {list(layer_ids)} for it: set "
            f"drafter.target_layer_ids: {list(shape.target_layer_ids)}"
        )
    checks = {
        "num_layers": shape.num_hidden_layers,
        "block_size": shape.block_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate_size,
    }
    for key, have in checks.items():
        want = getattr(settings, key)
        if want and want != have:  # 0: derived - the folder's
            problems.append(f"config.json gives {key} {have}, drafter.{key} is {want}")
    if settings.mask_token_id >= 0 and settings.mask_token_id != shape.mask_token_id:
        problems.append(
            f"config.json dflash_config.mask_token_id is {shape.mask_token_id}, drafter.mask_token_id is "
            f"{settings.mask_token_id}"
        )
    return problems


KIND = DFlash()


def _described(target: TargetView | None) -> bool:
    """Whether parse time knows the three sizes a DFlash folder is checked against (a config naming only the
    target's depth does not: the job checks the folder once the target is here)."""
    return target is not None and all(
        target.text_config.get(k) for k in ("num_hidden_layers", "hidden_size", "vocab_size")
    )
