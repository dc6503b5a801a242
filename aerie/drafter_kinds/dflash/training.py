"""DFlash's torch side (``DrafterKind.torch_side``): what the training loop (aerie.drafter.loop) and the in-process
benchmark (aerie.benchmark.run) call for this kind.

- ``build``: a new drafter for the target (its MASK id resolved from the tokenizer unless set), or a warm start from
  a DFlash folder (``train.init``: checked against the target, every tensor by name and shape), and the target's
  frozen embeddings and lm_head the objective reads (``TargetHead``);
- ``Objective``: one batch's anchored-block loss (objective.py): ``prepare`` draws the anchors' generator from the
  step's seed (a resumed run draws the same anchors), ``forward`` computes the loss (what DDP wraps);
- ``evaluate``: held-out blocks' simulated acceptance (SGLang's ``spec_accept_length`` definition) and loss;
- ``export`` / ``check_export``: the folder SGLang 0.5.23's ``DFlashDraftModel`` loads;
- ``load_for_bench``, ``untrained_like``, ``proposer``: the benchmark's drafters and their block drafting.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from aerie.drafter_kinds import dflash
from aerie.drafter_kinds.batch import Batch
from aerie.drafter_kinds.dflash.drafting import DFlashProposer
from aerie.drafter_kinds.dflash.model import DFlashDrafter
from aerie.drafter_kinds.dflash.objective import DFlashBatch, dflash_loss, loss_gamma
from aerie.drafter_kinds.dflash.settings import DFlashSettings
from aerie.drafter_kinds.dflash.shape import DFlashShape
from aerie.drafter_kinds.dflash.weights import export_dflash, load_dflash
from aerie.drafter_kinds.folders import DrafterFolderError, resolve_drafter_folder
from aerie.drafter_kinds.kind import EMPTY_EVAL, TrainingSettings
from aerie.target_model.config import read_text_config
from aerie.target_model.heads import read_target_heads
from aerie.target_model.markers import declared_tokens, mask_token_id, never_in_text_ids

FROZEN_TARGET_TENSORS: tuple[str, ...] = ()  # the target's embeddings and lm_head live in TargetHead, not the drafter


@dataclass
class TargetHead:
    """The target's frozen input embeddings and lm_head [V, H] (the block is embedded with the first, the drafts
    projected with the second over the full vocabulary), in the dtype the step computes in."""

    embed: Tensor
    lm_head: Tensor


def kernel(settings: DFlashSettings, device: torch.device) -> str:
    """The attention kernel of the blocks' mask: flex on CUDA (a BlockMask: compiled, sparse), the dense reference
    elsewhere (torch 2.13 has no CPU backward for flex); drafter.attention_kernel may force either."""
    if settings.attention_kernel != "auto":
        return settings.attention_kernel
    return "flex" if device.type == "cuda" else "reference"


def mask_token_check(target_path: Path) -> Callable[[int], bool]:
    """Whether an id may be a MASK on this target: a declared token no text encodes to (aerie.target_model.markers).
    A target folder without tokenizer files cannot say: any id of its vocabulary passes here, and the training data
    check (``check_training_data``) still refuses one that occurs in the sequences."""
    if not declared_tokens(target_path):
        return lambda i: True
    usable = never_in_text_ids(target_path)
    return lambda i: i in usable


def build(
    target_path: Path,
    vocab: None,
    layer_ids: Sequence[int],
    train: TrainingSettings,
    hidden_layout: str,
    device: torch.device,
) -> tuple[DFlashDrafter, DFlashShape, TargetHead]:
    """(the drafter on ``device``, its shape, the target's head): new, or warm-started from ``train.init``. DFlash has
    no draft vocabulary (``vocab`` is None) and reads no target distribution from the shards (any layout)."""
    settings: DFlashSettings = train.kind_settings
    heads = read_target_heads(target_path, ["embed", "lm_head"])
    usable = mask_token_check(target_path)
    if getattr(train, "init", ""):
        folder = resolve_drafter_folder(train.init, base=Path.cwd())
        model = load_dflash(folder, heads.config, mask_token_valid=usable)
        settings = dflash.KIND.settings_from_folder(settings, folder)
        problems = dflash.folder_setting_problems(model.shape, settings, layer_ids)
        if problems:
            raise DrafterFolderError(folder, problems)
    else:
        mask = settings.mask_token_id if settings.mask_token_id >= 0 else mask_token_id(target_path)
        if not usable(mask):
            raise ValueError(
                f"drafter.mask_token_id {mask} is a token text encodes to on {target_path} (the MASK slots would read "
                "as it): set it to the tokenizer's unknown token or a reserved id"
            )
        shape = dflash.shape_for(settings, heads.config, layer_ids, mask)
        torch.manual_seed(train.seed)  # deterministic drafter init
        model = DFlashDrafter(shape)
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32  # frozen: what the step computes in
    head = TargetHead(embed=heads.embed.to(device, compute), lm_head=heads.lm_head.to(device, compute))
    return model.to(device), model.shape, head


def check_training_data(shape: DFlashShape, shards: Sequence) -> None:
    """The MASK id must never occur in the training sequences: a block would not tell a MASK from that token."""
    for s in shards:
        if bool((s.input_ids == shape.mask_token_id).any()):
            raise ValueError(
                f"{s.path} holds token {shape.mask_token_id}, the drafter's MASK id: choose drafter.mask_token_id "
                "among ids no text encodes to"
            )


def as_dflash_batch(b: Batch) -> DFlashBatch:
    """The loop's batch as the objective reads it: the rows' tokens, loss mask and the kind's layer features."""
    T = b.aux.shape[1]
    return DFlashBatch(
        input_ids=b.ids[:, :T], loss_mask=b.gen[:, :T].float(), target_features=b.aux, seq_start=b.seq_start
    )


class Objective(nn.Module):
    """One batch's DFlash loss. ``forward`` returns (loss, per draft slot (ce_sum, count, correct))."""

    def __init__(self, model: DFlashDrafter, head: TargetHead, settings: DFlashSettings, kernel: str):
        super().__init__()
        self.drafter, self.head, self.settings, self.kernel = model, head, settings, kernel

    def prepare(self, b: Batch, seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(int(seed) % (2**63))

    def forward(self, b: Batch, generator: torch.Generator):
        out = dflash_loss(
            self.drafter,
            as_dflash_batch(b),
            embed_weight=self.head.embed,
            lm_head_weight=self.head.lm_head,
            num_anchors=self.settings.num_anchors,
            generator=generator,
            gamma=self.settings.gamma,
            kernel=self.kernel,
            checkpoint_layers=self.settings.checkpoint_layers,
        )
        stats = list(zip(out.slot_loss_sum, out.slot_count, out.slot_correct))
        return out.loss, stats


@torch.no_grad()
def evaluate(
    model: DFlashDrafter,
    batches: Iterable[Batch],
    head: TargetHead,
    settings: DFlashSettings,
    kernel: str,
    device: torch.device,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
) -> dict:
    """Held-out blocks at fixed anchors (seed 0 per batch): each block is one verify step that commits its leading
    correct drafts plus the bonus token (SGLang's spec_accept_length), the acceptance of the whole block and of
    its first n drafts, and the per-slot loss and accuracy (the loss weighted as in training)."""
    model.eval()
    S = model.shape.block_size - 1
    ce = torch.zeros(S, dtype=torch.float64)
    count = torch.zeros(S, dtype=torch.float64)
    correct = torch.zeros(S, dtype=torch.float64)
    accepted_at = torch.zeros(S, dtype=torch.float64)  # blocks whose first k+1 drafts were all accepted
    blocks = 0
    for i, b in enumerate(batches):
        out = dflash_loss(
            model,
            as_dflash_batch(b),
            embed_weight=head.embed,
            lm_head_weight=head.lm_head,
            num_anchors=settings.num_anchors,
            generator=torch.Generator().manual_seed(i),
            gamma=settings.gamma,
            kernel=kernel,
        )
        ce += out.slot_loss_sum.double().cpu()
        count += out.slot_count.double().cpu()
        correct += out.slot_correct.double().cpu()
        ok = out.block_correct.bool() & out.block_valid.bool()
        accepted_at += ok.long().cumprod(dim=1).sum(0).double().cpu()
        blocks += ok.shape[0]
    model.train()
    if all_reduce is not None:
        totals = all_reduce(torch.cat([ce, count, correct, accepted_at, torch.tensor([blocks], dtype=torch.float64)]))
        ce, count, correct, accepted_at = totals[: 4 * S].view(4, S)
        blocks = int(totals[-1])
    if blocks == 0:
        return dict(EMPTY_EVAL)
    gamma = loss_gamma(settings.gamma, model.shape.block_size)
    decay = torch.tensor([math.exp(-k / gamma) for k in range(S)], dtype=torch.float64)
    per_pos = (accepted_at / blocks).tolist()
    return {
        "simulated_acceptance_length": 1.0 + sum(per_pos),
        "acceptance_per_position": per_pos,
        "simulated_acceptance_length_by_steps": [1.0 + sum(per_pos[:n]) for n in range(1, S + 1)],
        "heldout_loss": float((decay * ce).sum() / (decay * count).sum().clamp_min(1.0)),
        "heldout_loss_per_step": (ce / count.clamp_min(1)).tolist(),
        "heldout_accuracy_per_step": (correct / count.clamp_min(1)).tolist(),
        "heldout_start_positions": blocks,
    }


def eval_facts(settings: DFlashSettings) -> dict:
    """What eval.json says of how the kind trained."""
    return {"block_size": settings.block, "num_anchors": settings.num_anchors, "loss_gamma": settings.gamma}


def export(model: DFlashDrafter, folder: Path, facts: dict, layer_ids: Sequence[int]) -> None:
    """The folder SGLang 0.5.23 serves (config.json + model.safetensors, bf16), re-read to check its layers."""
    export_dflash(model, model.shape, Path(folder), facts)
    check_export(folder, layer_ids)


def check_export(folder: Path, layer_ids: Sequence[int]) -> None:
    """SGLang captures the layers the folder's config.json names: they must be the ones the drafter trained on."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    exported = (cfg.get("dflash_config") or {}).get("target_layer_ids")
    if exported != list(layer_ids):
        raise ValueError(
            f"{folder}/config.json: dflash_config.target_layer_ids is {exported}, but the drafter was trained on "
            f"target layers {list(layer_ids)}; refusing to publish it"
        )


# -- the benchmark ------------------------------------------------------------------------------------------------


def load_for_bench(target: nn.Module, target_path: str | Path, folder: str | Path, device: torch.device):
    """A DFlash folder (aerie's export or another tool's) checked against the target and ready to draft for it, in
    the target's dtype."""
    text = read_text_config(target_path)
    drafter = load_dflash(folder, text, mask_token_valid=mask_token_check(Path(target_path)))
    return drafter.to(device=device, dtype=next(target.parameters()).dtype).eval()


def untrained_like(drafter: DFlashDrafter, target: nn.Module, seed: int = 0) -> DFlashDrafter:
    """The drafter exactly as training starts it from scratch (same shape, seeded init): the floor."""
    torch.manual_seed(seed)
    fresh = DFlashDrafter(drafter.shape)
    return fresh.to(device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype).eval()


def proposer(drafter: DFlashDrafter, target: nn.Module) -> DFlashProposer:
    """Block drafting with ``drafter``, embedding and projecting with ``target``'s own embeddings and lm_head."""
    return DFlashProposer(drafter, target.get_input_embeddings().weight, target.get_output_embeddings().weight)


def capture_layer_ids(drafter: DFlashDrafter) -> list[int]:
    return list(drafter.shape.target_layer_ids)
