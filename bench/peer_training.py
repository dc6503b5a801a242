"""aerie's drafter training recipe side by side with SpecForge's, on the same hidden shards.

Both trainers get the same sequences, the same held-out split (aerie's, per seed), the same drafter shape
(SGLang's ``LlamaForCausalLMEagle3``: one decoder layer, the target's width and heads), the same draft
vocabulary and TTT depth. aerie trains with ``aerie.drafter.loop.train_drafter``; SpecForge trains with its
own classes in a single-process loop: ``OfflineEagle3Dataset`` (reading the samples converted to its offline
layout), ``DataCollatorWithPadding``, ``LlamaForCausalLMEagle3``, ``OnlineEagle3Model``,
``Eagle3TrainStrategy`` with its ``TargetHead``, and ``BF16Optimizer``. Every drafter is then scored by the
same judge, aerie's held-out simulation (``aerie.drafter.evaluate.evaluate``: acceptance length and
per-position acceptance of greedy chain drafting against the target's own next tokens). Trainers run
interleaved, seed by seed, so machine load drifts hit all of them alike.

Arms (each over every seed; ``--arms`` picks some):
- ``aerie``: aerie's defaults (head and norm initialised from the target, loss over supervised rows, ...).
- ``specforge-matched``: SpecForge with aerie's learning rate, warmup share, TTT depth and batch size.
- then a ladder, each rung adding one more of aerie's choices to SpecForge's loop (the ablations):
  ``+head`` lm_head/norm copied from the target; ``+rows`` loss normalised by the supervised rows instead of
  all B*T rows; ``+mask`` the loss mask on the predicted token (SpecForge's row t predicts token t+2 but is
  masked by token t: it never trains the first two response tokens and trains past the turn end); ``+adamw``
  AdamW betas (0.9, 0.95) and a cosine floor of ``min_lr_ratio`` (SpecForge: torch's (0.9, 0.999), floor 0).
  What is left between the last rung and ``aerie`` is precision (SpecForge's bf16 model, aerie's fp32 on a
  CPU; ``--specforge-dtype float32`` removes it) and initialisation/batch order. Top-k targets are no rung:
  on ``full`` shards aerie's targets are the full softmax, as SpecForge's (top-k targets are aerie's
  ``compact`` layout, which SpecForge cannot read).
- ``specforge-default``: SpecForge's defaults (lr 1e-4, warmup 1.5 %, batch 1, TTT 7).

With ``--bench-prompts``, every arm's drafter is also exported and decoded through
``aerie.bench.run.run_benchmark`` (the function the demo's bench rule runs): measured acceptance length,
tokens/s and speedup over the plain target, lossless check.

SpecForge is not an aerie dependency and never enters the default test path. It pins torch, transformers
and sglang versions that a CPU box does not need, so it is installed without dependencies into a folder of
its own, and two documented shims make its training path run on a CPU (nothing else is changed):

    .venv/bin/pip install --no-deps --target /tmp/specforge-site specforge==0.2.0
    .venv/bin/python bench/peer_training.py --specforge-site /tmp/specforge-site \\
        --target results/demo-target --hidden 'results/*/hidden/shard-*.safetensors' --seeds 0 1 2 \\
        --ttt 3 --lr 1e-3 --bench-prompts 'results/*/prompts/bench.jsonl' --json peer.json

(the demo built with ``hidden.layout: full``; bench/RESULTS.md has the figures and the exact command).
``--json`` is rewritten after every arm; ``--table a.json b.json`` prints the table of runs split over
processes (e.g. one per seed).

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
import glob
import json
import math
import statistics
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

from aerie.drafter.config import TrainConfig  # noqa: E402
from aerie.drafter.data import batches, make_windows, split_heldout  # noqa: E402
from aerie.drafter.evaluate import evaluate  # noqa: E402
from aerie.drafter.loop import build_drafter, export_drafter, train_drafter  # noqa: E402
from aerie.drafter.ttt import TargetHead  # noqa: E402
from aerie.formats.hidden import HiddenShard, open_hidden_shards  # noqa: E402
from aerie.formats.vocab import load_draft_vocab  # noqa: E402


@dataclass(frozen=True)
class SpecForgeArm:
    """One SpecForge setup: its loop and classes, with some of aerie's choices switched in (see the docstring)."""

    matched: bool  # aerie's lr, warmup share, TTT depth, batch size; else SpecForge's defaults
    head_from_target: bool = False
    loss_over_supervised_rows: bool = False
    mask_on_predicted_token: bool = False
    aerie_adamw: bool = False  # betas (0.9, 0.95) and the cosine floor min_lr_ratio


SPECFORGE_ARMS = {  # run in this order (the slowest, batch 1 and TTT 7, last)
    "specforge-matched": SpecForgeArm(matched=True),
    "specforge-matched+head": SpecForgeArm(matched=True, head_from_target=True),
    "specforge-matched+head+rows": SpecForgeArm(True, True, loss_over_supervised_rows=True),
    "specforge-matched+head+rows+mask": SpecForgeArm(True, True, True, mask_on_predicted_token=True),
    "specforge-matched+head+rows+mask+adamw": SpecForgeArm(True, True, True, True, aerie_adamw=True),
    "specforge-default": SpecForgeArm(matched=False),
}
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
        import specforge.algorithms.eagle3.model as eagle3_model
        import specforge.core.loss as sf_loss
        from specforge.data.preprocessing import OfflineEagle3Dataset
        from specforge.data.utils import DataCollatorWithPadding
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
        from specforge.modeling.target.target_head import TargetHead as SFTargetHead
        from specforge.optimizer import BF16Optimizer
        from specforge.runtime.contracts import TrainBatch
        from specforge.training.strategies.base import Eagle3TrainStrategy
    finally:
        torch.compile = compile_
    eagle3_model.LogSoftmaxLoss = types.SimpleNamespace(apply=sf_loss._compute_loss)
    return types.SimpleNamespace(
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
    )


def specforge_drafter(
    sf: Any, dcfg: Any, vocab: Any, heads: Any, seed: int, head_from_target: bool, dtype: torch.dtype
) -> Any:
    """SpecForge's drafter with aerie's drafter shape (same config numbers; next step reads the pre-norm hidden)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=dcfg.hidden_size,
        intermediate_size=dcfg.intermediate_size,
        num_attention_heads=dcfg.num_attention_heads,
        num_key_value_heads=dcfg.num_key_value_heads,
        head_dim=dcfg.head_dim,
        vocab_size=dcfg.vocab_size,
        rms_norm_eps=dcfg.rms_norm_eps,
        rope_theta=dcfg.rope_theta,
        max_position_embeddings=dcfg.max_position_embeddings,
        hidden_act="silu",
        num_hidden_layers=1,
        tie_word_embeddings=False,
        pad_token_id=None,
    )
    config.draft_vocab_size = dcfg.draft_vocab_size
    config.target_hidden_size = dcfg.hidden_size
    config.norm_output = dcfg.norm_output
    torch.manual_seed(seed)
    model = sf.LlamaForCausalLMEagle3(config, attention_backend="sdpa")
    with torch.no_grad():
        model.embed_tokens.weight.copy_(heads.embed)
        model.d2t.copy_(vocab.d2t)
        model.t2d.copy_(vocab.t2d)
        if head_from_target:
            model.lm_head.weight.copy_(heads.lm_head[vocab.target_ids])
            model.norm.weight.copy_(heads.norm)
    model.embed_tokens.weight.requires_grad = False  # SpecForge freezes the target's embeddings too
    return model.to(dtype)


def specforge_target_head(sf: Any, target: Path, lm_head: torch.Tensor, dtype: torch.dtype) -> Any:
    """SpecForge's frozen TargetHead (its loader wants a sharded checkpoint index; the weight is set directly)."""
    head = sf.TargetHead(str(target))
    with torch.no_grad():
        head.fc.weight.copy_(lm_head)
    head.freeze_weights()
    return head.eval().to(dtype)


def train_specforge(
    sf: Any,
    samples: list[Path],
    model: Any,
    target_head: Any,
    *,
    seed: int,
    epochs: int,
    batch_size: int,
    ttt_steps: int,
    lr: float,
    warmup_ratio: float,
    max_len: int,
    loss_over_rows: bool = False,
    aerie_adamw_floor: float | None = None,
) -> dict:
    """SpecForge's loop, single process: dataset -> collator -> strategy loss -> BF16Optimizer step.

    ``loss_over_rows``: the loss divided by the supervised rows (else SpecForge's all rows).
    ``aerie_adamw_floor``: AdamW betas (0.9, 0.95) and the cosine decaying to lr * this (else torch's betas, 0)."""
    sf.eagle3_model.LogSoftmaxLoss = types.SimpleNamespace(
        apply=loss_over_supervised_rows if loss_over_rows else sf.loss_over_all_rows
    )
    dataset = sf.OfflineEagle3Dataset([str(p) for p in samples], max_len=max_len)
    collate = sf.DataCollatorWithPadding()
    steps_per_epoch = math.ceil(len(dataset) / batch_size)
    total = steps_per_epoch * epochs
    eagle = sf.OnlineEagle3Model(model, length=ttt_steps, attention_backend="sdpa")
    strategy = sf.Eagle3TrainStrategy(eagle, target_head=target_head)
    opt = sf.BF16Optimizer(model, lr=lr, total_steps=total, warmup_ratio=warmup_ratio)
    if aerie_adamw_floor is not None:
        for group in opt.optimizer.param_groups:
            group["betas"] = AERIE_BETAS
        # the cosine stage's floor; set before any step, so its recursive form decays to it exactly
        opt.scheduler.after_scheduler.eta_min = lr * aerie_adamw_floor
    gen = torch.Generator().manual_seed(seed)
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
    """Decode the benchmark prompts with ``drafter_dir`` and without through aerie.bench.run_benchmark (the demo's
    bench rule's function; no reference drafters): measured acceptance, tokens/s, speedup, lossless."""
    from aerie.bench.run import run_benchmark

    prompt_files = [Path(p) for p in sorted(glob.glob(args.bench_prompts))]
    report = run_benchmark(
        args.target,
        drafter_dir,
        prompt_files,
        drafter_dir / "bench.json",
        max_new_tokens=args.bench_max_new_tokens,
        num_draft_steps=args.ttt,
        repeats=1,
        warmup=1,
        threads=args.threads,
        max_prompts=args.bench_max_prompts,
        references=(),
        log=lambda _: None,
    )
    return {
        "measured_acceptance_length": report["acceptance_length"],
        "measured_acceptance_per_position": report["acceptance_per_position"],
        "bench_tokens_per_s": report["speculative"]["tokens_per_s"],
        "bench_baseline_tokens_per_s": report["baseline"]["tokens_per_s"],
        "bench_speedup": report["speedup"],
        "bench_lossless": report["lossless"],
    }


def run_seed(
    sf: Any,
    seed: int,
    args: argparse.Namespace,
    shard_paths: list[Path],
    vocab_path: Path,
    work: Path,
    on_arm: Callable[[str, dict], None] = lambda arm, figures: None,
) -> dict[str, dict]:
    """Every chosen arm at one seed, one after the other (aerie first), each scored by the same judge;
    ``on_arm(arm, figures)`` after each (so a long run keeps what it finished)."""
    from aerie.target.heads import read_target_heads

    cfg = TrainConfig(
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
    results: dict[str, dict] = {}
    if "aerie" in args.arms:
        t0 = time.perf_counter()
        out_dir = work / f"aerie-{seed}"
        out = train_drafter(shard_paths, vocab_path, args.target, out_dir, cfg, log=lambda _: None)
        results["aerie"] = {**out, "wall_s": time.perf_counter() - t0}
        if args.bench_prompts:
            results["aerie"].update(bench_drafter(args, out_dir))
        on_arm("aerie", results["aerie"])
    sf_arms = [a for a in args.arms if a in SPECFORGE_ARMS]
    if not sf_arms:
        return results

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
    judge, dcfg, lm_head = build_drafter(args.target, vocab, aux_ids, cfg, need_lm_head=True)
    heads = read_target_heads(args.target, ["embed", "norm", "lm_head"])
    aerie_head = TargetHead(full=lm_head.float(), draft=lm_head[vocab.target_ids].float(), t2d=vocab.t2d)
    eval_w = [
        w
        for si, sh in enumerate(shards)
        for q in range(sh.num_seqs)
        if (si, q) in held
        for w in make_windows(si, sh, q, cfg.max_seq_len, cfg.ttt_steps)
    ]
    eval_groups = batches(eval_w, cfg, None)
    sf_head = specforge_target_head(sf, args.target, lm_head, dtype)
    for arm in sf_arms:
        s = SPECFORGE_ARMS[arm]
        t0 = time.perf_counter()
        model = specforge_drafter(sf, dcfg, vocab, heads, seed, s.head_from_target, dtype)
        trained = train_specforge(
            sf,
            samples[s.mask_on_predicted_token],
            model,
            sf_head,
            seed=seed,
            epochs=cfg.epochs,
            batch_size=cfg.batch_size if s.matched else 1,
            ttt_steps=cfg.ttt_steps if s.matched else 7,
            lr=cfg.learning_rate if s.matched else 1e-4,
            warmup_ratio=cfg.warmup_ratio if s.matched else 0.015,
            max_len=cfg.max_seq_len,
            loss_over_rows=s.loss_over_supervised_rows,
            aerie_adamw_floor=cfg.min_lr_ratio if s.aerie_adamw else None,
        )
        specforge_into_aerie(model, judge)
        scored = evaluate(judge.eval(), eval_groups, shards, aerie_head, cfg, torch.device("cpu"), torch.float32)
        results[arm] = {**scored, **trained, "wall_s": time.perf_counter() - t0}
        if args.bench_prompts:
            out_dir = work / f"{arm}-{seed}"
            export_drafter(judge, out_dir, aux_ids, {"trained_by": f"SpecForge 0.2.0 ({arm})"})
            results[arm].update(bench_drafter(args, out_dir))
        on_arm(arm, results[arm])
    return results


def spread(values: list[float], digits: int = 3) -> str:
    """``mean ± stdev`` (sample stdev over seeds), or the mean alone for one value."""
    mean = statistics.fmean(values)
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else f"{mean:.{digits}f}"


def summary_table(per_seed: dict[int, dict[str, dict]], arms: list[str]) -> str:
    """The side-by-side table over the seeds finished so far: mean ± stdev per arm."""
    seeds = sorted(per_seed)
    arms = [a for a in arms if all(a in per_seed[s] for s in seeds)]  # arms every seed finished
    benched = all("measured_acceptance_length" in per_seed[s][a] for s in seeds for a in arms)
    head = f"{'arm':<40} {'simulated acceptance':>22} {'train tokens/s':>18}"
    if benched:
        head += f" {'measured acceptance':>22} {'bench tok/s':>18} {'speedup':>16}"
    lines = [f"(mean ± stdev over seeds {seeds})", head]

    def col(arm: str, key: str, digits: int = 3) -> str:
        return spread([float(per_seed[s][arm][key]) for s in seeds], digits)

    for arm in arms:
        line = f"{arm:<40} {col(arm, 'simulated_acceptance_length'):>22} {col(arm, 'tokens_per_s', 0):>18}"
        if benched:
            line += (
                f" {col(arm, 'measured_acceptance_length'):>22} {col(arm, 'bench_tokens_per_s', 1):>18}"
                f" {col(arm, 'bench_speedup'):>16}"
            )
        per_pos = [statistics.fmean(p) for p in zip(*(per_seed[s][arm]["acceptance_per_position"] for s in seeds))]
        lines.append(f"{line}   per position {[round(x, 3) for x in per_pos]}")
    return "\n".join(lines)


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
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=1, help="1: no best-epoch selection on the held-out set")
    ap.add_argument(
        "--lr",
        type=float,
        default=TrainConfig.learning_rate,
        help="aerie's and the matched arms' peak learning rate (specforge-default keeps 1e-4)",
    )
    ap.add_argument("--ttt", type=int, default=7, help="TTT depth of aerie and the matched arms; drafts per step")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--eval-fraction", type=float, default=0.1)
    ap.add_argument("--max-len", type=int, default=2048)
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
    ap.add_argument("--json", type=Path, help="write every arm's figures per seed here (after every seed)")
    ap.add_argument(
        "--table",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="only print the table of earlier --json files (e.g. one process per seed), arms every seed finished",
    )
    args = ap.parse_args(argv)
    if args.table:
        merged: dict[int, dict[str, dict]] = {}
        for path in args.table:  # later files win for an arm a seed has twice
            for seed, arms in json.loads(path.read_text()).items():
                merged.setdefault(int(seed), {}).update(arms)
        print(summary_table(merged, list(ARMS)))
        return 0
    torch.set_num_threads(args.threads)
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
    per_seed: dict[int, dict[str, dict]] = {}
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
        for seed in args.seeds:
            per_seed[seed] = {}

            def on_arm(arm: str, r: dict, seed: int = seed) -> None:
                per_seed[seed][arm] = r
                measured = (
                    f"  measured {r['measured_acceptance_length']:.3f} at {r['bench_tokens_per_s']:.1f} tok/s "
                    f"(speedup {r['bench_speedup']:.3f}, lossless {r['bench_lossless']})"
                    if "measured_acceptance_length" in r
                    else ""
                )
                print(
                    f"seed {seed} {arm:<40} simulated {r['simulated_acceptance_length']:.3f}  "
                    f"per position {[round(x, 3) for x in r['acceptance_per_position']]}  "
                    f"{r['tokens_per_s']:.0f} train tok/s  {r['wall_s']:.0f} s{measured}",
                    flush=True,
                )
                if args.json:
                    args.json.write_text(json.dumps({str(k): v for k, v in per_seed.items()}, indent=1) + "\n")

            run_seed(sf, seed, args, shard_paths, vocab, work, on_arm)
    print("\n" + summary_table(per_seed, args.arms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
