"""EAGLE-3's torch side (``DrafterKind.torch_side``): what the training loop (aerie.drafter.loop) and the in-process
benchmark (aerie.benchmark.run) call for this kind.

- ``build``: a new drafter around the target's frozen embeddings (lm_head and norm from the target's with
  init_head_from_target), or a warm start from a folder (``train.init``: every tensor, checked first), and the
  target's next-token head the loss reads (``TargetHead``);
- ``Objective``: one batch's TTT loss (``prepare`` outside autocast, ``forward`` inside: what DDP wraps);
- ``evaluate``: held-out simulated acceptance; ``export`` / ``check_export``: the folder SGLang serves;
- ``load_for_bench``, ``untrained_like``, ``proposer``: the benchmark's drafters and their chain drafting.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor, nn

from aerie.drafter_kinds.batch import Batch
from aerie.drafter_kinds.eagle3.drafting import EagleProposer
from aerie.drafter_kinds.eagle3.evaluate import evaluate
from aerie.drafter_kinds.eagle3.folder import check_drafter_folder, read_drafter_folder
from aerie.drafter_kinds.eagle3.layers import attention_kernel
from aerie.drafter_kinds.eagle3.model import DrafterConfig, Eagle3Drafter
from aerie.drafter_kinds.eagle3.settings import Eagle3Settings
from aerie.drafter_kinds.eagle3.ttt import TargetHead, Targets, TTTUnroll
from aerie.drafter_kinds.folders import resolve_drafter_folder
from aerie.drafter_kinds.kind import EMPTY_EVAL, TrainingSettings
from aerie.formats.vocab import FOLLOWED_SOURCE, DraftVocab
from aerie.target_model.config import read_text_config, target_architectures
from aerie.target_model.heads import read_target_heads

# Tensors of the drafter that are the target's (frozen, not saved in a training state: read from the target again).
FROZEN_TARGET_TENSORS = ("embed_tokens.weight",)
__all__ = ["EMPTY_EVAL", "evaluate"]  # the torch side the loop reads, defined elsewhere


def kernel(settings: Eagle3Settings, device: torch.device) -> str:
    """The TTT attention kernel this run uses on ``device`` (drafter.attention_kernel resolved)."""
    return attention_kernel(settings.attention_kernel, device)


def build(
    target_path: Path,
    vocab: DraftVocab,
    layer_ids: Sequence[int],
    train: TrainingSettings,
    hidden_layout: str,
    device: torch.device,
) -> tuple[Eagle3Drafter, DrafterConfig, TargetHead]:
    """(the drafter on ``device``, its shape, the target's head for the loss): new around the target's frozen
    embeddings, or warm-started from ``train.init``. ``full`` hidden shards need the target's lm_head on the device
    (soft targets from the final states); ``compact`` ones carry the target's top-k (no [V, H] head: 4.7 GB fp32 for
    Kimi)."""
    settings: Eagle3Settings = train.kind_settings
    need_lm_head = hidden_layout == "full"
    roles = ["embed", "norm"] + (["lm_head"] if need_lm_head or settings.init_head_from_target else [])
    heads = read_target_heads(target_path, roles)
    if getattr(train, "init", ""):
        model = start_from_folder(train.init, target_path, vocab, layer_ids, settings, heads.embed)
        dcfg = model.cfg
    else:
        dcfg = DrafterConfig.from_target(
            SimpleNamespace(**heads.config), len(vocab.d2t), list(layer_ids), **settings.shape_overrides()
        )
        if tuple(heads.embed.shape) != (dcfg.vocab_size, dcfg.hidden_size):
            raise ValueError(f"target embeddings {tuple(heads.embed.shape)} != ({dcfg.vocab_size}, {dcfg.hidden_size})")
        torch.manual_seed(train.seed)  # deterministic drafter init
        model = Eagle3Drafter(dcfg)
        model.set_vocab_maps(vocab.d2t, vocab.t2d)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(heads.embed)
            if settings.init_head_from_target:
                model.lm_head.weight.copy_(heads.lm_head[vocab.target_ids])
                if heads.norm is not None and heads.norm.shape == model.norm.weight.shape:
                    model.norm.weight.copy_(heads.norm)
    model = model.to(device)
    if need_lm_head:
        head = TargetHead(
            full=heads.lm_head.to(device).float(),
            draft=heads.lm_head[vocab.target_ids].to(device).float(),
            t2d=vocab.t2d.to(device),
        )
    else:
        head = TargetHead(full=None, draft=None, t2d=vocab.t2d.to(device))
    return model, dcfg, head


def check_training_data(shape: DrafterConfig, shards: Sequence) -> None:
    """Nothing EAGLE-3 needs of the token ids beyond the shards' own checks (its draft vocab maps any id)."""


def start_from_folder(
    init: str,
    target_path: Path,
    vocab: DraftVocab,
    layer_ids: Sequence[int],
    settings: Eagle3Settings,
    embed: Tensor,
) -> Eagle3Drafter:
    """The drafter of folder ``init`` for this run (fp32, the target's embeddings ``embed`` [V, H] loaded), refused
    by name unless it fits (``check_drafter_folder``: the target's sizes, the aux layers SGLang would serve it vs the
    layers captured, the draft vocab, the shape settings). ``vocab`` is the folder's own d2t/t2d, or the folder's
    after following the data (aerie.vocab.draft_vocab ``follow_data``): then each kept id keeps its lm_head row
    and each new id starts from the target's lm_head row of that token. EAGLE 3.1 switches the settings turn on and
    the folder lacks are switched on (fc_norm's weights start at 1). Otherwise nothing is re-initialised: an
    export before any optimizer step is the folder again (in SGLang's bf16)."""
    path = resolve_drafter_folder(init, base=Path.cwd())
    info = read_drafter_folder(path)
    text = read_text_config(target_path)
    check_drafter_folder(
        info,
        aux_layer_ids=list(layer_ids),
        num_hidden_layers=int(text["num_hidden_layers"]),
        architectures=target_architectures(target_path),
        target_hidden_size=int(text["hidden_size"]),
        target_vocab_size=int(text["vocab_size"]),
        draft_vocab_size=len(vocab.d2t),
        shape=settings.drafter_shape(),
    )
    switch_on = info.eagle31_upgrade(settings.drafter_shape())
    model = Eagle3Drafter.from_folder(info, list(layer_ids), embed_tokens=embed, switch_on=switch_on)
    if torch.equal(model.d2t, vocab.d2t.long()) and torch.equal(model.t2d, vocab.t2d.bool()):
        return model
    if vocab.meta.get("source") != FOLLOWED_SOURCE:
        raise ValueError(
            f"the draft vocab file is not drafter.init's ({path}) d2t/t2d, nor its vocabulary after following the "
            "data (vocab.warm_start): rerun the draft_vocab rule"
        )
    remap_draft_vocab(model, vocab, read_target_heads(target_path, ["lm_head"]).lm_head)
    return model


def remap_draft_vocab(model: Eagle3Drafter, vocab: DraftVocab, target_lm_head: Tensor) -> dict:
    """Give ``model`` the draft vocabulary ``vocab``: a row of lm_head per new draft id, the model's own row where
    the target id was in its vocabulary, else ``target_lm_head``'s row of that token (the rule stated in the vocab
    file: NEW_ROW_RULE). Returns how many rows were kept and taken from the target."""
    old_ids = model.draft_to_target(torch.arange(model.cfg.draft_vocab_size, device=model.d2t.device)).cpu()
    new_ids = vocab.target_ids
    if len(new_ids) != len(old_ids):
        raise ValueError(f"the draft vocab has {len(new_ids)} ids, drafter.init's lm_head {len(old_ids)} rows")
    row_of = torch.full((int(vocab.t2d.numel()),), -1, dtype=torch.int64)
    row_of[old_ids] = torch.arange(len(old_ids))
    rows = row_of[new_ids]
    kept = rows >= 0
    with torch.no_grad():
        weight = model.lm_head.weight
        new = target_lm_head[new_ids].to(weight.dtype).to(weight.device).clone()
        new[kept.to(weight.device)] = weight[rows[kept].to(weight.device)]
        weight.copy_(new)
    model.set_vocab_maps(vocab.d2t, vocab.t2d)
    return {"kept_rows": int(kept.sum()), "rows_from_target": int((~kept).sum())}


class Objective(nn.Module):
    """One batch's TTT loss: ``prepare`` the target's side outside autocast (the greedy token and the soft targets
    in fp32, as they always were), then ``forward`` (what DDP wraps and autocast covers) runs the unroll.
    ``forward`` returns (loss, per draft step (ce_sum, weight_sum, correct))."""

    def __init__(self, model: Eagle3Drafter, head: TargetHead, settings: Eagle3Settings, kernel: str):
        super().__init__()
        self.unroll = TTTUnroll(model, settings.ttt_steps, settings.step_loss_decay, kernel)
        self.head, self.settings = head, settings

    def prepare(self, b: Batch, seed: int) -> Targets:
        return self.head.prepare(b, self.settings.mask_out_of_vocab_targets)

    def forward(self, b: Batch, targets: Targets):
        loss, stats, _ = self.unroll(b, targets)
        return loss, stats


def eval_facts(settings: Eagle3Settings) -> dict:
    """What eval.json says of how the kind trained."""
    return {"ttt_steps": settings.ttt_steps}


def export(model: Eagle3Drafter, folder: Path, facts: dict, layer_ids: Sequence[int]) -> None:
    """The drafter in SGLang's layout at ``folder`` (with aerie's training facts), re-read to check its layers."""
    model.save_pretrained(folder, extra=facts)
    check_export(folder, layer_ids)


def check_export(folder: Path, layer_ids: Sequence[int]) -> None:
    """Re-read an exported drafter's config.json: SGLang captures the layers named there, so they must be the
    layers the drafter was trained on."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    exported = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if exported != list(layer_ids):
        raise ValueError(
            f"{folder}/config.json: eagle_config.eagle_aux_hidden_state_layer_ids is {exported}, but the drafter "
            f"was trained on hidden shards captured at aux layers {list(layer_ids)}; refusing to publish it"
        )


# -- the benchmark ------------------------------------------------------------------------------------------------


def load_for_bench(target: nn.Module, target_path: str | Path, folder: str | Path, device: torch.device):
    """A drafter folder (written by any tool in SGLang's layout) ready to draft for ``target``: fed the layers SGLang
    would feed it on that target, in the target's dtype (the folder stores bf16, as SGLang serves it), with the
    target's embeddings (an export has none: like SGLang's EAGLE worker, it takes the target's)."""
    drafter = Eagle3Drafter.from_pretrained(folder, dtype=next(target.parameters()).dtype, target=target_path)
    vocab = target.config.get_text_config().vocab_size
    if drafter.cfg.vocab_size != vocab:
        raise ValueError(f"drafter {folder} was built for a vocab of {drafter.cfg.vocab_size}, the target has {vocab}")
    drafter.load_target_embeddings(target.get_input_embeddings().weight)
    return drafter.to(device).eval()


def untrained_like(drafter: Eagle3Drafter, target: nn.Module, seed: int = 0) -> Eagle3Drafter:
    """The drafter exactly as training starts it (same config, vocab maps and init): the floor."""
    torch.manual_seed(seed)
    fresh = Eagle3Drafter.from_target(target, drafter.cfg, drafter.d2t, drafter.t2d, init_head_from_target=True)
    return fresh.to(device=next(drafter.parameters()).device, dtype=next(drafter.parameters()).dtype).eval()


def proposer(drafter: Eagle3Drafter, target: nn.Module) -> EagleProposer:
    """Chain drafting with ``drafter`` (its aux layers are what the benchmark captures from ``target``)."""
    return EagleProposer(drafter)


def capture_layer_ids(drafter: Eagle3Drafter) -> list[int]:
    return [int(i) for i in drafter.cfg.aux_layer_ids]
