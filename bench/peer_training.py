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

Arms (each over every seed):
- ``aerie``: aerie's defaults (head and norm initialised from the target, loss over supervised rows, ...).
- ``specforge-matched``: SpecForge with aerie's learning rate, warmup share, TTT depth and batch size.
- ``specforge-matched+head``: the same, with lm_head/norm copied from the target as aerie does.
- ``specforge-default``: SpecForge's defaults (lr 1e-4, warmup 1.5 %, batch 1, TTT 7).

SpecForge is not an aerie dependency and never enters the default test path. It pins torch, transformers
and sglang versions that a CPU box does not need, so it is installed without dependencies into a folder of
its own, and two documented shims make its training path run on a CPU (nothing else is changed):

    .venv/bin/pip install --no-deps --target /tmp/specforge-site specforge==0.2.0
    .venv/bin/python bench/peer_training.py --specforge-site /tmp/specforge-site \\
        --target results/demo-target --hidden 'results/*/hidden/shard-*.safetensors' --seeds 0 1 2

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
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's aerie, installed or not

from aerie.drafter.config import TrainConfig  # noqa: E402
from aerie.drafter.data import batches, make_windows, split_heldout  # noqa: E402
from aerie.drafter.evaluate import evaluate  # noqa: E402
from aerie.drafter.loop import build_drafter, train_drafter  # noqa: E402
from aerie.drafter.ttt import TargetHead  # noqa: E402
from aerie.formats.hidden import HiddenShard, open_hidden_shards  # noqa: E402
from aerie.formats.vocab import load_draft_vocab  # noqa: E402

ARMS = ("aerie", "specforge-matched", "specforge-matched+head", "specforge-default")


# ---- data: aerie hidden shards -> SpecForge's offline samples ----------------------------------------------
def specforge_sample(shard: HiddenShard, seq: int) -> dict[str, torch.Tensor]:
    """One sequence of an aerie ``full`` hidden shard as the dict SpecForge's offline capture writes per sample
    (``OfflineEagle3Dataset.process_data`` reads it): ids and loss mask [T], the final hidden state [1, T, H]
    (SpecForge's ``hidden_state``, its target) and the concatenated aux layers [1, T, A*H]."""
    if shard.layout != "full":
        raise ValueError(f"{shard.path}: layout {shard.layout!r}; SpecForge needs the final hidden state (full)")
    start, end = int(shard.seq_offsets[seq]), int(shard.seq_offsets[seq + 1])
    return {
        "input_ids": shard.input_ids[start:end].clone(),
        "loss_mask": shard.loss_mask[start:end].long(),
        "hidden_state": shard.rows("final_hidden_states", start, end).to(torch.bfloat16)[None],
        "aux_hidden_state": shard.aux_rows(start, end, torch.bfloat16)[None],
    }


def write_specforge_samples(shards: list[HiddenShard], keep: list[tuple[int, int]], folder: Path) -> list[Path]:
    """Write the kept (shard, sequence) pairs as SpecForge sample files ``data_NNNNN.ckpt`` (torch.save)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (si, seq) in enumerate(keep):
        path = folder / f"data_{i:05d}.ckpt"
        torch.save(specforge_sample(shards[si], seq), path)
        paths.append(path)
    return paths


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
        OfflineEagle3Dataset=OfflineEagle3Dataset,
        DataCollatorWithPadding=DataCollatorWithPadding,
        LlamaForCausalLMEagle3=LlamaForCausalLMEagle3,
        OnlineEagle3Model=eagle3_model.OnlineEagle3Model,
        TargetHead=SFTargetHead,
        BF16Optimizer=BF16Optimizer,
        TrainBatch=TrainBatch,
        Eagle3TrainStrategy=Eagle3TrainStrategy,
    )


def specforge_drafter(sf: Any, dcfg: Any, vocab: Any, heads: Any, seed: int, head_from_target: bool) -> Any:
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
    return model.to(torch.bfloat16)


def specforge_target_head(sf: Any, target: Path, lm_head: torch.Tensor) -> Any:
    """SpecForge's frozen TargetHead (its loader wants a sharded checkpoint index; the weight is set directly)."""
    head = sf.TargetHead(str(target))
    with torch.no_grad():
        head.fc.weight.copy_(lm_head)
    head.freeze_weights()
    return head.eval().to(torch.bfloat16)


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
) -> dict:
    """SpecForge's loop, single process: dataset -> collator -> strategy loss -> BF16Optimizer step."""
    dataset = sf.OfflineEagle3Dataset([str(p) for p in samples], max_len=max_len)
    collate = sf.DataCollatorWithPadding()
    steps_per_epoch = math.ceil(len(dataset) / batch_size)
    total = steps_per_epoch * epochs
    eagle = sf.OnlineEagle3Model(model, length=ttt_steps, attention_backend="sdpa")
    strategy = sf.Eagle3TrainStrategy(eagle, target_head=target_head)
    opt = sf.BF16Optimizer(model, lr=lr, total_steps=total, warmup_ratio=warmup_ratio)
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


def run_seed(
    sf: Any, seed: int, args: argparse.Namespace, shard_paths: list[Path], vocab_path: Path, work: Path
) -> dict[str, dict]:
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
    t0 = time.perf_counter()
    out = train_drafter(shard_paths, vocab_path, args.target, work / f"aerie-{seed}", cfg, log=lambda _: None)
    results["aerie"] = {**out, "wall_s": time.perf_counter() - t0}

    shards = open_hidden_shards(shard_paths)
    held = split_heldout(shards, cfg.eval_fraction, cfg.seed)  # the split aerie just used
    train_seqs = [(si, q) for si, sh in enumerate(shards) for q in range(sh.num_seqs) if (si, q) not in held]
    samples = write_specforge_samples(shards, train_seqs, work / f"specforge-samples-{seed}")
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
    sf_head = specforge_target_head(sf, args.target, lm_head)
    arms = {
        "specforge-matched": dict(
            lr=cfg.learning_rate,
            warmup_ratio=cfg.warmup_ratio,
            batch_size=cfg.batch_size,
            ttt_steps=cfg.ttt_steps,
            head_from_target=False,
        ),
        "specforge-matched+head": dict(
            lr=cfg.learning_rate,
            warmup_ratio=cfg.warmup_ratio,
            batch_size=cfg.batch_size,
            ttt_steps=cfg.ttt_steps,
            head_from_target=True,
        ),
        "specforge-default": dict(lr=1e-4, warmup_ratio=0.015, batch_size=1, ttt_steps=7, head_from_target=False),
    }
    for arm, s in arms.items():
        t0 = time.perf_counter()
        model = specforge_drafter(sf, dcfg, vocab, heads, seed, s["head_from_target"])
        trained = train_specforge(
            sf,
            samples,
            model,
            sf_head,
            seed=seed,
            epochs=cfg.epochs,
            batch_size=s["batch_size"],
            ttt_steps=s["ttt_steps"],
            lr=s["lr"],
            warmup_ratio=s["warmup_ratio"],
            max_len=cfg.max_seq_len,
        )
        specforge_into_aerie(model, judge)
        scored = evaluate(judge.eval(), eval_groups, shards, aerie_head, cfg, torch.device("cpu"), torch.float32)
        results[arm] = {**scored, **trained, "wall_s": time.perf_counter() - t0}
    return results


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{mean:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--specforge-site", type=Path, required=True, help="folder of `pip install --target` specforge")
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
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=1, help="1: no best-epoch selection on the held-out set")
    ap.add_argument(
        "--lr",
        type=float,
        default=TrainConfig.learning_rate,
        help="aerie's and the matched arms' peak learning rate (specforge-default keeps 1e-4)",
    )
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--eval-fraction", type=float, default=0.1)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write every arm's figures per seed here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.smoke and not (args.target and args.hidden):
        raise SystemExit("give --target and --hidden (real shards), or --smoke SEQS LEN")
    sf = install_specforge(args.specforge_site)
    per_seed = {}
    with tempfile.TemporaryDirectory(prefix="aerie-peer-") as tmp:
        work = Path(tmp)
        if args.smoke:
            shard, args.target = smoke_data(work, *args.smoke)
            shard_paths = [shard]
        else:
            shard_paths = [Path(p) for p in sorted(glob.glob(args.hidden))]
            if not shard_paths:
                raise SystemExit(f"--hidden {args.hidden!r}: no shard matches")
        vocab = args.vocab or full_vocab(open_hidden_shards(shard_paths[:1])[0].vocab_size, work)
        for seed in args.seeds:
            per_seed[seed] = run_seed(sf, seed, args, shard_paths, vocab, work)
            for arm in ARMS:
                r = per_seed[seed][arm]
                print(
                    f"seed {seed} {arm:<24} acceptance {r['simulated_acceptance_length']:.3f}  "
                    f"per position {[round(x, 3) for x in r['acceptance_per_position']]}  "
                    f"{r['tokens_per_s']:.0f} train tok/s",
                    flush=True,
                )
    print(
        f"\n{'arm':<24} {'held-out simulated acceptance':>30} {'train tokens/s':>18}   (mean ± stdev over seeds "
        f"{args.seeds})"
    )
    for arm in ARMS:
        acc = [per_seed[s][arm]["simulated_acceptance_length"] for s in args.seeds]
        tps = [per_seed[s][arm]["tokens_per_s"] for s in args.seeds]
        per_pos = [statistics.fmean(p) for p in zip(*(per_seed[s][arm]["acceptance_per_position"] for s in args.seeds))]
        print(f"{arm:<24} {spread(acc):>30} {spread(tps):>18}   per position {[round(x, 3) for x in per_pos]}")
    if args.json:
        args.json.write_text(json.dumps({str(k): v for k, v in per_seed.items()}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
