"""Stage 4: token shards -> target hidden states (format ``aerie.hidden/2``).

A capture backend runs the target over each training sequence and returns, per sequence, the EAGLE-3 aux
layers' outputs (SGLang's layer convention, see aerie.target.config) and the final post-norm hidden state:
``hf`` in-process with transformers hooks, ``sglang`` through SGLang's engine (aerie.sglang_capture).
Every shard is checked on the full-precision states, before anything is compressed: finite values, aux
layers neither all zero, constant nor identical to each other, one state per token of the tokens shard, and
``lm_head(final)`` reproducing the recorded next token on generated positions (greedy data).

Two storage layouts (``hidden.layout``, both documented in docs/formats.md):

- ``full``: aux [T, A*H] and final [T, H] in ``storage_dtype`` (bf16: 8H bytes a token for A = 3, the
  layout SpecForge stores). Training applies the target's lm_head to the final states.
- ``compact`` (default): aux in float8 e4m3 with one fp32 scale per (token, aux layer), and instead of the
  final state the target's top-k next-token log-probabilities, computed here through the full lm_head in
  fp32. About 3H + 6k bytes a token (0.38x of full for Kimi K2.5), and training needs no [V, H] lm_head.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from aerie.artifacts import split_packed
from aerie.capture import AuxHiddenCapture
from aerie.formats.hidden import LAYOUTS, quantize_aux, write_hidden_shard
from aerie.formats.tokens import read_tokens_shard
from aerie.target.config import read_text_config, resolve_aux_layer_ids, target_architectures
BACKENDS = ("hf", "sglang")


class HiddenStateError(ValueError):
    """A captured shard is unusable for training (the message says why)."""


# ----------------------------------------------------------------------------------------------------------
# checks on the full-precision states


class CaptureChecks:
    """The shard checks, fed batch by batch so the full-precision states never have to be held together."""

    def __init__(self, layer_ids: list[int], hidden_size: int, where: str):
        self.layer_ids, self.hidden, self.where = layer_ids, hidden_size, where
        A = len(layer_ids)
        self.absmax = torch.zeros(A)
        self.first: torch.Tensor | None = None  # [A, H] the shard's first row of each layer
        self.varies = torch.zeros(A, dtype=torch.bool)  # some row differs from the first one
        self.identical = torch.ones(A, A, dtype=torch.bool)  # layers j, k equal on every row so far
        self.rows = 0

    def update(self, aux: torch.Tensor, final: torch.Tensor) -> None:
        for name, t in (("aux_hidden_states", aux), ("final_hidden_states", final)):
            if not torch.isfinite(t).all():
                raise HiddenStateError(f"{self.where}: {name} contains NaN or inf")
        layers = aux.reshape(aux.shape[0], len(self.layer_ids), self.hidden)  # [n, A, H]
        if not len(layers):
            return
        if self.first is None:
            self.first = layers[0].clone()
        self.absmax = torch.maximum(self.absmax, layers.abs().amax(dim=(0, 2)).float().cpu())
        self.varies |= (layers != self.first).any(-1).any(0).cpu()
        for j in range(len(self.layer_ids)):
            for k in range(j):
                if self.identical[j, k]:
                    self.identical[j, k] = torch.equal(layers[:, j], layers[:, k])
        self.rows += len(layers)

    def finish(self) -> None:
        for j, lid in enumerate(self.layer_ids):
            if self.absmax[j] == 0:
                raise HiddenStateError(f"{self.where}: aux layer {lid} is all zeros (capture silently off?)")
            if self.rows > 1 and not self.varies[j]:
                raise HiddenStateError(f"{self.where}: aux layer {lid} is constant over tokens (capture silently off?)")
            for k in range(j):
                if self.identical[j, k]:
                    raise HiddenStateError(f"{self.where}: aux layers {self.layer_ids[k]} and {lid} are identical")


def check_captured(aux: torch.Tensor, final: torch.Tensor, layer_ids: list[int], where: str) -> None:
    """Refuse states that betray capture problems instead of training a zero-acceptance drafter."""
    checks = CaptureChecks(layer_ids, final.shape[-1], where)
    checks.update(aux, final)
    checks.finish()


def lm_head_topk(final: torch.Tensor, lm_head: torch.Tensor, k: int, max_elements: int = 1 << 26
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, H] final states -> (ids int64 [n, k], log-probs fp32 [n, k]) of the target's top-k next tokens.

    Logits are computed in fp32 on lm_head's device, in row chunks (and, for a bf16 head, vocab chunks) so no
    temporary exceeds ``max_elements`` floats: Kimi's [163840, 7168] head is never copied whole to fp32. The
    log-probabilities are normalised over the full vocabulary, so their exp sums to the top-k mass."""
    V, H = lm_head.shape
    rows = max(1, max_elements // V)
    vocab_chunk = V if lm_head.dtype == torch.float32 else max(1, max_elements // H)
    ids_out, lp_out = [torch.zeros(0, k, dtype=torch.long)], [torch.zeros(0, k)]
    for r in range(0, len(final), rows):
        x = final[r : r + rows].to(lm_head.device, torch.float32)
        logits = torch.cat([x @ lm_head[v : v + vocab_chunk].float().T for v in range(0, V, vocab_chunk)], -1)
        top = logits.topk(k, dim=-1)  # sorted by logit, descending
        lp_out.append((top.values - logits.logsumexp(-1, keepdim=True)).cpu())
        ids_out.append(top.indices.cpu())
    return torch.cat(ids_out), torch.cat(lp_out)


# ----------------------------------------------------------------------------------------------------------
# capture backends


class CaptureBackend(Protocol):
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int

    def capture(self, seqs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per 1-D int sequence: (aux [T, A*H], final [T, H]) on CPU; aux = the decoder-layer outputs for the
        aux ids concatenated in ascending id order (SGLang convention, = transformers output_hidden_states[id+1]);
        final = the post-norm last hidden state."""
        ...

    def close(self) -> None: ...


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


class HFCapture:
    """In-process transformers forward with hooks on the aux layers only (aerie.capture.AuxHiddenCapture)."""

    def __init__(self, target_path: str, layer_ids: list[int], *, device: str = "auto", dtype: str = "auto",
                 batch_tokens: int = 8192):
        from transformers import AutoModelForCausalLM

        from aerie.target.model import pick_device, pick_dtype

        # The model alone, as aerie.target.model.load_target loads it: capture never needs the tokenizer.
        self.device = pick_device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=pick_dtype(dtype, self.device))
        self.model.to(self.device).eval()
        text = self.model.config.get_text_config()
        self.num_hidden_layers = int(text.num_hidden_layers)
        self.hidden_size = int(text.hidden_size)
        self.vocab_size = int(text.vocab_size)
        self.batch_tokens = batch_tokens
        self.layer_ids = list(layer_ids)
        self._hooks = AuxHiddenCapture(self.model, layer_ids).__enter__()
        self.lm_head = self.model.get_output_embeddings().weight  # [V, H] on the capture device
        self._convention_checked = False

    @torch.no_grad()
    def check_convention(self, ids: torch.Tensor, probe_tokens: int = 32) -> None:
        """The hooks against transformers' own ``output_hidden_states[id + 1]`` on a short probe, once per shard.

        An off-by-one in what the hooks capture (a layer's input instead of its output, the wrong layer)
        trains a drafter on features SGLang will never feed it; this comparison makes it a hard error."""
        probe = ids[:probe_tokens].long()[None].to(self.device)
        out = self.model.get_decoder()(input_ids=probe, output_hidden_states=True, use_cache=False)
        hooked = self._hooks.aux_hidden_states()[0]  # [t, A*H]
        H = self.hidden_size
        for j, lid in enumerate(self.layer_ids):
            ref = out.hidden_states[lid + 1][0]
            got = hooked[:, j * H:(j + 1) * H]
            if not torch.allclose(got.float(), ref.float(), rtol=1e-3, atol=1e-3 * float(ref.abs().max())):
                match = [i - 1 for i in range(1, len(out.hidden_states))
                         if out.hidden_states[i][0].shape == got.shape
                         and torch.allclose(got.float(), out.hidden_states[i][0].float(), rtol=1e-3, atol=1e-4)]
                raise HiddenStateError(
                    f"layer convention check failed: the state captured for aux id {lid} is not the output of "
                    f"decoder layer {lid} (transformers' output_hidden_states[{lid + 1}])"
                    + (f"; it equals the output of layer {match[0]}" if match else "") + ": the capture is off by "
                    "one or hooked on the wrong module")
        self._convention_checked = True

    @torch.no_grad()
    def capture(self, seqs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not self._convention_checked and seqs:
            self.check_convention(seqs[0])
        out: list[Any] = [None] * len(seqs)
        inner = self.model.get_decoder()  # the base model: its output is the final, post-norm hidden state
        # Batch sequences of similar length; right padding leaves every real position's causal context
        # untouched, so no attention mask is needed and the states equal an unpadded forward.
        for group in length_batches([len(s) for s in seqs], self.batch_tokens):
            width = len(seqs[group[-1]])
            batch = torch.zeros((len(group), width), dtype=torch.long)
            for r, s in enumerate(group):
                batch[r, : len(seqs[s])] = seqs[s].long()
            final = inner(input_ids=batch.to(self.device), use_cache=False).last_hidden_state  # [b, width, H]
            aux = self._hooks.aux_hidden_states()  # [b, width, A*H]
            for r, s in enumerate(group):
                n = len(seqs[s])
                out[s] = (aux[r, :n].cpu(), final[r, :n].cpu())
        return out

    def close(self) -> None:
        self._hooks.__exit__(None, None, None)
        del self.model, self.lm_head


def open_backend(name: str, target_path: str, layer_ids: list[int], *, device: str = "auto", dtype: str = "auto",
                 batch_tokens: int = 8192, options: dict[str, Any] | None = None) -> tuple[CaptureBackend, torch.Tensor]:
    """(backend, the target's lm_head weight [V, H] on the capture device) for ``hidden.backend``."""
    if name == "hf":
        cap = HFCapture(target_path, layer_ids, device=device, dtype=dtype, batch_tokens=batch_tokens)
        return cap, cap.lm_head
    if name == "sglang":
        from aerie.sglang_capture import SGLangCapture  # SGLang's environment only: imported when asked for
        from aerie.target.heads import read_target_heads
        from aerie.target.model import pick_device

        cap = SGLangCapture(target_path, layer_ids, dtype=dtype, **(options or {}))
        # SGLang keeps its weights to itself: read only the lm_head tensor from the safetensors files
        return cap, read_target_heads(target_path, roles=["lm_head"]).lm_head.to(pick_device(device))
    raise ValueError(f"hidden.backend: {name!r} is not one of {', '.join(BACKENDS)}")


# ----------------------------------------------------------------------------------------------------------
# the stage


@torch.no_grad()
def capture_shard(
    tokens_path: Path,
    out_path: Path,
    target_path: str,
    *,
    aux_layer_ids: Sequence[int] | None,
    layout: str = "compact",
    target_topk: int = 32,
    backend: str = "hf",
    backend_options: dict[str, Any] | None = None,
    batch_tokens: int = 8192,
    storage_dtype: str = "bfloat16",
    device: str = "auto",
    dtype: str = "auto",
    threads: int | None = None,
    min_next_token_agreement: float = 0.0,
    min_next_token_in_topk: float = 0.0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Capture the aux + final states of every sequence of a tokens shard, check them, write one shard."""
    from aerie.target.model import set_threads

    if layout not in LAYOUTS:
        raise ValueError(f"hidden.layout: {layout!r} is not one of {', '.join(LAYOUTS)}")
    set_threads(threads)
    tensors, meta = read_tokens_shard(tokens_path)  # a shifted or partial loss mask stops here
    text = read_text_config(target_path)
    num_layers = int(text["num_hidden_layers"])
    layer_ids = resolve_aux_layer_ids(aux_layer_ids, num_layers, target_architectures(target_path))
    A = len(layer_ids)
    seqs = split_packed(tensors["input_ids"], tensors["seq_offsets"])
    masks = split_packed(tensors["loss_mask"], tensors["seq_offsets"])
    started = time.perf_counter()

    cap, lm_head = open_backend(backend, target_path, layer_ids, device=device, dtype=dtype,
                                batch_tokens=batch_tokens, options=backend_options)
    try:
        if cap.num_hidden_layers != num_layers:
            raise HiddenStateError(f"{out_path}: backend {backend} sees {cap.num_hidden_layers} layers, "
                                   f"{target_path}/config.json says {num_layers}")
        H = cap.hidden_size
        k = min(target_topk, cap.vocab_size)
        checks = CaptureChecks(layer_ids, H, str(out_path))
        agree = in_topk = total = 0
        mass_sum, mass_rows = 0.0, 0
        # Capture a batch of sequences at a time and compress it at once: only the stored form of the shard
        # is ever held whole. Ascending length keeps padding low; outputs go back in the shard's order.
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        per_seq: list[dict[str, torch.Tensor] | None] = [None] * len(seqs)
        for group in length_batches([len(seqs[i]) for i in order], batch_tokens):
            idx = [order[g] for g in group]
            outs = cap.capture([seqs[s] for s in idx])
            if len(outs) != len(idx):
                raise HiddenStateError(f"{out_path}: backend {backend} returned {len(outs)} results for {len(idx)} sequences")
            for s, (aux, final) in zip(idx, outs):
                n = len(seqs[s])
                if aux.shape != (n, A * H) or final.shape != (n, H):
                    raise HiddenStateError(f"{out_path}: sequence {s}: backend returned aux {tuple(aux.shape)}, "
                                           f"final {tuple(final.shape)} for {n} tokens (expected ({n}, {A * H}), ({n}, {H}))")
                checks.update(aux, final)
                # Next-token agreement: lm_head(final at t) should give token t+1 wherever t+1 was generated.
                top_ids, top_lp = lm_head_topk(final, lm_head, k)
                gen_next = masks[s][1:].bool()
                recorded = seqs[s][1:][gen_next].long()
                agree += int((top_ids[:-1, 0][gen_next] == recorded).sum())
                # Sampled data (temperature > 0): the sampled token should still be among the target's top k.
                in_topk += int((top_ids[:-1][gen_next] == recorded[:, None]).any(-1).sum())
                total += int(gen_next.sum())
                if layout == "compact":
                    q, scale = quantize_aux(aux, A)
                    mass = top_lp[:-1][gen_next].exp().sum(-1)
                    mass_sum, mass_rows = mass_sum + float(mass.sum()), mass_rows + len(mass)
                    per_seq[s] = {"aux_hidden_states": q, "aux_scales": scale,
                                  "target_topk_ids": top_ids.to(torch.int32), "target_topk_logprobs": top_lp.half()}
                else:
                    store = getattr(torch, storage_dtype)
                    per_seq[s] = {"aux_hidden_states": aux.to(store), "final_hidden_states": final.to(store)}
        checks.finish()
    finally:
        cap.close()

    if checks.rows != tensors["input_ids"].shape[0]:
        raise HiddenStateError(f"{out_path}: captured {checks.rows} positions, tokens shard has {tensors['input_ids'].shape[0]}")
    agreement = agree / total if total else 1.0
    topk_rate = in_topk / total if total else 1.0
    if agreement < min_next_token_agreement:
        raise HiddenStateError(
            f"{out_path}: lm_head(final hidden) reproduces only {agreement:.2%} of recorded next tokens "
            f"(< hidden.min_next_token_agreement {min_next_token_agreement:.2%}): states and tokens do not belong "
            f"together (tokens shifted, another target or template, or capture broken)"
        )
    if topk_rate < min_next_token_in_topk:
        raise HiddenStateError(
            f"{out_path}: only {topk_rate:.2%} of recorded next tokens are among lm_head(final hidden)'s top {k} "
            f"(< hidden.min_next_token_in_topk {min_next_token_in_topk:.2%}): states and tokens do not belong "
            f"together (tokens shifted, another target or template, or capture broken)"
        )
    stored = {name: torch.cat([p[name] for p in per_seq]) for name in (per_seq[0] if per_seq else ())}

    facts: dict[str, Any] = {
        "layout": layout,
        "aux_layer_ids": layer_ids,
        "num_hidden_layers": num_layers,
        "hidden_size": H,
        "vocab_size": cap.vocab_size,
        "target": str(target_path),
        "backend": backend,
        "sample_ids": meta.get("sample_ids", []),
        # the tokens shard's mask facts, so readers can check the mask again (aerie.formats.tokens.check_tokens_shard)
        **{key: meta[key] for key in ("generation_prompt_ids", "stop_ids", "cut_sequences")},
        "next_token_agreement": round(agreement, 6),
        "next_token_in_topk": round(topk_rate, 6),
        "next_token_agreement_positions": total,
    }
    if layout == "compact":
        facts.update(aux_dtype="float8_e4m3fn", target_topk=k,
                     target_topk_mass=round(mass_sum / mass_rows, 6) if mass_rows else None)
    else:
        facts["storage_dtype"] = storage_dtype
    write_hidden_shard(
        out_path,
        {"input_ids": tensors["input_ids"], "loss_mask": tensors["loss_mask"], "seq_offsets": tensors["seq_offsets"], **stored},
        facts,
    )
    summary = {
        "sequences": len(seqs),
        "tokens": checks.rows,
        "layout": layout,
        "aux_layer_ids": layer_ids,
        "next_token_agreement": agreement,
        "next_token_in_topk": topk_rate,
        "bytes": out_path.stat().st_size,
        "seconds": round(time.perf_counter() - started, 2),
    }
    if layout == "compact":
        summary["target_topk_mass"] = facts["target_topk_mass"]
    log(f"{out_path.name}: {summary}")
    return summary
