"""Train an EAGLE-3 drafter with training-time test (TTT) on captured target hidden states.

Reading guide (top to bottom): config -> data (hidden shards, draft vocab, windows, batches) -> the target's
heads (embeddings, lm_head, final norm read straight from its safetensors) -> the TTT unroll and its loss ->
held-out evaluation (simulated acceptance) -> distributed helpers -> training state (checkpoint, resume) ->
the training loop (``train_drafter``) -> the command line torchrun starts (``main``).

Recipe: AdamW (weight decay on matrices only), linear warmup then cosine decay to ``min_lr_ratio``, gradient
clipping; bf16 autocast on GPU, plain fp32 on CPU (deterministic: the same run gives bit-identical weights).
Held-out sequences (chosen by hashing sample ids) are evaluated before training and after every epoch:
TTT loss, simulated chain acceptance length and per-position acceptance.

Files. ``out_dir`` (the rule's declared output, ``results/drafter/{run}/``) is written once, when training has
finished: the drafter of the epoch with the best held-out simulated acceptance, in SGLang's layout
(config.json, model.safetensors), plus train_log.jsonl and eval.json. What a killed run needs lives beside
it, outside the declared output (Snakemake deletes that when a job fails), in
``train_state_dir(out_dir)`` = ``results/drafter/.{run}.train_state/``:

    state.pt                 drafter weights (without the frozen embeddings), AdamW state, schedule step,
                             epoch and position in that epoch's batch order, counters, eval history, RNG
                             states, the config and a fingerprint of the data; written (atomically) every
                             ``checkpoint_every`` optimizer steps and after each epoch; deleted at the end
    train_log.jsonl.partial  the training log so far (cut back to the checkpoint when resuming)
    last/, best/             drafter exports after the latest epoch and after the best epoch so far

A restarted run with the same data and config continues from state.pt and logs the same losses and ends
with the same weights as an uninterrupted run (exactly, on CPU). A state written for other data or settings
is refused with a message naming the difference (delete the folder, or set ``resume: false``).

Several GPUs: started by torchrun (``torchrun_command``; the drafter rule does this when its
``resources.gpu`` > 1), each process trains every world-th batch of the epoch's order (padded so all ranks
step together, like DistributedSampler), DDP averages the gradients, evaluation sums are all-reduced, and
only rank 0 writes files. ``batch_size`` is then per process. Without WORLD_SIZE > 1 nothing of this runs.

TTT in one paragraph: step 0 feeds fc(aux features) with tokens shifted by one, exactly like SGLang's draft
extend. Step k >= 1 feeds each row's own step k-1 ``hidden_out`` with the token one further on, at position
t+k - exactly what chained draft steps see at inference. Attention follows the same rule (TTTCache): step-k
row t sees step-0 keys of rows <= t and its own row's keys from steps 1..k. The loss at every step is the
soft cross-entropy against the target's next-token distribution restricted to the draft vocab (from the
final states through lm_head for ``full`` hidden shards; from the stored top-k for ``compact`` ones).

Index conventions for one sequence window starting at row ``a`` (all arrays are relative to ``a``):
``ids[p]`` token at p; ``q[p]`` target distribution after p (it predicts token p+1); ``gen[p]`` 1 when token p
was generated (loss mask). Step k, row t: input token ``ids[t+1+k]``, target ``q[t+1+k]``, supervised when
``gen[t+2+k]`` (the predicted token is a generated one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn

from aerie.drafter.model import DrafterConfig, Eagle3Drafter, TTTCache, atomic_write
from aerie.hidden import LAYOUTS, READABLE_FORMATS, dequantize_aux

try:
    import numpy as np
except ImportError:  # numpy is optional: its RNG state is saved only when it is there
    np = None

VOCAB_FORMAT = "aerie.draft-vocab/1"
EVAL_FORMAT = "aerie.drafter-eval/1"
STATE_FORMAT = "aerie.drafter-train-state/1"


@dataclass
class TrainConfig:
    ttt_steps: int = 7  # unrolled draft steps per position (EAGLE-3 uses 7)
    step_loss_decay: float = 0.8  # weight of step k is decay**k
    epochs: int = 2
    learning_rate: float = 1e-4
    weight_decay: float = 0.0  # applied to matrices only, never to norms
    warmup_ratio: float = 0.03
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    grad_clip: float = 0.5
    max_seq_len: int = 2048  # longer sequences are cut into windows of this many rows
    batch_size: int = 4  # windows per optimizer step (per process under torchrun)
    max_batch_tokens: int = 0  # optional cap on batch_size * padded length (0 = none)
    eval_fraction: float = 0.05  # held-out share of sequences, chosen by hashing sample ids
    mask_out_of_vocab_targets: bool = True  # skip positions whose target argmax is outside the draft vocab
    init_head_from_target: bool = True  # start lm_head/norm from the target's (draft-vocab rows)
    seed: int = 0
    threads: int = 0  # torch CPU threads (0 = leave as is)
    log_every: int = 10
    checkpoint_every: int = 500  # optimizer steps between resumable training states (0 = after epochs only)
    resume: bool = True  # continue from a compatible training state beside out_dir; false = start over
    device: str = "auto"  # auto | cpu | cuda

    def __post_init__(self) -> None:
        for name in ("ttt_steps", "epochs", "batch_size", "max_seq_len", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"drafter.{name} must be at least 1, not {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise ValueError(f"drafter.checkpoint_every must be >= 0, not {self.checkpoint_every}")


# Settings a resumed run may change: they do not alter what is computed.
RESUME_MAY_CHANGE = ("threads", "log_every", "checkpoint_every", "resume", "device")



# ----------------------------------------------------------------------------------------------------------
# data


class HiddenShard:
    """One hidden shard (aerie.hidden/2, either layout; aerie.hidden/1 reads as ``full``): small tensors in
    memory, the big per-token tensors read lazily per window."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = safe_open(str(self.path), framework="pt")
        meta = self._file.metadata() or {}
        if meta.get("format") not in READABLE_FORMATS:
            raise ValueError(f"{self.path}: format {meta.get('format')!r}, expected one of {', '.join(READABLE_FORMATS)}")
        self.layout = meta.get("layout", "full")
        if self.layout not in LAYOUTS:
            raise ValueError(f"{self.path}: unknown layout {self.layout!r}")
        self.aux_layer_ids: list[int] = [int(i) for i in json.loads(meta["aux_layer_ids"])]
        layers = meta.get("num_hidden_layers")
        self.num_hidden_layers: int | None = int(layers) if layers is not None else None
        self.hidden_size = int(meta["hidden_size"])
        self.vocab_size = int(meta["vocab_size"])
        self.sample_ids: list[str] = json.loads(meta.get("sample_ids", "[]"))
        self.input_ids = self._file.get_tensor("input_ids").long()  # [T]
        self.loss_mask = self._file.get_tensor("loss_mask").bool()  # [T]
        self.seq_offsets = self._file.get_tensor("seq_offsets").long()  # [N+1]
        T, A = len(self.input_ids), len(self.aux_layer_ids)
        expected = {"aux_hidden_states": [T, A * self.hidden_size]}
        if self.layout == "full":
            expected["final_hidden_states"] = [T, self.hidden_size]
            self.topk = 0
        else:
            self.topk = int(meta["target_topk"])
            expected.update(aux_scales=[T, A], target_topk_ids=[T, self.topk], target_topk_logprobs=[T, self.topk])
        for name, shape in expected.items():
            if name not in self._file.keys() or self._file.get_slice(name).get_shape() != shape:
                raise ValueError(f"{self.path}: {name} missing or not of shape {shape} ({self.layout} layout)")
        if len(self.sample_ids) != self.num_seqs:
            self.sample_ids = [f"{self.path.name}#{i}" for i in range(self.num_seqs)]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_offsets) - 1

    def rows(self, name: str, start: int, end: int) -> Tensor:
        return self._file.get_slice(name)[start:end]

    def aux_rows(self, start: int, end: int, dtype: torch.dtype) -> Tensor:
        """[n, A*H] aux features in ``dtype`` (the compact layout's float8 values times their scales)."""
        if self.layout == "compact":
            return dequantize_aux(self.rows("aux_hidden_states", start, end), self.rows("aux_scales", start, end), dtype)
        return self.rows("aux_hidden_states", start, end).to(dtype)


def open_hidden_shards(paths: Sequence[Path]) -> list[HiddenShard]:
    if not paths:
        raise ValueError("no hidden shards given")
    shards = [HiddenShard(Path(p)) for p in paths]
    first = shards[0]
    for s in shards[1:]:
        # Mixing layer conventions would silently train on inconsistent features: refuse.
        if s.aux_layer_ids != first.aux_layer_ids:
            raise ValueError(
                f"hidden shards disagree on aux_layer_ids: {first.path} has {first.aux_layer_ids}, "
                f"{s.path} has {s.aux_layer_ids}; recapture them with one setting"
            )
        if (s.hidden_size, s.vocab_size) != (first.hidden_size, first.vocab_size):
            raise ValueError(f"hidden shards disagree on hidden_size/vocab_size: {first.path} vs {s.path}")
        # A batch holds one kind of target (final states or top-k lists): one layout, one k for all shards.
        if (s.layout, s.topk) != (first.layout, first.topk):
            raise ValueError(
                f"hidden shards disagree on their layout: {first.path} is {first.layout} (top-k {first.topk}), "
                f"{s.path} is {s.layout} (top-k {s.topk}); recapture them with one hidden.layout / target_topk"
            )
    return shards


def check_shard_layers(shards: Sequence[HiddenShard], aux_layer_ids: Sequence[int], num_hidden_layers: int) -> None:
    """Refuse shards captured at other layers than the drafter is configured for, or from a target of another
    depth: the drafter's fc would be trained on features SGLang never feeds it."""
    want = [int(i) for i in aux_layer_ids]
    for s in shards:
        if s.aux_layer_ids != want or s.num_hidden_layers != num_hidden_layers:
            raise ValueError(
                f"{s.path} was captured at aux layers {s.aux_layer_ids} of a {s.num_hidden_layers}-layer target, but "
                f"the drafter is configured for aux layers {want} of the {num_hidden_layers}-layer target "
                "(hidden.aux_layer_ids): recapture the hidden shards (delete them and rerun) or fix the setting"
            )


def check_exported_layer_ids(folder: Path, aux_layer_ids: Sequence[int]) -> None:
    """Re-read an exported drafter's config.json: SGLang captures the layers named there, so they must be the
    layers the drafter was trained on."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    exported = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if exported != list(aux_layer_ids):
        raise ValueError(
            f"{folder}/config.json: eagle_config.eagle_aux_hidden_state_layer_ids is {exported}, but the drafter "
            f"was trained on hidden shards captured at aux layers {list(aux_layer_ids)}; refusing to publish it"
        )


@dataclass
class DraftVocab:
    d2t: Tensor  # int64 [Vd]
    t2d: Tensor  # bool [V]

    @property
    def target_ids(self) -> Tensor:  # [Vd] target id of each draft id (ascending)
        return torch.arange(len(self.d2t)) + self.d2t


def load_draft_vocab(path: Path) -> DraftVocab:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != VOCAB_FORMAT:
            raise ValueError(f"{path}: format {meta.get('format')!r}, expected {VOCAB_FORMAT!r}")
        return DraftVocab(d2t=f.get_tensor("d2t").long(), t2d=f.get_tensor("t2d").bool())


@dataclass
class Window:
    """Rows [start, end) of one sequence; tokens/targets are read up to look_end (for the unrolled steps)."""

    shard: int
    start: int
    end: int
    look_end: int
    pos0: int  # position id of row `start` within its sequence


def make_windows(shard_idx: int, shard: HiddenShard, seq: int, max_len: int, ttt_steps: int) -> list[Window]:
    s, e = int(shard.seq_offsets[seq]), int(shard.seq_offsets[seq + 1])
    out = []
    for a in range(s, e, max_len):
        b = min(a + max_len, e)
        look_end = min(b + ttt_steps + 1, e)
        # keep windows with at least one supervised prediction (a generated token at a+2 .. look_end-1)
        if a + 2 < look_end and bool(shard.loss_mask[a + 2 : look_end].any()):
            out.append(Window(shard_idx, a, b, look_end, a - s))
    return out


def split_heldout(shards: list[HiddenShard], fraction: float, seed: int) -> set[tuple[int, int]]:
    """Held-out (shard, seq) pairs: a deterministic hash of each sample id, so adding shards keeps the split."""
    if fraction <= 0:
        return set()
    keyed = []
    for si, shard in enumerate(shards):
        for q in range(shard.num_seqs):
            digest = hashlib.sha256(f"{seed}:{shard.sample_ids[q]}".encode()).hexdigest()
            keyed.append((int(digest[:12], 16) / 16**12, si, q))
    held = {(si, q) for u, si, q in keyed if u < fraction}
    if not held and len(keyed) >= 2:  # tiny runs: hold out at least one sequence
        u, si, q = min(keyed)
        held = {(si, q)}
    if len(held) == len(keyed):
        raise ValueError(f"eval_fraction {fraction} holds out every sequence: nothing left to train on")
    return held


def batches(windows: list[Window], cfg: TrainConfig, generator: torch.Generator | None) -> list[list[Window]]:
    """Shuffle (when a generator is given) and group windows under batch_size and max_batch_tokens."""
    order = torch.randperm(len(windows), generator=generator).tolist() if generator is not None else range(len(windows))
    out, cur, cur_len = [], [], 0
    for i in order:
        w = windows[i]
        n = w.end - w.start
        longest = max(cur_len, n)
        over_tokens = cfg.max_batch_tokens and longest * (len(cur) + 1) > cfg.max_batch_tokens
        if cur and (len(cur) >= cfg.batch_size or over_tokens):
            out.append(cur)
            cur, longest = [], n
        cur.append(w)
        cur_len = longest
    if cur:
        out.append(cur)
    return out

def derived_seed(seed: int, *parts) -> int:
    """A seed for one purpose (e.g. ("epoch", 3)) derived from the run's seed."""
    return int(hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).hexdigest()[:15], 16)


def epoch_batches(windows: list[Window], cfg: TrainConfig, epoch: int) -> list[list[Window]]:
    """The batch order of one epoch: a shuffle seeded by (seed, epoch), so a resumed run rebuilds it exactly."""
    return batches(windows, cfg, torch.Generator().manual_seed(derived_seed(cfg.seed, "epoch", epoch)))


def shard_for_rank(groups: list, rank: int, world: int) -> list:
    """This rank's share of a batch order: every world-th batch, the order padded by wrapping around so that
    every rank gets the same number (DistributedSampler's rule: DDP ranks must step together)."""
    if world == 1:
        return list(groups)
    per_rank = math.ceil(len(groups) / world)
    padded = [groups[i % len(groups)] for i in range(per_rank * world)] if groups else []
    return padded[rank::world]



@dataclass
class Batch:
    aux: Tensor  # [B, T, A*H]
    position_ids: Tensor  # [B, T]
    row_valid: Tensor  # [B, T] bool: real rows (not padding)
    ids: Tensor  # [B, W] token ids, W = T + ttt_steps + 2
    have: Tensor  # [B, W] bool: a token and target feature exist at p
    gen: Tensor  # [B, W] bool: token p was generated
    final: Tensor | None  # full layout: [B, W, H] target final hidden (after its norm)
    rows: int  # number of real rows
    topk_ids: Tensor | None = None  # compact layout: [B, W, k] target's top-k next-token ids
    topk_logprobs: Tensor | None = None  # compact layout: [B, W, k] their log-probabilities


def load_batch(windows: list[Window], shards: list[HiddenShard], ttt_steps: int, device: torch.device, dtype: torch.dtype) -> Batch:
    B = len(windows)
    T = max(w.end - w.start for w in windows)
    W = T + ttt_steps + 2
    first = shards[windows[0].shard]
    A_H, H, k = len(first.aux_layer_ids) * first.hidden_size, first.hidden_size, first.topk
    compact = first.layout == "compact"
    aux = torch.zeros(B, T, A_H, dtype=dtype)
    final = None if compact else torch.zeros(B, W, H, dtype=dtype)
    topk_ids = torch.zeros(B, W, k, dtype=torch.long) if compact else None
    topk_lp = torch.zeros(B, W, k, dtype=torch.float32) if compact else None
    ids = torch.zeros(B, W, dtype=torch.long)
    have = torch.zeros(B, W, dtype=torch.bool)
    gen = torch.zeros(B, W, dtype=torch.bool)
    row_valid = torch.zeros(B, T, dtype=torch.bool)
    position_ids = torch.zeros(B, T, dtype=torch.long)
    for i, w in enumerate(windows):
        sh = shards[w.shard]
        n, m = w.end - w.start, w.look_end - w.start
        aux[i, :n] = sh.aux_rows(w.start, w.end, dtype)
        if compact:
            topk_ids[i, :m] = sh.rows("target_topk_ids", w.start, w.look_end).long()
            topk_lp[i, :m] = sh.rows("target_topk_logprobs", w.start, w.look_end).float()
        else:
            final[i, :m] = sh.rows("final_hidden_states", w.start, w.look_end).to(dtype)
        ids[i, :m] = sh.input_ids[w.start : w.look_end]
        gen[i, :m] = sh.loss_mask[w.start : w.look_end]
        have[i, :m] = True
        row_valid[i, :n] = True
        position_ids[i] = w.pos0 + torch.arange(T)
    to = lambda t: t.to(device, non_blocking=True) if t is not None else None  # noqa: E731
    return Batch(to(aux), to(position_ids), to(row_valid), to(ids), to(have), to(gen), to(final), int(row_valid.sum()),
                 to(topk_ids), to(topk_lp))


@dataclass
class TargetHead:
    """The target's next-token distribution at every batch position, restricted to the draft vocab.

    Full layout: from the final states through the frozen lm_head (``full`` [V,H] for the greedy token,
    ``draft`` [Vd,H] rows for the soft targets). Compact layout: from the stored top-k lists; no lm_head."""

    full: Tensor | None
    draft: Tensor | None
    t2d: Tensor  # bool [V]

    @torch.no_grad()
    def soft_targets(self, final: Tensor) -> Tensor:
        """[B,W,H] -> [B,W,Vd]: target next-token distribution renormalised over the draft vocab."""
        return torch.softmax((final @ self.draft.T).float(), dim=-1)

    @torch.no_grad()
    def greedy(self, final: Tensor, chunk: int = 512) -> Tensor:
        """[B,W,H] -> [B,W] target argmax over the full vocab, in row chunks to bound memory."""
        flat = final.reshape(-1, final.shape[-1])
        out = torch.cat([(flat[i : i + chunk] @ self.full.T).argmax(-1) for i in range(0, len(flat), chunk)])
        return out.view(final.shape[:-1])

    @torch.no_grad()
    def topk_targets(self, ids: Tensor, logprobs: Tensor) -> tuple[Tensor, Tensor]:
        """[B,W,k] top-k lists -> ([B,W,Vd] soft targets, [B,W] has any in-vocab entry): the softmax of the
        entries inside the draft vocab, renormalised among themselves; rows with none get all zeros."""
        draft_index = torch.cumsum(self.t2d, 0) - 1  # target id -> draft id (draft ids ascend with target ids)
        valid = self.t2d[ids]
        has = valid.any(-1)
        lp = logprobs.float().masked_fill(~valid, float("-inf")).masked_fill(~has[..., None], 0.0)
        p = torch.softmax(lp, -1) * valid
        q = torch.zeros(*ids.shape[:-1], int(self.t2d.sum()), device=ids.device)
        return q.scatter_add_(-1, (draft_index[ids] * valid).long(), p), has

    @torch.no_grad()
    def targets(self, b: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """(q [B,W,Vd] soft targets, greedy [B,W] target token, has_q [B,W] bool) for a batch of either layout."""
        if b.topk_ids is not None:
            q, has = self.topk_targets(b.topk_ids, b.topk_logprobs)
            return q, b.topk_ids[..., 0], has  # top-1 of the full vocab = the target's greedy token
        return self.soft_targets(b.final), self.greedy(b.final), torch.ones_like(b.have)


# ----------------------------------------------------------------------------------------------------------
# the target's heads, read without loading the target (Kimi K2.5 is ~1T parameters in many shards)


@dataclass
class TargetHeads:
    """What the drafter takes from the target: embeddings, output head, final norm (as stored) and config."""

    config: dict  # the language model's config.json entries (a multimodal wrapper's text_config)
    embed: Tensor  # [V, H] input embeddings
    lm_head: Tensor  # [V, H] output embeddings (the input embeddings themselves when tied)
    norm: Tensor | None  # [H] final norm weight
    tied: bool
    names: dict  # role -> checkpoint tensor name that was read


def _text_config(config: dict) -> dict:
    """Multimodal wrappers (Kimi K2.5, ...) nest the language model's config."""
    for key in ("text_config", "language_config", "llm_config"):
        nested = config.get(key)
        if isinstance(nested, dict) and "hidden_size" in nested:
            return nested
    return config


def target_num_hidden_layers(target: Path) -> int:
    """The target's decoder-layer count, from its config.json (a multimodal wrapper's text_config)."""
    return int(_text_config(json.loads((Path(target) / "config.json").read_text()))["num_hidden_layers"])


def _tensor_files(target: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from model.safetensors.index.json when sharded, else file headers."""
    index = target / "model.safetensors.index.json"
    if index.exists():
        return {name: target / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(target.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{target}: no model.safetensors.index.json and no *.safetensors file")
    names = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), path))
    return names


def _find_embed(names) -> str | None:
    """``model.embed_tokens.weight``, ``language_model.model.embed_tokens.weight``, ...: the shallowest one
    (DeepSeek-style MTP layers carry their own ``model.layers.N.embed_tokens.weight``)."""
    found = [n for n in names if n == "embed_tokens.weight" or n.endswith(".embed_tokens.weight")]
    return min(found, key=lambda n: (n.count("."), n)) if found else None


def _find_lm_head(names, embed_name: str) -> str | None:
    """``lm_head.weight`` under the same wrapper as the embeddings (``language_model.lm_head.weight`` for Kimi)."""
    found = [n for n in names if n == "lm_head.weight" or n.endswith(".lm_head.weight")]
    same_wrapper = lambda n: embed_name.startswith(n[: -len("lm_head.weight")])  # noqa: E731
    return min(found, key=lambda n: (not same_wrapper(n), n.count("."), n)) if found else None


def read_target_heads(target: Path) -> TargetHeads:
    """Read embed_tokens, lm_head and the final norm from the target's safetensors, opening only the files
    that hold them. Tied embeddings (``tie_word_embeddings``, or no lm_head tensor at all) reuse embed_tokens."""
    target = Path(target)
    raw = json.loads((target / "config.json").read_text())
    config = _text_config(raw)
    files = _tensor_files(target)
    embed_name = _find_embed(files)
    if embed_name is None:
        raise ValueError(f"{target}: no embed_tokens.weight among its {len(files)} tensors")
    head_name = _find_lm_head(files, embed_name)
    norm_name = embed_name[: -len("embed_tokens.weight")] + "norm.weight"  # model.norm.weight, ...
    tie = config.get("tie_word_embeddings", raw.get("tie_word_embeddings"))
    tied = bool(tie) or head_name is None
    wanted = {"embed": embed_name}
    if not tied:
        wanted["lm_head"] = head_name
    if norm_name in files:
        wanted["norm"] = norm_name
    tensors = {}
    for path in sorted({files[name] for name in wanted.values()}):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({role: f.get_tensor(name) for role, name in wanted.items() if files[name] == path})
    embed = tensors["embed"]
    if not embed.is_floating_point():
        raise ValueError(f"{target}: {embed_name} is {embed.dtype}; quantized embeddings are not supported")
    if tied:
        wanted["lm_head"] = embed_name
    return TargetHeads(config, embed, tensors.get("lm_head", embed), tensors.get("norm"), tied, wanted)


def _load_target_heads(target_path: Path, vocab: DraftVocab, aux_layer_ids: list[int], cfg: TrainConfig):
    """A new drafter around the target's frozen embeddings (lm_head and norm from the target's too, with
    init_head_from_target), and the target's lm_head [V, H] for the soft targets - as
    Eagle3Drafter.from_target would build it from the loaded model, without loading the model."""
    heads = read_target_heads(target_path)
    dcfg = DrafterConfig.from_target(SimpleNamespace(**heads.config), len(vocab.d2t), aux_layer_ids)
    if tuple(heads.embed.shape) != (dcfg.vocab_size, dcfg.hidden_size):
        raise ValueError(f"target embeddings {tuple(heads.embed.shape)} != ({dcfg.vocab_size}, {dcfg.hidden_size})")
    torch.manual_seed(cfg.seed)  # deterministic drafter init
    model = Eagle3Drafter(dcfg)
    model.set_vocab_maps(vocab.d2t, vocab.t2d)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(heads.embed)
        if cfg.init_head_from_target:
            model.lm_head.weight.copy_(heads.lm_head[vocab.target_ids])
            if heads.norm is not None and heads.norm.shape == model.norm.weight.shape:
                model.norm.weight.copy_(heads.norm)
    return model, dcfg, heads.lm_head




# ----------------------------------------------------------------------------------------------------------
# TTT unroll, loss, evaluation


def ttt_unroll(model: Eagle3Drafter, aux: Tensor, ids: Tensor, position_ids: Tensor, steps: int) -> list[Tensor]:
    """Unrolled chained drafting over every row at once; returns per-step draft logits [B,T,Vd]."""
    T = aux.shape[1]
    cache = TTTCache()
    hidden = model.project_aux(aux)  # [B,T,H] step 0: target features
    logits_per_step = []
    for k in range(steps):
        tokens = ids[:, 1 + k : 1 + k + T]  # token t+1+k at row t
        logits, hidden = model(hidden, tokens, position_ids + k, cache)  # hidden_out feeds step k+1
        logits_per_step.append(logits)
    return logits_per_step


def step_weights(batch: Batch, k: int, target_ok: Tensor | None) -> Tensor:
    """[B,T] float: rows supervised at step k (real row, predicted token generated, and - when given - a usable
    target: in-vocab greedy token with mask_out_of_vocab_targets, an in-vocab top-k entry for compact shards)."""
    T = batch.row_valid.shape[1]
    w = batch.row_valid & batch.gen[:, 2 + k : 2 + k + T]
    if target_ok is not None:
        w = w & target_ok[:, 1 + k : 1 + k + T]
    return w.float()


def target_mask(head: TargetHead, greedy: Tensor, has_q: Tensor, cfg: TrainConfig) -> Tensor:
    """[B,W] bool: positions whose target distribution may carry loss."""
    return has_q & head.t2d[greedy] if cfg.mask_out_of_vocab_targets else has_q


def ttt_loss(logits_per_step: list[Tensor], q: Tensor, batch: Batch, target_ok: Tensor | None, decay: float):
    """Weighted sum over steps of masked soft cross-entropy; also per-step (ce_sum, weight_sum, correct)."""
    T = batch.row_valid.shape[1]
    total = torch.zeros((), device=q.device)
    stats = []
    for k, logits in enumerate(logits_per_step):
        q_k = q[:, 1 + k : 1 + k + T]  # [B,T,Vd]
        w = step_weights(batch, k, target_ok)  # [B,T]
        ce = -(q_k * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # [B,T]
        ce_sum, w_sum = (ce * w).sum(), w.sum()
        total = total + decay**k * ce_sum / w_sum.clamp_min(1.0)
        correct = ((logits.argmax(-1) == q_k.argmax(-1)).float() * w).sum()
        stats.append((ce_sum.detach(), w_sum, correct))
    return total, stats


EMPTY_EVAL = {  # what eval.json says when there is nothing held out
    "simulated_acceptance_length": None,
    "acceptance_per_position": [],
    "simulated_acceptance_length_by_steps": [],
    "heldout_loss": None,
    "heldout_loss_per_step": [],
    "heldout_accuracy_per_step": [],
    "heldout_start_positions": 0,
}

class TTTUnroll(nn.Module):
    """ttt_unroll as a module: what DDP wraps (it averages the gradients of what runs inside its forward)."""

    def __init__(self, drafter: Eagle3Drafter, steps: int):
        super().__init__()
        self.drafter, self.steps = drafter, steps

    def forward(self, aux: Tensor, ids: Tensor, position_ids: Tensor) -> list[Tensor]:
        return ttt_unroll(self.drafter, aux, ids, position_ids, self.steps)


@torch.no_grad()
def evaluate(model: Eagle3Drafter, groups: list[list[Window]], shards, head: TargetHead, cfg: TrainConfig, device, dtype,
             all_reduce: Callable[[Tensor], Tensor] | None = None) -> dict:
    """Held-out TTT loss plus simulated chain acceptance with greedy verification.

    For every held-out start row t whose first drafted token is a generated one, draft step k is accepted
    when its argmax (mapped to a target id) equals the target's greedy token at t+1+k and all earlier steps
    were accepted; acceptance length = 1 (bonus token) + accepted steps. Later steps are fed the recorded
    tokens, which equal the accepted drafts when the data was generated greedily (exact simulation then).
    Under torchrun each rank evaluates its share of ``groups`` and ``all_reduce`` sums the counts.
    """
    model.eval()
    K = cfg.ttt_steps
    ce = torch.zeros(K, dtype=torch.float64)
    wsum = torch.zeros(K, dtype=torch.float64)
    correct = torch.zeros(K, dtype=torch.float64)
    accepted_at = torch.zeros(K, dtype=torch.float64)  # starts whose chain reached step k accepted
    starts = 0
    for group in groups:
        b = load_batch(group, shards, K, device, dtype)
        T = b.row_valid.shape[1]
        q, greedy, has_q = head.targets(b)  # greedy [B,W]: the token the target verifies against
        with _autocast(device):
            steps = ttt_unroll(model, b.aux, b.ids, b.position_ids, K)
        _, stats = ttt_loss(steps, q, b, target_mask(head, greedy, has_q, cfg), cfg.step_loss_decay)
        for k, (c, w, r) in enumerate(stats):
            ce[k] += float(c)
            wsum[k] += float(w)
            correct[k] += float(r)
        start = b.row_valid & b.gen[:, 2 : 2 + T]  # [B,T]
        chain = start.clone()
        for k, logits in enumerate(steps):
            draft = model.draft_to_target(logits.argmax(-1))  # [B,T] target ids
            ok = (draft == greedy[:, 1 + k : 1 + k + T]) & b.have[:, 2 + k : 2 + k + T]
            chain = chain & ok
            accepted_at[k] += float(chain.sum())
        starts += int(start.sum())
    model.train()
    if all_reduce is not None:
        totals = all_reduce(torch.cat([ce, wsum, correct, accepted_at, torch.tensor([starts], dtype=torch.float64)]))
        ce, wsum, correct, accepted_at = totals[: 4 * K].view(4, K)
        starts = int(totals[-1])
    if starts == 0:
        return dict(EMPTY_EVAL)
    loss_k = (ce / wsum.clamp_min(1)).tolist()
    per_pos = (accepted_at / starts).tolist()
    return {
        "simulated_acceptance_length": 1.0 + sum(per_pos),
        "acceptance_per_position": per_pos,
        # what a chain of n draft steps would give: 1 + sum of the first n per-position rates
        "simulated_acceptance_length_by_steps": [1.0 + sum(per_pos[:n]) for n in range(1, K + 1)],
        "heldout_loss": sum(cfg.step_loss_decay**k * l for k, l in enumerate(loss_k)),
        "heldout_loss_per_step": loss_k,
        "heldout_accuracy_per_step": (correct / wsum.clamp_min(1)).tolist(),
        "heldout_start_positions": starts,
    }


def _autocast(device: torch.device):
    # bf16 autocast on GPU; exact fp32 on CPU (deterministic, and CPU bf16 is slow).
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """The LR schedule (linear warmup, cosine decay): a function of the step, so the step is its whole state."""
    warmup = max(1, math.ceil(cfg.warmup_ratio * total))
    if step < warmup:
        return cfg.learning_rate * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.learning_rate * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


# ----------------------------------------------------------------------------------------------------------
# distributed (torchrun) helpers


@dataclass
class Dist:
    """This process's place in a torchrun job; rank 0 of 1 when started plainly."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, t: Tensor) -> Tensor:
        """All-reduce (sum) over ranks; the identity in a single process."""
        if self.world == 1:
            return t
        x = t.to(self.device)
        torch.distributed.all_reduce(x)
        return x.to(t.device)

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier(**({"device_ids": [self.device.index]} if self.device.type == "cuda" else {}))


def setup_distributed(cfg: TrainConfig) -> Dist:
    """Join the torchrun job when WORLD_SIZE > 1 (NCCL on CUDA, gloo on CPU); else pick the device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    if world == 1:
        return Dist(device=torch.device(("cuda" if cuda else "cpu") if cfg.device == "auto" else cfg.device))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    return Dist(rank, world, device)


# ----------------------------------------------------------------------------------------------------------
# training state: checkpoint and resume


def train_state_dir(out_dir: Path) -> Path:
    """Where the resumable state of ``out_dir`` lives: beside it (results/drafter/.{run}.train_state), so it
    survives Snakemake deleting the declared output of a failed job."""
    out_dir = Path(out_dir)
    return out_dir.parent / f".{out_dir.name}.train_state"


@dataclass
class Progress:
    """Where training stands: what a resume restores besides weights, optimizer and RNG."""

    epoch: int = 1  # the epoch in progress (epochs + 1 once all are done)
    position: int = 0  # batches of this epoch's order (this rank's share) already trained
    step: int = 0  # optimizer steps so far: the LR schedule's state
    tokens: int = 0  # real rows trained, all ranks
    supervised: int = 0  # step-0 rows that carried loss, all ranks
    train_seconds: float = 0.0
    seconds: float = 0.0  # wall time of the run so far, earlier (killed) attempts included
    log_bytes: int = 0  # length of the partial train log at this checkpoint
    untrained: dict = field(default_factory=dict)  # held-out eval before training
    epochs: list = field(default_factory=list)  # held-out eval after each epoch: {"epoch": e, **eval}
    best_epoch: int = 0
    best_acceptance: float | None = None


def _safetensors_header_sha(path: Path) -> str:
    """sha256 of a safetensors header (tensor names, shapes, offsets, metadata such as sample ids)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return hashlib.sha256(f.read(n)).hexdigest()[:16]


def data_fingerprint(hidden_shards: Sequence[Path], vocab_path: Path, target_path: Path, aux_layer_ids: list[int]) -> dict:
    """What the training data is: shard paths, sizes and header hashes, the draft vocab, target, aux ids."""
    def file(p):
        return [str(p), os.path.getsize(p), _safetensors_header_sha(Path(p))]

    return {
        "hidden_shards": [file(p) for p in hidden_shards],
        "draft_vocab": file(vocab_path),
        "target": str(target_path),
        "aux_layer_ids": list(aux_layer_ids),
    }


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(v if not isinstance(v, list) else tuple(v) for v in state["python"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if np is not None and "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def save_train_state(path: Path, model: Eagle3Drafter, opt, progress: Progress, cfg: TrainConfig,
                     fingerprint: dict, world: int, total_steps: int) -> None:
    """Everything a resume needs, in one atomically replaced file. The frozen embeddings are left out: the
    resumed run reads them from the target again (they are the biggest tensor: 4.7 GB fp32 for Kimi)."""
    state = {
        "format": STATE_FORMAT,
        "config": asdict(cfg),
        "fingerprint": fingerprint,
        "world_size": world,
        "model": {k: v for k, v in model.state_dict().items() if k != "embed_tokens.weight"},
        "optimizer": opt.state_dict(),
        "scheduler": {"kind": "warmup-cosine (lr_at)", "step": progress.step, "total_steps": total_steps},
        "progress": asdict(progress),
        "rng": _rng_state(),
    }
    atomic_write(path, lambda p: torch.save(state, p))


def load_train_state(path: Path, cfg: TrainConfig, fingerprint: dict, world: int) -> dict | None:
    """The state at ``path`` when it was written for this data and these settings; None when there is none.
    Anything else is refused: mixing two runs' data or settings would give a drafter nobody asked for."""
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"{path}: format {state.get('format')!r}, expected {STATE_FORMAT!r}")
    problems = []
    saved = {k: v for k, v in state["config"].items() if k not in RESUME_MAY_CHANGE}
    now = {k: v for k, v in asdict(cfg).items() if k not in RESUME_MAY_CHANGE}
    for k in sorted(saved.keys() | now.keys()):
        if saved.get(k) != now.get(k):
            problems.append(f"drafter.{k} was {saved.get(k)!r}, is {now.get(k)!r}")
    for k in sorted(state["fingerprint"].keys() | fingerprint.keys()):
        if state["fingerprint"].get(k) != fingerprint.get(k):
            problems.append(f"{k} differ")
    if state["world_size"] != world:
        problems.append(f"it ran as {state['world_size']} processes, this run has {world}")
    if problems:
        raise ValueError(
            f"{path} holds the training state of another run ({'; '.join(problems)}); delete {path.parent} "
            "to start over, or set drafter.resume: false to overwrite it"
        )
    return state


def _copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(dst, lambda p: shutil.copyfile(src, p))


# ----------------------------------------------------------------------------------------------------------
# training loop


def train_drafter(
    hidden_shards: Sequence[Path],
    vocab_path: Path,
    target_path: Path,
    out_dir: Path,
    cfg: TrainConfig,
    log: Callable[[str], None] = print,
    on_step: Callable[[int], None] | None = None,
    aux_layer_ids: Sequence[int] | None = None,
) -> dict:
    """Train a drafter on hidden shards; write out_dir (best drafter, train_log.jsonl, eval.json); return eval.

    ``aux_layer_ids``: the configured aux layers (hidden.aux_layer_ids resolved against the target); every
    shard must have been captured at exactly these layers of a target as deep as ``target_path`` (None: the
    first shard's ids). Resumes from ``train_state_dir(out_dir)`` when a compatible state is there.
    ``on_step(step)`` is called after every optimizer step and its checkpoint (tests raise from it to simulate
    a kill).
    """
    t_start = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dist = setup_distributed(cfg)
    if not dist.main:
        log = lambda _msg: None  # noqa: E731 - rank 0 speaks for the job
    device = dist.device
    dtype = torch.float32  # master weights and batch tensors; autocast handles bf16 on GPU
    out_dir = Path(out_dir)
    state_dir = train_state_dir(out_dir)
    state_path, log_tmp = state_dir / "state.pt", state_dir / "train_log.jsonl.partial"

    # data and the target's heads
    shards = open_hidden_shards(hidden_shards)
    aux_layer_ids = list(aux_layer_ids) if aux_layer_ids is not None else shards[0].aux_layer_ids
    check_shard_layers(shards, aux_layer_ids, target_num_hidden_layers(Path(target_path)))
    vocab = load_draft_vocab(Path(vocab_path))
    model, dcfg, lm_head = _load_target_heads(Path(target_path), vocab, aux_layer_ids, cfg)
    if (shards[0].hidden_size, shards[0].vocab_size) != (dcfg.hidden_size, dcfg.vocab_size):
        raise ValueError(
            f"hidden shards were captured from a target with hidden {shards[0].hidden_size}, vocab "
            f"{shards[0].vocab_size}; {target_path} has hidden {dcfg.hidden_size}, vocab {dcfg.vocab_size}"
        )
    model = model.to(device)
    if shards[0].layout == "full":
        head = TargetHead(full=lm_head.to(device).float(), draft=lm_head[vocab.target_ids].to(device).float(),
                          t2d=vocab.t2d.to(device))
    else:  # compact shards carry the target's top-k: no [V, H] head on the device (4.7 GB fp32 for Kimi)
        head = TargetHead(full=None, draft=None, t2d=vocab.t2d.to(device))
    del lm_head

    # windows, the held-out split (by sequence), and each epoch's batch order (this rank's share of it)
    held = split_heldout(shards, cfg.eval_fraction, cfg.seed)
    train_w, eval_w = [], []
    for si, sh in enumerate(shards):
        for seq in range(sh.num_seqs):
            (eval_w if (si, seq) in held else train_w).extend(make_windows(si, sh, seq, cfg.max_seq_len, cfg.ttt_steps))
    if not train_w:
        raise ValueError("no training windows: the shards hold no generated (loss-masked) tokens")
    eval_groups = batches(eval_w, cfg, None)[dist.rank :: dist.world]

    def epoch_order(epoch: int) -> list[list[Window]]:
        return shard_for_rank(epoch_batches(train_w, cfg, epoch), dist.rank, dist.world)

    total_steps = sum(len(epoch_order(e)) for e in range(1, cfg.epochs + 1))

    def held_out_eval() -> dict:
        if not eval_w:
            return dict(EMPTY_EVAL)
        return evaluate(model, eval_groups, shards, head, cfg, device, dtype, all_reduce=dist.sum if dist.world > 1 else None)

    # optimizer: AdamW; the LR is set from lr_at(step) before every step
    decay_params = [w for w in model.parameters() if w.requires_grad and w.dim() >= 2]
    other_params = [w for w in model.parameters() if w.requires_grad and w.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay_params, "weight_decay": cfg.weight_decay}, {"params": other_params, "weight_decay": 0.0}],
        lr=cfg.learning_rate,
        betas=(0.9, 0.95),
    )

    # resume from a compatible training state, or start over
    fingerprint = data_fingerprint(hidden_shards, vocab_path, target_path, aux_layer_ids)
    state = load_train_state(state_path, cfg, fingerprint, dist.world) if cfg.resume else None
    dist.barrier()  # every rank has read the state before rank 0 may clear it
    if state is not None:
        missing, unexpected = model.load_state_dict(state["model"], strict=False)
        if set(missing) != {"embed_tokens.weight"} or unexpected:
            raise ValueError(f"{state_path}: drafter tensors missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        opt.load_state_dict(state["optimizer"])
        _set_rng_state(state["rng"])
        progress = Progress(**state["progress"])
        log(f"resuming from {state_path}: epoch {progress.epoch}, batch {progress.position}, "
            f"step {progress.step}/{total_steps}")
    else:
        progress = Progress()
        if dist.main:
            shutil.rmtree(state_dir, ignore_errors=True)
            state_dir.mkdir(parents=True)
    if dist.main:
        for stale in state_dir.rglob(".*.tmp"):  # left by a write that was killed
            stale.unlink()
    resumed = state is not None
    elapsed_before = progress.seconds  # wall time of earlier attempts
    del state

    unroll: nn.Module = TTTUnroll(model, cfg.ttt_steps)
    if dist.world > 1:
        unroll = nn.parallel.DistributedDataParallel(unroll, device_ids=[device] if device.type == "cuda" else None)

    # the train log, kept beside out_dir until the end; a resumed run cuts it back to its checkpoint
    log_file = None
    if dist.main:
        if resumed:
            log_file = log_tmp.open("a+")
            log_file.truncate(min(progress.log_bytes, log_file.seek(0, os.SEEK_END)))
            log_file.seek(0, os.SEEK_END)
        else:
            log_file = log_tmp.open("w")

    def record(event: dict) -> None:
        if log_file is not None:
            log_file.write(json.dumps(event) + "\n")
            log_file.flush()

    def checkpoint() -> None:
        progress.seconds = elapsed_before + time.time() - t_start
        if dist.main:
            progress.log_bytes = log_file.tell()
            save_train_state(state_path, model, opt, progress, cfg, fingerprint, dist.world, total_steps)

    def export(folder: Path, epoch: int, evaluation: dict) -> None:
        facts = {
            "target": str(target_path),
            "hidden_shards": [str(x) for x in hidden_shards],
            "draft_vocab": str(vocab_path),
            "train_config": asdict(cfg),
            "epoch": epoch,
            "tokens_trained": progress.tokens,
            "seconds": round(elapsed_before + time.time() - t_start, 3),
            "simulated_acceptance_length": evaluation.get("simulated_acceptance_length"),
            "heldout_loss": evaluation.get("heldout_loss"),
        }
        model.save_pretrained(folder, extra=facts)
        check_exported_layer_ids(folder, aux_layer_ids)

    try:
        log(
            f"drafter: {sum(x.numel() for x in model.parameters() if x.requires_grad) / 1e6:.2f}M trainable params, "
            f"{len(train_w)} train / {len(eval_w)} held-out windows, {total_steps} steps, device {device}"
            + (f", {dist.world} processes" if dist.world > 1 else "")
        )
        if not resumed:
            progress.untrained = held_out_eval()
            record({"event": "eval", "epoch": 0, **progress.untrained})
            untrained = progress.untrained
            if untrained.get("heldout_start_positions"):
                log(f"untrained: acceptance {untrained['simulated_acceptance_length']:.3f}, loss {untrained['heldout_loss']:.4f}")
        else:
            record({"event": "resume", "epoch": progress.epoch, "position": progress.position, "step": progress.step})

        model.train()
        for epoch in range(progress.epoch, cfg.epochs + 1):
            order = epoch_order(epoch)
            for group in order[progress.position :]:
                t0 = time.time()
                b = load_batch(group, shards, cfg.ttt_steps, device, dtype)
                q, greedy, has_q = head.targets(b)
                lr = lr_at(progress.step, total_steps, cfg)
                for g in opt.param_groups:
                    g["lr"] = lr
                with _autocast(device):
                    steps = unroll(b.aux, b.ids, b.position_ids)
                loss, stats = ttt_loss(steps, q, b, target_mask(head, greedy, has_q, cfg), cfg.step_loss_decay)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip) if cfg.grad_clip > 0 else None
                opt.step()
                # rows, supervised rows and loss of all ranks (one small all-reduce; a no-op in one process)
                counts = dist.sum(torch.tensor([b.rows, float(stats[0][1]), float(loss.detach())], dtype=torch.float64))
                progress.train_seconds += time.time() - t0
                progress.step += 1
                progress.position += 1
                progress.tokens += int(counts[0])
                progress.supervised += int(counts[1])
                if progress.step % cfg.log_every == 0 or progress.step == total_steps:
                    event = {
                        "event": "train",
                        "epoch": epoch,
                        "step": progress.step,
                        "lr": lr,
                        "loss": float(counts[2]) / dist.world,
                        "loss_per_step": [float(c / max(float(w), 1.0)) for c, w, _ in stats],  # rank 0's
                        "acc_per_step": [float(r / max(float(w), 1.0)) for _, w, r in stats],
                        "grad_norm": float(grad_norm) if grad_norm is not None else None,
                        "tokens": progress.tokens,
                        "tokens_per_s": progress.tokens / max(progress.train_seconds, 1e-9),
                    }
                    record(event)
                    log(f"step {progress.step}/{total_steps} loss {event['loss']:.4f} "
                        f"acc0 {event['acc_per_step'][0]:.3f} {event['tokens_per_s']:.0f} tok/s")
                if cfg.checkpoint_every and progress.step % cfg.checkpoint_every == 0 and progress.position < len(order):
                    checkpoint()  # (the epoch's last batch is checkpointed after its evaluation)
                if on_step is not None:
                    on_step(progress.step)

            # end of epoch: evaluate, export `last` (and `best` when held-out acceptance improved), checkpoint
            evaluation = held_out_eval()
            record({"event": "eval", "epoch": epoch, **evaluation})
            progress.epochs.append({"epoch": epoch, **evaluation})
            acceptance = evaluation.get("simulated_acceptance_length")
            # the first epoch, a better held-out acceptance, or every epoch when nothing is held out
            improved = acceptance is None or progress.best_acceptance is None or acceptance > progress.best_acceptance
            if dist.main:
                export(state_dir / "last", epoch, evaluation)
                if improved:
                    for name in ("model.safetensors", "config.json"):
                        _copy_atomic(state_dir / "last" / name, state_dir / "best" / name)
            if improved:
                progress.best_epoch, progress.best_acceptance = epoch, acceptance
            if evaluation.get("heldout_start_positions"):
                log(f"epoch {epoch}: acceptance {acceptance:.3f}, loss {evaluation['heldout_loss']:.4f}"
                    + (" (best so far)" if improved else f" (best: epoch {progress.best_epoch})"))
            progress.epoch, progress.position = epoch + 1, 0
            checkpoint()
    finally:
        if log_file is not None:
            log_file.close()

    # finished: the best epoch's drafter, the log and eval.json go into out_dir; the resumable state goes
    best = {k: v for k, v in progress.epochs[progress.best_epoch - 1].items() if k != "epoch"}
    seconds = elapsed_before + time.time() - t_start
    result = {
        "format": EVAL_FORMAT,
        **best,  # the held-out figures of the drafter in out_dir
        "best_epoch": progress.best_epoch,
        "untrained": {
            k: progress.untrained.get(k) for k in ("simulated_acceptance_length", "acceptance_per_position", "heldout_loss")
        },
        "per_epoch": [
            {k: e.get(k) for k in ("epoch", "simulated_acceptance_length", "heldout_loss")} for e in progress.epochs
        ] if eval_w else [],
        "epochs": progress.epochs,  # every epoch's full held-out evaluation
        "heldout_sequences": len(held),
        "tokens_trained": progress.tokens,  # real rows processed, summed over epochs (each row runs ttt_steps steps)
        "supervised_tokens": progress.supervised,  # step-0 rows that carried loss
        "train_seconds": progress.train_seconds,
        "seconds": seconds,
        "tokens_per_s": progress.tokens / max(progress.train_seconds, 1e-9),
        "optimizer_steps": progress.step,
        "ttt_steps": cfg.ttt_steps,
        "device": str(device),
        "processes": dist.world,
    }
    if dist.main:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("model.safetensors", "config.json"):
            _copy_atomic(state_dir / "best" / name, out_dir / name)
        check_exported_layer_ids(out_dir, aux_layer_ids)
        _copy_atomic(log_tmp, out_dir / "train_log.jsonl")
        atomic_write(out_dir / "eval.json", lambda path: Path(path).write_text(json.dumps(result, indent=2) + "\n"))
        state_path.unlink(missing_ok=True)  # nothing left to resume; last/ and best/ stay
        log_tmp.unlink(missing_ok=True)
        log(f"drafter (epoch {progress.best_epoch} of {cfg.epochs}) written to {out_dir} in {seconds:.1f}s "
            f"({result['tokens_per_s']:.0f} tok/s)")
    dist.barrier()
    return result


# ----------------------------------------------------------------------------------------------------------
# several GPUs: the command the drafter rule runs, and the entry point torchrun starts


def processes_for(gpus: int, cfg: TrainConfig) -> int:
    """Training processes for a job granted ``gpus`` GPUs: one per visible GPU when there are several."""
    if gpus <= 1 or cfg.device == "cpu" or not torch.cuda.is_available():
        return 1
    return min(gpus, torch.cuda.device_count())


def torchrun_command(nproc: int, hidden_shards: Sequence[Path], vocab_path: Path, target_path: Path, out_dir: Path,
                     cfg: TrainConfig, python: str = sys.executable, aux_layer_ids: Sequence[int] | None = None) -> list[str]:
    """``torchrun --standalone --nproc_per_node=N -m aerie.drafter.train ...`` (as python -m torch.distributed.run,
    so it runs under the same interpreter)."""
    return [
        python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "aerie.drafter.train",
        "--hidden", *[str(x) for x in hidden_shards],
        "--vocab", str(vocab_path),
        "--target", str(target_path),
        "--out", str(out_dir),
        "--config", json.dumps(asdict(cfg)),
        *(["--aux-layer-ids", json.dumps(list(aux_layer_ids))] if aux_layer_ids is not None else []),
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m aerie.drafter.train", description="Train an EAGLE-3 drafter.")
    ap.add_argument("--hidden", nargs="+", required=True, help="aerie.hidden/2 shards")
    ap.add_argument("--vocab", required=True, help="aerie.draft-vocab/1 file")
    ap.add_argument("--target", required=True, help="the target's save_pretrained folder")
    ap.add_argument("--out", required=True, help="output folder for the drafter")
    ap.add_argument("--config", default="{}", help="TrainConfig fields as JSON")
    ap.add_argument("--aux-layer-ids", default=None, help="the configured aux layer ids as JSON (checked against the shards)")
    args = ap.parse_args(argv)
    cfg = TrainConfig(**json.loads(args.config))

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    try:
        ids = json.loads(args.aux_layer_ids) if args.aux_layer_ids else None
        train_drafter([Path(x) for x in args.hidden], Path(args.vocab), Path(args.target), Path(args.out), cfg, log=log,
                      aux_layer_ids=ids)
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
