"""Stage 4: token shards -> target hidden states (format ``aerie.hidden/1``).

The target runs a forward pass over each training sequence; forward hooks keep only the EAGLE-3 aux
layers' outputs (SGLang's layer convention, see aerie.capture) and the final post-norm hidden state,
from which ``lm_head`` gives the target's logits at training time. Every shard is checked on the way
out: finite values, aux layers neither constant nor identical to each other, and the final state
reproducing the recorded next token on generated positions (greedy data).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from aerie.artifacts import load_packed, save_packed, split_packed
from aerie.capture import AuxHiddenCapture, check_aux_layer_ids, default_aux_layer_ids
from aerie.target import load_target, set_threads
from aerie.tokens import TOKENS_FORMAT

HIDDEN_FORMAT = "aerie.hidden/1"


class HiddenStateError(ValueError):
    """A captured shard is unusable for training (the message says why)."""


def resolve_aux_layer_ids(configured: Sequence[int] | None, num_hidden_layers: int) -> list[int]:
    ids = list(configured) if configured else default_aux_layer_ids(num_hidden_layers)
    return check_aux_layer_ids(ids, num_hidden_layers)


def check_captured(aux: torch.Tensor, final: torch.Tensor, layer_ids: list[int], where: str) -> None:
    """Refuse states that betray capture problems instead of training a zero-acceptance drafter."""
    for name, t in (("aux_hidden_states", aux), ("final_hidden_states", final)):
        if not torch.isfinite(t.float()).all():
            raise HiddenStateError(f"{where}: {name} contains NaN or inf")
    hidden = final.shape[-1]
    layers = aux.float().reshape(aux.shape[0], len(layer_ids), hidden)
    for j, lid in enumerate(layer_ids):
        x = layers[:, j]
        if x.abs().max() == 0:
            raise HiddenStateError(f"{where}: aux layer {lid} is all zeros (capture silently off?)")
        if x.numel() > hidden and (x - x[0]).abs().max() == 0:
            raise HiddenStateError(f"{where}: aux layer {lid} is constant over tokens (capture silently off?)")
        for k in range(j):
            if torch.equal(x, layers[:, k]):
                raise HiddenStateError(f"{where}: aux layers {layer_ids[k]} and {lid} are identical")


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group sequence indices by ascending length so each padded batch holds at most batch_tokens."""
    batches: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


@torch.no_grad()
def capture_shard(
    tokens_path: Path,
    out_path: Path,
    target_path: str,
    *,
    aux_layer_ids: Sequence[int] | None,
    batch_tokens: int = 8192,
    storage_dtype: str = "bfloat16",
    device: str = "auto",
    dtype: str = "auto",
    threads: int | None = None,
    min_next_token_agreement: float = 0.0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Capture aux + final hidden states for every sequence of a tokens shard; write one packed shard."""
    set_threads(threads)
    tensors, meta = load_packed(tokens_path, TOKENS_FORMAT)
    model, _tok, dev = load_target(target_path, device=device, dtype=dtype)
    num_layers = model.config.num_hidden_layers
    layer_ids = resolve_aux_layer_ids(aux_layer_ids, num_layers)
    store = getattr(torch, storage_dtype)
    inner = model.get_decoder()  # the base model: its output is the final, post-norm hidden state

    seqs = split_packed(tensors["input_ids"], tensors["seq_offsets"])
    masks = split_packed(tensors["loss_mask"], tensors["seq_offsets"])
    aux_out: list[torch.Tensor | None] = [None] * len(seqs)
    final_out: list[torch.Tensor | None] = [None] * len(seqs)
    started = time.perf_counter()
    # Batch sequences of similar length; right padding leaves every real position's causal context
    # untouched, so no attention mask is needed and the states equal an unpadded forward.
    with AuxHiddenCapture(model, layer_ids) as cap:
        for group in length_batches([len(s) for s in seqs], batch_tokens):
            width = len(seqs[group[-1]])
            batch = torch.zeros((len(group), width), dtype=torch.long)
            for r, s in enumerate(group):
                batch[r, : len(seqs[s])] = seqs[s].long()
            final = inner(input_ids=batch.to(dev), use_cache=False).last_hidden_state  # [b, width, H]
            aux = cap.aux_hidden_states()  # [b, width, A*H]
            for r, s in enumerate(group):
                n = len(seqs[s])
                aux_out[s] = aux[r, :n].to("cpu", store)
                final_out[s] = final[r, :n].to("cpu", store)

    aux_all = torch.cat(aux_out)  # [T, A*H]
    final_all = torch.cat(final_out)  # [T, H]
    if aux_all.shape[0] != tensors["input_ids"].shape[0]:
        raise HiddenStateError(f"{out_path}: captured {aux_all.shape[0]} positions, tokens shard has {tensors['input_ids'].shape[0]}")
    check_captured(aux_all, final_all, layer_ids, str(out_path))

    # Next-token agreement: lm_head(final at t) should predict token t+1 wherever t+1 was generated.
    agree = total = 0
    head = model.get_output_embeddings()
    for s, (ids, m, fin) in enumerate(zip(seqs, masks, final_out)):
        target_pos = m[1:].bool()
        if target_pos.any():
            logits = head(fin[:-1][target_pos].to(dev, head.weight.dtype))
            agree += int((logits.argmax(-1).cpu() == ids[1:][target_pos].long()).sum())
            total += int(target_pos.sum())
    agreement = agree / total if total else 1.0
    if agreement < min_next_token_agreement:
        raise HiddenStateError(
            f"{out_path}: lm_head(final hidden) reproduces only {agreement:.2%} of recorded next tokens "
            f"(< {min_next_token_agreement:.2%}): states and tokens do not belong together"
        )

    save_packed(
        out_path,
        {
            "input_ids": tensors["input_ids"],
            "loss_mask": tensors["loss_mask"],
            "seq_offsets": tensors["seq_offsets"],
            "aux_hidden_states": aux_all,
            "final_hidden_states": final_all,
        },
        {
            "format": HIDDEN_FORMAT,
            "aux_layer_ids": layer_ids,
            "num_hidden_layers": num_layers,
            "hidden_size": model.config.hidden_size,
            "vocab_size": model.config.vocab_size,
            "target": str(target_path),
            "sample_ids": meta.get("sample_ids", []),
            "storage_dtype": storage_dtype,
            "next_token_agreement": round(agreement, 6),
        },
    )
    summary = {
        "sequences": len(seqs),
        "tokens": int(aux_all.shape[0]),
        "aux_layer_ids": layer_ids,
        "next_token_agreement": agreement,
        "seconds": round(time.perf_counter() - started, 2),
    }
    log(f"{out_path.name}: {summary}")
    return summary
