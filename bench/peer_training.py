"""aerie's drafter training recipe side by side with SpecForge's, on the same hidden shards, one result file
per arm and seed.

Both trainers get the same sequences, the same held-out split (aerie's, per seed), the same draft vocabulary and
the same comparison budget (epochs, maximum length). The drafter shape is the one SpecForge's own draft config
generator derives from the target, which must equal aerie's (SGLang's ``LlamaForCausalLMEagle3``: one decoder
layer at the target's width and heads): every SpecForge drafter is loaded into aerie's drafter to be judged.
aerie trains with ``aerie.drafter.loop.train_drafter``; SpecForge trains with its own classes in a single-process
loop: ``OfflineEagle3Dataset`` (reading the samples converted to its offline layout), ``DataCollatorWithPadding``,
``LlamaForCausalLMEagle3``, ``OnlineEagle3Model``, ``Eagle3TrainStrategy`` with its ``TargetHead``, and
``BF16Optimizer``. Every drafter is scored by the same judges: aerie's held-out simulation
(``aerie.drafter_kinds.eagle3.evaluate.evaluate``: acceptance length and per-position acceptance of greedy chain
drafting
against the target's own next tokens) and, with ``--bench-prompts``, the exported drafter decoded through
``aerie.benchmark.run.run_benchmark`` (the demo's bench rule's function: measured acceptance, tokens/s, speedup over
the plain target, lossless check).

Arms (``--arms`` picks some); from ``specforge-default`` down, each rung changes one thing from the one above:
- ``aerie``: aerie's defaults at the run's settings (``--lr``, ``--ttt``, ``--batch-size``, ``--epochs``).
- ``specforge-default``: SpecForge 0.2.0 at its own defaults, read from its config schema when the run starts
  (``TrainingConfig``/``DataConfig``: lr 1e-4, warmup 1.5 %, batch 1, TTT 7, gradient clip 0.5, cosine to 0,
  weight decay 0, torch's AdamW betas, step-loss decay 0.8) and its own draft config for the target (the final
  RMSNorm before lm_head - ``norm_output`` absent means True -, no ``fc_norm``, pad id 0, a fresh lm_head and
  norm, the target's embeddings loaded and frozen).
- ``specforge-matched``: + the run's learning rate, TTT depth and batch size (what aerie trains with).
- ``+head``: lm_head and the final norm start from the target's (aerie's ``init_head_from_target``).
- ``+rows``: the loss divided by the supervised rows (SpecForge divides by all B*T rows).
- ``+mask``: the loss mask on the predicted token (SpecForge's row t learns token t+2 but is masked by token t:
  it never trains the first two response tokens and trains past the turn end).
- ``+betas``: AdamW betas (0.9, 0.95) (SpecForge: torch's (0.9, 0.999)).
- ``+schedule``: aerie's schedule, warmup 3 % of the steps and a cosine floor of 0.1 x lr (SpecForge: 1.5 %, 0).
The last rung is aerie's recipe in SpecForge's code, up to initialisation and batch order. Off the ladder, run
last: ``specforge-matched-norm-off`` and ``specforge-matched+head-norm-off``, those two rungs with SpecForge's final
norm switched off (``norm_output`` False: how issue 15 ran every SpecForge arm), each compared with its ladder arm.

Kept apart from SpecForge's defaults on purpose, in every SpecForge arm (and recorded in every result file): the
data, held-out split and draft vocabulary (shared with aerie); the epochs and maximum length (shared; 1 epoch and
2048 are SpecForge's defaults too); the attention kernel ``sdpa`` (one SpecForge supports) instead of its default
``flex_attention`` (a compiled kernel); fp32 instead of bf16 with ``--specforge-dtype float32`` (a CPU without
bf16 units trains bf16 ~10x slower; bench/RESULTS.md has a bf16 check); the seed (per run, not its 42). Top-k
targets are no rung: on ``full`` shards aerie's targets are the full softmax, as SpecForge's (top-k is aerie's
``compact`` layout, which SpecForge cannot read).

Results: with ``--results DIR --run NAME`` every finished arm x seed is written to ``DIR/NAME/ARM/seed-N.json``
(the figures, the arm's effective settings, the command, the code commit, the data's file hashes, the machine's
load) and never recomputed: the same command again skips it, so a killed run resumes where it stopped; a file
made from other data or settings is an error, not skipped. Seeds run in order, every arm at a seed before the
next seed, so a partial run still gives complete paired seeds. ``python bench/tables.py`` regenerates the
RESULTS tables from those files.

SpecForge is not an aerie dependency and never enters the default test path. It pins torch, transformers
and sglang versions that a CPU box does not need, so it is installed without dependencies into a folder of
its own, and two documented shims make its training path run on a CPU (nothing else is changed):

    .venv/bin/pip install --no-deps --target /tmp/specforge-site specforge==0.2.0
    .venv/bin/python bench/peer_training.py --specforge-site /tmp/specforge-site \\
        --target results/demo-target --hidden 'results/*/hidden/shard-*.safetensors' --seeds 0 1 2 3 4 \\
        --ttt 3 --lr 1e-3 --bench-prompts 'results/tasks/prompts/bench.jsonl' \\
        --results bench/results/peer_training --run NAME

(the demo built with ``hidden.layout: full``; bench/results/peer_training/NAME/README.md says how a committed
run's data was built; bench/RESULTS.md has the figures).

Shims: (1) ``triton`` is replaced by an import-only stub module (SpecForge imports it at module level for its
GPU loss kernel); (2) that kernel's autograd function ``LogSoftmaxLoss`` is replaced by SpecForge's own
eager reference formula (``specforge.core.loss._compute_loss``: masked soft cross-entropy averaged over
all B*T rows, exactly what the kernel computes), and ``torch.compile`` is the identity while SpecForge
imports (its compiled helpers run eager on a CPU).

The draft vocabulary is ``--vocab`` (an ``aerie.draft-vocab/1`` file, e.g. results/vocab/draft_vocab.safetensors)
or, without it, the target's whole vocabulary (d2t all zero, t2d all true). Hidden shards must be of the
``full`` layout (SpecForge re-runs the target head over the final hidden state).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import glob
import json
import math
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's aerie, installed or not
sys.path.insert(0, str(REPO / "bench"))

from run_record import code_identity, command_line, file_identity, machine, machine_load, write_json_atomic

from aerie.drafter.config import TrainConfig
from aerie.drafter.data import batches, load_batch, make_windows, split_heldout
from aerie.drafter.loop import train_drafter
from aerie.drafter_kinds.eagle3.evaluate import evaluate
from aerie.drafter_kinds.eagle3.training import build as build_drafter
from aerie.drafter_kinds.eagle3.training import export as export_drafter
from aerie.formats.hidden import HiddenShard, open_hidden_shards
from aerie.formats.vocab import load_draft_vocab

RESULT_FORMAT = "aerie.peer-training-result/1"


@dataclass(frozen=True)
class SpecForgeArm:
    """One SpecForge setup: its loop and classes at its defaults, with some of aerie's choices switched in."""

    changes: str  # the one thing this rung changes from the rung above it (the table's column)
    run_hparams: bool = False  # the run's lr, TTT depth and batch size instead of SpecForge's defaults
    head_from_target: bool = False
    loss_over_supervised_rows: bool = False
    mask_on_predicted_token: bool = False
    aerie_betas: bool = False  # AdamW betas (0.9, 0.95)
    aerie_schedule: bool = False  # aerie's warmup share and cosine floor (min_lr_ratio)
    norm_before_lm_head: bool = True  # SpecForge's default; False only in the diagnostic arms (issue 15's setting)
    compare_to: str = ""  # a diagnostic arm: the ladder arm it differs from (in that one setting)


def _ladder() -> dict[str, SpecForgeArm]:
    """The SpecForge arms in rung order, each the one above it plus one change."""
    rungs = [
        ("specforge-default", {}, "SpecForge 0.2.0 at its own defaults"),
        ("specforge-matched", {"run_hparams": True}, "the run's learning rate, TTT depth and batch size"),
        ("+head", {"head_from_target": True}, "lm_head and final norm start from the target's"),
        ("+rows", {"loss_over_supervised_rows": True}, "loss divided by the supervised rows, not all B*T rows"),
        ("+mask", {"mask_on_predicted_token": True}, "loss mask on the predicted token, not on token t"),
        ("+betas", {"aerie_betas": True}, "AdamW betas (0.9, 0.95), not (0.9, 0.999)"),
        ("+schedule", {"aerie_schedule": True}, "warmup 3 % and cosine floor 0.1 x lr, not 1.5 % and 0"),
    ]
    arms: dict[str, SpecForgeArm] = {}
    name, flags = "", {}
    for rung, change, text in rungs:
        name = name + rung if rung.startswith("+") else rung
        flags = {**flags, **change}
        arms[name] = SpecForgeArm(changes=text, **flags)
    return arms


def _diagnostics(ladder: dict[str, SpecForgeArm]) -> dict[str, SpecForgeArm]:
    """Off the ladder: two rungs with SpecForge's final norm off, as issue 15 ran every SpecForge arm, to measure
    what that setting alone moves (run last; each compared with its ladder arm)."""
    return {
        f"{base}-norm-off": dataclasses.replace(
            ladder[base],
            norm_before_lm_head=False,
            compare_to=base,
            changes=f"final norm before lm_head off (issue 15's setting), else `{base}`",
        )
        for base in ("specforge-matched", "specforge-matched+head")
    }


LADDER = _ladder()
SPECFORGE_ARMS = {**LADDER, **_diagnostics(LADDER)}
ARMS = ("aerie", *SPECFORGE_ARMS)
AERIE_BETAS = (0.9, 0.95)  # aerie.drafter.loop's AdamW betas


# ---- data: aerie hidden shards -> SpecForge's offline samples ----------------------------------------------
def specforge_sample(
    shard: HiddenShard, seq: int, mask_on_predicted_token: bool = False, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """One sequence of an aerie ``full`` hidden shard as the dict SpecForge's offline capture writes per sample
    (``OfflineEagle3Dataset.process_data`` reads it): ids and loss mask [T], the final hidden state [1, T, H]
    (SpecForge's ``hidden_state``, its target) and the concatenated aux layers [1, T, A*H].

    SpecForge's row t reads token t+1 and learns token t+2 (its target head shifts ids and targets by one) but
    is masked by ``loss_mask[t]``, the mask of token t. ``mask_on_predicted_token`` stores ``loss_mask[t+2]``
    at t instead (zeros for the last two rows, which predict past the sequence): aerie's rule, "supervised when
    the predicted token was generated", in SpecForge's indexing; its later TTT steps shift the mask themselves.
    Features are stored in ``dtype``: SpecForge's model computes in the dtype of what it is fed."""
    if shard.layout != "full":
        raise ValueError(f"{shard.path}: layout {shard.layout!r}; SpecForge needs the final hidden state (full)")
    start, end = int(shard.seq_offsets[seq]), int(shard.seq_offsets[seq + 1])
    mask = shard.loss_mask[start:end].long()
    if mask_on_predicted_token:
        mask = torch.cat([mask[2:], mask.new_zeros(min(2, len(mask)))])
    return {
        "input_ids": shard.input_ids[start:end].clone(),
        "loss_mask": mask,
        "hidden_state": shard.rows("final_hidden_states", start, end).to(dtype)[None],
        "aux_hidden_state": shard.aux_rows(start, end, dtype)[None],
    }


def write_specforge_samples(
    shards: list[HiddenShard],
    keep: list[tuple[int, int]],
    folder: Path,
    mask_on_predicted_token: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> list[Path]:
    """Write the kept (shard, sequence) pairs as SpecForge sample files ``data_NNNNN.ckpt`` (torch.save)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (si, seq) in enumerate(keep):
        path = folder / f"data_{i:05d}.ckpt"
        torch.save(specforge_sample(shards[si], seq, mask_on_predicted_token, dtype), path)
        paths.append(path)
    return paths


def loss_over_supervised_rows(
    logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor
) -> torch.Tensor:
    """SpecForge's masked soft cross-entropy (``_compute_loss``) divided by the supervised rows, as aerie's loss
    is, instead of by all B*T rows (the ``+rows`` rung)."""
    plogp = target_p * torch.log_softmax(logits.float(), dim=-1)
    return -(position_mask * plogp).sum() / position_mask.sum().clamp_min(1.0)


# ---- SpecForge on a CPU: the two shims -------------------------------------------------------------------
def install_specforge(site: Path) -> types.SimpleNamespace:
    """Import SpecForge's training classes from ``site`` with the CPU shims (see the module docstring)."""
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    import torch._dynamo  # noqa: F401 - these probe for a real triton at import: they must see none
    import transformers.modeling_utils  # noqa: F401

    if "triton" not in sys.modules:
        triton = types.ModuleType("triton")
        language = types.ModuleType("triton.language")
        triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
        triton.next_power_of_2 = lambda n: 1 << max(0, math.ceil(math.log2(max(1, n))))
        language.constexpr = int
        triton.language = language
        sys.modules.update({"triton": triton, "triton.language": language})
    # SpecForge decorates small helpers with torch.compile at import; on a CPU they run eager (exact, and no
    # inductor, which would probe for a real triton): the decorator is the identity while SpecForge imports.
    compile_ = torch.compile
    torch.compile = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    try:
        import specforge
        import specforge.algorithms.eagle3.model as eagle3_model
        import specforge.core.loss as sf_loss
        from specforge.algorithms.eagle3.providers import algorithm_providers
        from specforge.config.schema import Config, DataConfig, ModelConfig, TrainingConfig
        from specforge.data.preprocessing import OfflineEagle3Dataset
        from specforge.data.utils import DataCollatorWithPadding
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
        from specforge.modeling.target.target_head import TargetHead as SFTargetHead
        from specforge.optimizer import BF16Optimizer
        from specforge.runtime.contracts import TrainBatch
        from specforge.training.model_loading import resolve_draft_config
        from specforge.training.strategies.base import Eagle3TrainStrategy
    finally:
        torch.compile = compile_
    eagle3_model.LogSoftmaxLoss = types.SimpleNamespace(apply=sf_loss._compute_loss)
    return types.SimpleNamespace(
        version=getattr(specforge, "__version__", None) or _dist_version(site),
        eagle3_model=eagle3_model,
        loss_over_all_rows=sf_loss._compute_loss,
        OfflineEagle3Dataset=OfflineEagle3Dataset,
        DataCollatorWithPadding=DataCollatorWithPadding,
        LlamaForCausalLMEagle3=LlamaForCausalLMEagle3,
        OnlineEagle3Model=eagle3_model.OnlineEagle3Model,
        TargetHead=SFTargetHead,
        BF16Optimizer=BF16Optimizer,
        TrainBatch=TrainBatch,
        Eagle3TrainStrategy=Eagle3TrainStrategy,
        Config=Config,
        TrainingConfig=TrainingConfig,
        DataConfig=DataConfig,
        ModelConfig=ModelConfig,
        resolve_draft_config=resolve_draft_config,
        draft_config_provider=algorithm_providers().model.draft_config,
    )


def _dist_version(site: Path) -> str | None:
    """The installed distribution's version from its ``.dist-info`` folder name in the ``--target`` folder."""
    found = sorted(site.glob("specforge-*.dist-info"))
    return found[0].name[len("specforge-") : -len(".dist-info")] if found else None


# ---- SpecForge's defaults, read from SpecForge -------------------------------------------------------------
def specforge_defaults(sf: Any) -> dict:
    """SpecForge's training defaults as its config schema and classes declare them (nothing typed in here):
    ``TrainingConfig``/``DataConfig`` field defaults, ``Eagle3TrainStrategy``'s step-loss decay, and the
    AdamW betas ``BF16Optimizer`` leaves at torch's default."""
    import inspect

    train = {k: f.default for k, f in sf.TrainingConfig.model_fields.items()}
    data = {k: f.default for k, f in sf.DataConfig.model_fields.items()}
    optimizer = inspect.signature(sf.BF16Optimizer.__init__).parameters
    strategy = inspect.signature(sf.Eagle3TrainStrategy.__init__).parameters
    return {
        "learning_rate": train["learning_rate"],
        "warmup_ratio": train["warmup_ratio"],
        "batch_size": train["batch_size"],
        "ttt_length": train["ttt_length"],
        "num_epochs": train["num_epochs"],
        "max_grad_norm": train["max_grad_norm"],
        "lr_scheduler": train["lr_scheduler"],
        "attention_backend": train["attention_backend"],
        "lk_loss_type": train["lk_loss_type"],
        "kl_scale": train["kl_scale"],
        "kl_decay": train["kl_decay"],
        "compact_teacher": train["compact_teacher"],
        "max_length": data["max_length"],
        "torch_dtype": sf.ModelConfig.model_fields["torch_dtype"].default,
        "weight_decay": optimizer["weight_decay"].default,
        "betas": list(inspect.signature(torch.optim.AdamW.__init__).parameters["betas"].default),
        "cosine_floor": 0.0,  # CosineAnnealingWarmupLR's eta_min; BF16Optimizer passes none
        "ploss_decay": strategy["ploss_decay"].default,
        "seed": train["seed"],
    }


def specforge_arm_settings(defaults: dict, arm: SpecForgeArm, cfg: TrainConfig, dtype: str) -> dict:
    """What one SpecForge arm trains with: SpecForge's defaults, the arm's changes, and the settings every arm
    shares on purpose (``kept_apart`` names those that differ from SpecForge's defaults)."""
    s = dict(defaults)
    if arm.run_hparams:
        s.update(learning_rate=cfg.learning_rate, ttt_length=cfg.ttt_steps, batch_size=cfg.batch_size)
    if arm.aerie_betas:
        s["betas"] = list(AERIE_BETAS)
    if arm.aerie_schedule:
        s.update(warmup_ratio=cfg.warmup_ratio, cosine_floor=cfg.min_lr_ratio)
    s.update(
        head_from_target=arm.head_from_target,
        loss_over_supervised_rows=arm.loss_over_supervised_rows,
        mask_on_predicted_token=arm.mask_on_predicted_token,
        norm_before_lm_head=arm.norm_before_lm_head,
    )
    shared = {
        "num_epochs": cfg.epochs,
        "max_length": cfg.max_seq_len,
        "attention_backend": "sdpa",
        "torch_dtype": dtype,
        "seed": cfg.seed,
    }
    kept_apart = {k: v for k, v in shared.items() if defaults.get(k) != v}
    s.update(shared)
    s["kept_apart_from_defaults"] = sorted(kept_apart)
    return s


def specforge_draft_config(sf: Any, target: Path, draft_vocab_size: int) -> Any:
    """The draft config ``specforge train`` generates for this target when given none (its own generator: the
    target's architecture fields, one layer, pad id 0 when the target has none, no ``norm_output`` key - the
    model then applies its final norm before lm_head - and no ``fc_norm``), with the run's draft vocabulary."""
    cfg = sf.Config(model={"target_model_path": str(target)}, data={"hidden_states_path": str(target)})
    config = sf.resolve_draft_config(cfg, provider=sf.draft_config_provider)
    config.draft_vocab_size = draft_vocab_size  # the shared draft vocabulary (SpecForge's generator says 32000)
    return config


def check_same_shape(config: Any, dcfg: Any) -> None:
    """SpecForge's drafter must be loadable into aerie's (the judge): the same shape, field by field."""
    pairs = {
        "hidden_size": (config.hidden_size, dcfg.hidden_size),
        "intermediate_size": (config.intermediate_size, dcfg.intermediate_size),
        "num_attention_heads": (config.num_attention_heads, dcfg.num_attention_heads),
        "num_key_value_heads": (config.num_key_value_heads, dcfg.num_key_value_heads),
        "head_dim": (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            dcfg.head_dim,
        ),
        "vocab_size": (config.vocab_size, dcfg.vocab_size),
        "draft_vocab_size": (config.draft_vocab_size, dcfg.draft_vocab_size),
        "rms_norm_eps": (config.rms_norm_eps, dcfg.rms_norm_eps),
    }
    wrong = {k: v for k, v in pairs.items() if v[0] != v[1]}
    if wrong:
        raise ValueError(f"SpecForge's draft config for this target differs from aerie's drafter: {wrong}")


def specforge_drafter(
    sf: Any, config: Any, target: Path, vocab: Any, heads: Any, seed: int, arm: SpecForgeArm, dtype: torch.dtype
) -> Any:
    """SpecForge's drafter as ``specforge train`` builds it (its class from its draft config, the target's
    embeddings loaded and frozen, the draft vocabulary's maps), with the target's head when the arm says so; the
    diagnostic arms set ``norm_output`` False (SpecForge then feeds lm_head the un-normed state)."""
    if not arm.norm_before_lm_head:
        config = copy.deepcopy(config)
        config.norm_output = False
    torch.manual_seed(seed)
    model = sf.LlamaForCausalLMEagle3(config, attention_backend="sdpa")
    model.load_embedding(str(target))
    model.freeze_embedding()
    with torch.no_grad():
        model.d2t.copy_(vocab.d2t)
        model.t2d.copy_(vocab.t2d)
        if arm.head_from_target:
            model.lm_head.weight.copy_(heads.lm_head[vocab.target_ids])
            model.norm.weight.copy_(heads.norm)
    return model.to(dtype)


def specforge_target_head(sf: Any, target: Path, lm_head: torch.Tensor, dtype: torch.dtype) -> Any:
    """SpecForge's frozen TargetHead (its loader wants a sharded checkpoint index; the weight is set directly)."""
    head = sf.TargetHead(str(target))
    with torch.no_grad():
        head.fc.weight.copy_(lm_head)
    head.freeze_weights()
    return head.eval().to(dtype)


def train_specforge(sf: Any, samples: list[Path], model: Any, target_head: Any, s: dict) -> dict:
    """SpecForge's loop, single process: dataset -> collator -> strategy loss -> BF16Optimizer step, at the
    settings ``s`` (``specforge_arm_settings``)."""
    sf.eagle3_model.LogSoftmaxLoss = types.SimpleNamespace(
        apply=loss_over_supervised_rows if s["loss_over_supervised_rows"] else sf.loss_over_all_rows
    )
    dataset = sf.OfflineEagle3Dataset([str(p) for p in samples], max_len=s["max_length"])
    collate = sf.DataCollatorWithPadding()
    batch_size, epochs = s["batch_size"], s["num_epochs"]
    steps_per_epoch = math.ceil(len(dataset) / batch_size)
    total = steps_per_epoch * epochs
    eagle = sf.OnlineEagle3Model(
        model,
        length=s["ttt_length"],
        attention_backend=s["attention_backend"],
        lk_loss_type=s["lk_loss_type"],
        kl_scale=s["kl_scale"],
        kl_decay=s["kl_decay"],
    )
    strategy = sf.Eagle3TrainStrategy(
        eagle, target_head=target_head, ploss_decay=s["ploss_decay"], compact_teacher=s["compact_teacher"]
    )
    opt = sf.BF16Optimizer(
        model,
        lr=s["learning_rate"],
        weight_decay=s["weight_decay"],
        max_grad_norm=s["max_grad_norm"],
        total_steps=total,
        warmup_ratio=s["warmup_ratio"],
        lr_scheduler=s["lr_scheduler"],
    )
    for group in opt.optimizer.param_groups:
        group["betas"] = tuple(s["betas"])
    # the cosine stage's floor; set before any step, so its recursive form decays to it exactly
    opt.scheduler.after_scheduler.eta_min = s["learning_rate"] * s["cosine_floor"]
    gen = torch.Generator().manual_seed(s["seed"])
    rows = seconds = 0.0
    losses = []
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(dataset), generator=gen).tolist()
        for b in range(steps_per_epoch):
            t0 = time.perf_counter()
            items = [dataset[i] for i in order[b * batch_size : (b + 1) * batch_size]]
            batch = collate(items)
            out = strategy.forward_loss(
                sf.TrainBatch(sample_ids=[], strategy="eagle3", tensors=batch, metadata={"target_repr": "hidden_state"})
            )
            out.loss.backward()
            opt.step()
            seconds += time.perf_counter() - t0
            rows += float(batch["attention_mask"].sum())
            losses.append(float(out.loss.detach()))
    return {"tokens_per_s": rows / seconds if seconds else 0.0, "optimizer_steps": total, "final_loss": losses[-1]}


def specforge_into_aerie(model: Any, aerie_model: Any) -> None:
    """Load SpecForge's trained weights into aerie's drafter (the same tensor names: SGLang's layout)."""
    state = {k: v.float() for k, v in model.state_dict().items() if "rotary_emb" not in k}
    missing, unexpected = aerie_model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"SpecForge -> aerie drafter: missing {missing}, unexpected {unexpected}")


# ---- smoke data: a tiny random target's real hidden states on random sequences ---------------------------
SMOKE_TARGET = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
SMOKE_AUX_IDS = [0, 1, 2]


@torch.no_grad()
def smoke_data(folder: Path, seqs: int, seq_len: int) -> tuple[Path, Path]:
    """A random 4-layer Llama target and one ``full`` hidden shard of its own hidden states on random token
    sequences (first 40 % prompt, the rest loss-masked): checks that every arm runs, in minutes. The target's
    next tokens are a fixed function of its features, so drafters learn something, but the acceptance figures
    say nothing about real text: use the demo's shards (--hidden) for that."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    target = folder / "smoke-target"
    model = LlamaForCausalLM(LlamaConfig(**SMOKE_TARGET)).eval()
    model.save_pretrained(target)
    ids = torch.randint(0, SMOKE_TARGET["vocab_size"], (seqs, seq_len))
    out = model(input_ids=ids, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i + 1] for i in SMOKE_AUX_IDS], dim=-1)  # aerie's capture convention
    mask = torch.zeros(seq_len, dtype=torch.uint8)
    mask[int(0.4 * seq_len) :] = 1
    shard = folder / "smoke-shard-00000.safetensors"
    H = SMOKE_TARGET["hidden_size"]
    save_file(
        {
            "input_ids": ids.reshape(-1).to(torch.int32),
            "loss_mask": mask.repeat(seqs),
            "seq_offsets": torch.arange(seqs + 1, dtype=torch.int64) * seq_len,
            "aux_hidden_states": aux.reshape(-1, len(SMOKE_AUX_IDS) * H).to(torch.bfloat16),
            "final_hidden_states": out.hidden_states[-1].reshape(-1, H).to(torch.bfloat16),
        },
        str(shard),
        metadata={
            "format": "aerie.hidden/1",
            "aux_layer_ids": json.dumps(SMOKE_AUX_IDS),
            "hidden_size": str(H),
            "vocab_size": str(SMOKE_TARGET["vocab_size"]),
            "num_hidden_layers": str(SMOKE_TARGET["num_hidden_layers"]),
            "target": str(target),
            "sample_ids": json.dumps([f"smoke/{i}" for i in range(seqs)]),
        },
    )
    return shard, target


# ---- the run ---------------------------------------------------------------------------------------------
def full_vocab(vocab_size: int, folder: Path) -> Path:
    """The target's whole vocabulary as a draft vocabulary (no mapping), in aerie's draft-vocab format."""
    path = folder / "draft_vocab_full.safetensors"
    save_file(
        {"d2t": torch.zeros(vocab_size, dtype=torch.int64), "t2d": torch.ones(vocab_size, dtype=torch.bool)},
        str(path),
        metadata={"format": "aerie.draft-vocab/1"},
    )
    return path


def bench_drafter(args: argparse.Namespace, drafter_dir: Path) -> dict:
    """Decode the benchmark prompts with ``drafter_dir`` and without through aerie.benchmark.run_benchmark (the demo's
    bench rule's function; no reference drafters): measured acceptance, tokens/s, speedup, lossless."""
    from aerie.benchmark.run import run_benchmark
    from aerie.benchmark.settings import BenchRun, TargetLoad

    report = run_benchmark(
        TargetLoad(Path(args.target), "cpu", "float32"),
        {"drafter": drafter_dir},
        bench_files(args),
        drafter_dir / "bench.json",
        BenchRun(
            max_new_tokens=args.bench_max_new_tokens,
            num_draft_steps=args.ttt,
            threads=args.threads,
            max_prompts=args.bench_max_prompts,
            references=(),
        ),
        log=lambda _: None,
    )
    mine = report["methods"]["drafter"]
    return {
        "measured_acceptance_length": mine["acceptance_length"],
        "measured_acceptance_per_position": mine["acceptance_per_position"],
        "bench_tokens_per_s": mine["tokens_per_s"],
        "bench_baseline_tokens_per_s": report["baseline"]["tokens_per_s"],
        "bench_speedup": mine["speedup"],
        "bench_lossless": report["lossless"],
    }


def bench_files(args: argparse.Namespace) -> list[Path]:
    return [Path(p) for p in sorted(glob.glob(args.bench_prompts))] if args.bench_prompts else []


def train_config(args: argparse.Namespace, seed: int) -> TrainConfig:
    """aerie's settings at one seed: its defaults but for the run's settings."""
    return TrainConfig.of(
        epochs=args.epochs,
        seed=seed,
        ttt_steps=args.ttt,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        eval_fraction=args.eval_fraction,
        threads=args.threads,
        resume=False,
        checkpoint_every=0,
        max_seq_len=args.max_len,
    )


def run_settings(args: argparse.Namespace) -> dict:
    """The settings every arm of a run shares: results made with other ones are another run."""
    keys = ("epochs", "ttt", "batch_size", "lr", "eval_fraction", "max_len", "threads", "specforge_dtype")
    bench = ("bench_max_prompts", "bench_max_new_tokens") if args.bench_prompts else ()
    return {k: getattr(args, k) for k in (*keys, *bench)}


def data_identity(shard_paths: list[Path], target: Path, vocab: Path | None, bench: list[Path]) -> dict:
    """Hashes of every input file: a result file is only reused for exactly these inputs."""
    shards = open_hidden_shards(shard_paths)
    return {
        "hidden": [file_identity(p) for p in shard_paths],
        "target": [file_identity(target / n) for n in ("config.json", "model.safetensors") if (target / n).exists()],
        "vocab": file_identity(vocab) if vocab else "the target's whole vocabulary",
        "bench_prompts": [file_identity(p) for p in bench],
        "sequences": sum(s.num_seqs for s in shards),
        "tokens": sum(len(s.input_ids) for s in shards),
        "supervised_tokens": int(sum(int(s.loss_mask.sum()) for s in shards)),
    }


def result_path(args: argparse.Namespace, arm: str, seed: int) -> Path:
    return args.results / args.run / arm / f"seed-{seed}.json"


def finished(args: argparse.Namespace, arm: str, seed: int, identity: dict) -> bool:
    """True when this arm x seed has its result file from the same data and settings (never recomputed);
    a result file from other data or settings is an error: the run name says which data the figures are on."""
    path = result_path(args, arm, seed)
    if not path.exists():
        return False
    old = json.loads(path.read_text())
    same_data = [f["sha256"] for f in old["data"]["hidden"]] == [f["sha256"] for f in identity["hidden"]]
    same_data = same_data and old["data"]["target"] == identity["target"]
    if not same_data or old["run_settings"] != run_settings(args):
        raise SystemExit(
            f"{path}: made from other data or settings than this command's (settings {old['run_settings']} vs "
            f"{run_settings(args)}); use another --run name or remove the run's folder"
        )
    return True


def run_seed(
    sf: Any,
    seed: int,
    arms: list[str],
    args: argparse.Namespace,
    shard_paths: list[Path],
    vocab_path: Path,
    work: Path,
    on_arm: Callable[[str, dict, dict, dict], None],
) -> None:
    """The given arms at one seed, one after the other (aerie first), each scored by the same judges;
    ``on_arm(arm, figures, settings, extra)`` after each (so a long run keeps what it finished)."""
    from aerie.target_model.heads import read_target_heads

    cfg = train_config(args, seed)
    if "aerie" in arms:
        t0 = time.perf_counter()
        out_dir = work / f"aerie-{seed}"
        out = train_drafter(shard_paths, vocab_path, args.target, out_dir, cfg, log=lambda _: None)
        figures = {**out, "wall_s": time.perf_counter() - t0}
        if args.bench_prompts:
            figures.update(bench_drafter(args, out_dir))
            figures["wall_s"] = time.perf_counter() - t0
        on_arm("aerie", figures, dataclasses.asdict(cfg), {})
    sf_arms = [a for a in arms if a in SPECFORGE_ARMS]
    if not sf_arms:
        return

    shards = open_hidden_shards(shard_paths)
    held = split_heldout(shards, cfg.eval_fraction, cfg.seed)  # the split aerie uses at this seed
    train_seqs = [(si, q) for si, sh in enumerate(shards) for q in range(sh.num_seqs) if (si, q) not in held]
    dtype = getattr(torch, args.specforge_dtype)
    samples = {
        shifted: write_specforge_samples(
            shards, train_seqs, work / f"specforge-samples-{seed}-{int(shifted)}", shifted, dtype
        )
        for shifted in sorted({SPECFORGE_ARMS[a].mask_on_predicted_token for a in sf_arms})
    }
    vocab = load_draft_vocab(vocab_path)
    aux_ids = shards[0].aux_layer_ids
    judge, dcfg, aerie_head = build_drafter(Path(args.target), vocab, aux_ids, cfg, "full", torch.device("cpu"))
    heads = read_target_heads(args.target, ["embed", "norm", "lm_head"])
    lm_head = aerie_head.full
    eval_w = [
        w
        for si, sh in enumerate(shards)
        for q in range(sh.num_seqs)
        if (si, q) in held
        for w in make_windows(si, sh, q, cfg.max_seq_len, cfg.ttt_steps + 1)
    ]
    eval_groups = batches(eval_w, cfg, None)
    sf_head = specforge_target_head(sf, args.target, lm_head, dtype)
    draft_config = specforge_draft_config(sf, args.target, len(vocab.d2t))
    check_same_shape(draft_config, dcfg)
    defaults = specforge_defaults(sf)
    for arm in sf_arms:
        t0 = time.perf_counter()
        settings = specforge_arm_settings(defaults, SPECFORGE_ARMS[arm], cfg, args.specforge_dtype)
        model = specforge_drafter(sf, draft_config, args.target, vocab, heads, seed, SPECFORGE_ARMS[arm], dtype)
        trained = train_specforge(sf, samples[settings["mask_on_predicted_token"]], model, sf_head, settings)
        specforge_into_aerie(model, judge)
        cpu = torch.device("cpu")
        capacity = cfg.max_seq_len if cfg.packing else None
        heldout = (load_batch(g, shards, cfg.ttt_steps + 1, cpu, torch.float32, capacity) for g in eval_groups)
        scored = evaluate(judge.eval(), heldout, aerie_head, cfg.kind_settings, "chunked", cpu)
        figures = {**scored, **trained, "wall_s": time.perf_counter() - t0}
        if args.bench_prompts:
            out_dir = work / f"{arm}-{seed}"
            export_drafter(judge, out_dir, {"trained_by": f"SpecForge {sf.version} ({arm})"}, aux_ids)
            figures.update(bench_drafter(args, out_dir))
            figures["wall_s"] = time.perf_counter() - t0
        extra = {
            "specforge_version": sf.version,
            "specforge_defaults": defaults,
            "specforge_draft_config": {k: v for k, v in draft_config.to_dict().items() if not k.startswith("_")},
            "norm_before_lm_head": bool(model.norm_output),
        }
        on_arm(arm, figures, settings, extra)


def print_figures(seed: int, arm: str, r: dict) -> None:
    measured = (
        f"  measured {r['measured_acceptance_length']:.3f} at {r['bench_tokens_per_s']:.1f} tok/s "
        f"(speedup {r['bench_speedup']:.3f}, lossless {r['bench_lossless']})"
        if "measured_acceptance_length" in r
        else ""
    )
    print(
        f"seed {seed} {arm:<48} simulated {r['simulated_acceptance_length']:.3f}  "
        f"per position {[round(x, 3) for x in r['acceptance_per_position']]}  "
        f"{r['tokens_per_s']:.0f} train tok/s  {r['wall_s']:.0f} s{measured}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--specforge-site", type=Path, help="folder of `pip install --target` specforge (SpecForge arms)")
    ap.add_argument("--target", type=Path, help="the target's save_pretrained folder")
    ap.add_argument("--hidden", help="glob of aerie hidden shards (full layout)")
    ap.add_argument(
        "--smoke",
        type=int,
        nargs=2,
        metavar=("SEQS", "LEN"),
        help="instead of --target/--hidden: a random tiny target's hidden states on SEQS random sequences",
    )
    ap.add_argument("--vocab", type=Path, help="aerie draft vocab (default: the target's whole vocabulary)")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="which arms (default: all)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--epochs", type=int, default=1, help="1 (SpecForge's default): no best-epoch selection")
    ap.add_argument(
        "--lr",
        type=float,
        default=TrainConfig.learning_rate,
        help="aerie's and the matched arms' peak learning rate (specforge-default keeps SpecForge's)",
    )
    ap.add_argument("--ttt", type=int, default=7, help="TTT depth of aerie and the matched arms; drafts per step")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--eval-fraction", type=float, default=0.1)
    ap.add_argument("--max-len", type=int, default=2048, help="2048: aerie's and SpecForge's default")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--specforge-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="SpecForge's model and features: bfloat16 as it trains (slow on CPUs without bf16 units), or float32",
    )
    ap.add_argument(
        "--bench-prompts",
        help="glob of bench prompt files (e.g. 'results/*/prompts/bench.jsonl'): also decode with every drafter",
    )
    ap.add_argument("--bench-max-prompts", type=int, default=8)
    ap.add_argument("--bench-max-new-tokens", type=int, default=96)
    ap.add_argument("--work", type=Path, help="keep drafters and samples here (default: a temporary folder)")
    ap.add_argument("--results", type=Path, help="write one result file per arm x seed under RESULTS/RUN/")
    ap.add_argument("--run", help="the run's name under --results (one name per data set and settings)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if bool(args.results) != bool(args.run):
        raise SystemExit("--results and --run go together")
    if not args.smoke and not (args.target and args.hidden):
        raise SystemExit("give --target and --hidden (real shards), or --smoke SEQS LEN")
    if args.bench_prompts and args.smoke:
        raise SystemExit("--bench-prompts needs a real target (--target/--hidden): the smoke target has no tokenizer")
    if args.bench_prompts and not glob.glob(args.bench_prompts):
        raise SystemExit(f"--bench-prompts {args.bench_prompts!r}: no file matches")
    args.arms = [a for a in ARMS if a in args.arms]  # the documented order: aerie first, then the ladder
    sf = None
    if any(a in SPECFORGE_ARMS for a in args.arms):
        if not args.specforge_site:
            raise SystemExit("the SpecForge arms need --specforge-site (see the module docstring)")
        sf = install_specforge(args.specforge_site)
    with tempfile.TemporaryDirectory(prefix="aerie-peer-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.smoke:
            shard, args.target = smoke_data(work, *args.smoke)
            shard_paths = [shard]
        else:
            shard_paths = [Path(p) for p in sorted(glob.glob(args.hidden))]
            if not shard_paths:
                raise SystemExit(f"--hidden {args.hidden!r}: no shard matches")
        vocab = args.vocab or full_vocab(open_hidden_shards(shard_paths[:1])[0].vocab_size, work)
        identity = data_identity(shard_paths, args.target, args.vocab, bench_files(args)) if args.results else {}
        code = code_identity(REPO)
        for seed in args.seeds:
            todo = [a for a in args.arms if not (args.results and finished(args, a, seed, identity))]
            if not todo:
                print(f"seed {seed}: every arm already has its result file", flush=True)
                continue
            load_before = machine_load()
            started = time.time()

            def on_arm(arm: str, figures: dict, settings: dict, extra: dict, seed: int = seed) -> None:
                nonlocal load_before, started
                print_figures(seed, arm, figures)
                if args.results:
                    write_json_atomic(
                        result_path(args, arm, seed),
                        {
                            "format": RESULT_FORMAT,
                            "run": args.run,
                            "arm": arm,
                            "seed": seed,
                            "rung": ARMS.index(arm),
                            "changes": SPECFORGE_ARMS[arm].changes if arm in SPECFORGE_ARMS else "aerie's recipe",
                            "compare_to": SPECFORGE_ARMS[arm].compare_to if arm in SPECFORGE_ARMS else "",
                            "figures": figures,
                            "settings": settings,
                            **extra,
                            "run_settings": run_settings(args),
                            "data": identity,
                            "code": code,
                            "command": command_line(),
                            "machine": machine(),
                            "torch": torch.__version__,
                            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                            "load_before": load_before,
                            "load_after": machine_load(),
                        },
                    )
                load_before, started = machine_load(), time.time()

            run_seed(sf, seed, todo, args, shard_paths, vocab, work, on_arm)
    if args.results:
        from tables import peer_training_table

        print("\n" + peer_training_table(args.results / args.run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
