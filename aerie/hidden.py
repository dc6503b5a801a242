"""Stage 4: token shards -> target hidden states (format ``aerie.hidden/2``).

A capture backend runs the target over each training sequence and returns, per sequence, the EAGLE-3 aux
layers' outputs (SGLang's layer convention, see aerie.target.config) and the final post-norm hidden state:
``hf`` in-process with transformers hooks, ``sglang`` through SGLang's engine (aerie.sglang_capture).
Every shard is checked on the full-precision states, before anything is compressed: finite values, aux
layers neither all zero, constant nor identical to each other, one state per token of the tokens shard, and
``lm_head(final)`` reproducing the recorded next token on generated positions (greedy data).

The target is loaded once per run, not once per shard (:func:`capture_shards`, rule ``hidden``): every shard
is captured into the capture store (aerie.capture_store) and hard-linked to its output, so a rerun after a
crash reuses the finished shards and captures only the rest, with one load.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from aerie.artifacts import split_packed
from aerie.capture import AuxHiddenCapture, base_decoder
from aerie.formats.hidden import FP8, LAYOUTS, quantize_aux, write_hidden_shard
from aerie.formats.tokens import mask_facts, read_tokens_shard
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
        layers = aux.reshape(aux.shape[0], len(self.layer_ids), self.hidden)  # [n, A, H]
        # NaN/inf first, per aux layer and with the first bad position: a NaN would otherwise pass the checks
        # below (every comparison with NaN is false) and poison training, or the fp8 scales of the compact layout.
        bad = ~torch.isfinite(layers).all(-1)  # [n, A]
        if bad.any():
            row, j = (int(x) for x in bad.nonzero()[0])
            raise HiddenStateError(
                f"{self.where}: aux_hidden_states of aux layer {self.layer_ids[j]} contain NaN or "
                f"inf ({int(bad[:, j].sum())} of {len(layers)} positions of this batch, the "
                f"first at position {row} of the batch)"
            )
        if not torch.isfinite(final).all():
            row = int((~torch.isfinite(final).all(-1)).nonzero()[0, 0])
            raise HiddenStateError(
                f"{self.where}: final_hidden_states contain NaN or inf (first at position {row} of the batch)"
            )
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
            # Written so that NaN fails too (were the finiteness check above ever bypassed): "not > 0", not "== 0".
            if not bool(self.absmax[j] > 0):
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


def lm_head_topk(
    final: torch.Tensor, lm_head: torch.Tensor, k: int, max_elements: int = 1 << 26
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

    def __init__(
        self,
        target_path: str,
        layer_ids: list[int],
        *,
        device: str = "auto",
        dtype: str = "auto",
        batch_tokens: int = 8192,
        trust_remote_code: bool = False,
    ):
        from transformers import AutoModelForCausalLM

        from aerie.target.model import pick_device, pick_dtype

        # The model alone, as aerie.target.model.load_target loads it: capture never needs the tokenizer.
        # trust_remote_code (config target.trust_remote_code): Kimi K2.5 and its rehearsal target load through
        # their own modeling code, a wrapper whose decoder stack is language_model.model (aerie.capture).
        self.device = pick_device(device)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(target_path), dtype=pick_dtype(dtype, self.device), trust_remote_code=trust_remote_code
        )
        self.model.to(self.device).eval()
        self.decoder = base_decoder(self.model)  # its output is the final, post-norm hidden state
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
        """The hooks against transformers' own ``output_hidden_states[id + 1]`` on a short probe, once per load.

        An off-by-one in what the hooks capture (a layer's input instead of its output, the wrong layer)
        trains a drafter on features SGLang will never feed it; this comparison makes it a hard error."""
        probe = ids[:probe_tokens].long()[None].to(self.device)
        out = self.decoder(input_ids=probe, output_hidden_states=True, use_cache=False)
        hooked = self._hooks.aux_hidden_states()[0]  # [t, A*H]
        H = self.hidden_size
        for j, lid in enumerate(self.layer_ids):
            ref = out.hidden_states[lid + 1][0]
            got = hooked[:, j * H : (j + 1) * H]
            if not torch.allclose(got.float(), ref.float(), rtol=1e-3, atol=1e-3 * float(ref.abs().max())):
                match = [
                    i - 1
                    for i in range(1, len(out.hidden_states))
                    if out.hidden_states[i][0].shape == got.shape
                    and torch.allclose(got.float(), out.hidden_states[i][0].float(), rtol=1e-3, atol=1e-4)
                ]
                raise HiddenStateError(
                    f"layer convention check failed: the state captured for aux id {lid} is not the output of "
                    f"decoder layer {lid} (transformers' output_hidden_states[{lid + 1}])"
                    + (f"; it equals the output of layer {match[0]}" if match else "")
                    + ": the capture is off by "
                    "one or hooked on the wrong module"
                )
        self._convention_checked = True

    @torch.no_grad()
    def capture(self, seqs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not self._convention_checked and seqs:
            self.check_convention(seqs[0])
        out: list[Any] = [None] * len(seqs)
        inner = self.decoder
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
        del self.model, self.decoder, self.lm_head


def open_backend(
    name: str,
    target_path: str,
    layer_ids: list[int],
    *,
    device: str = "auto",
    dtype: str = "auto",
    batch_tokens: int = 8192,
    options: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
) -> tuple[CaptureBackend, torch.Tensor]:
    """(backend, the target's lm_head weight [V, H] on the capture device) for ``hidden.backend``.

    This is the target load (minutes to tens of minutes for a 1T-parameter model): callers open it once for
    every shard of a run (:class:`TargetSession`). ``trust_remote_code`` is for the ``hf`` backend (the
    ``sglang`` backend takes its own from ``hidden.sglang``)."""
    if name == "hf":
        cap = HFCapture(
            target_path,
            layer_ids,
            device=device,
            dtype=dtype,
            batch_tokens=batch_tokens,
            trust_remote_code=trust_remote_code,
        )
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


def check_agreement(
    where: str, agreement: float, topk_rate: float, k: int, min_agreement: float, min_in_topk: float
) -> None:
    """Refuse a shard whose final states do not predict its recorded tokens (hidden.min_next_token_*)."""
    if agreement < min_agreement:
        raise HiddenStateError(
            f"{where}: lm_head(final hidden) reproduces only {agreement:.2%} of recorded next tokens "
            f"(< hidden.min_next_token_agreement {min_agreement:.2%}): states and tokens do not belong "
            f"together (tokens shifted, another target or template, or capture broken)"
        )
    if topk_rate < min_in_topk:
        raise HiddenStateError(
            f"{where}: only {topk_rate:.2%} of recorded next tokens are among lm_head(final hidden)'s top {k} "
            f"(< hidden.min_next_token_in_topk {min_in_topk:.2%}): states and tokens do not belong "
            f"together (tokens shifted, another target or template, or capture broken)"
        )


class TargetSession:
    """The target opened for capture at most once, however many shards go through it.

    The load is lazy: a job whose shards are all reused from the capture store never loads the target.
    ``loads`` counts the loads (the capture job logs it; tests and bench/hidden_loads.py assert it)."""

    def __init__(
        self,
        target_path: str,
        *,
        aux_layer_ids: Sequence[int] | None,
        backend: str = "hf",
        backend_options: dict[str, Any] | None = None,
        batch_tokens: int = 8192,
        device: str = "auto",
        dtype: str = "auto",
        trust_remote_code: bool = False,
        log: Callable[[str], None] = print,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"hidden.backend: {backend!r} is not one of {', '.join(BACKENDS)}")
        self.target_path, self.backend_name, self.log = str(target_path), backend, log
        self.options = dict(
            backend_options=backend_options,
            batch_tokens=batch_tokens,
            device=device,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
        )
        text = read_text_config(target_path)
        self.num_layers = int(text["num_hidden_layers"])
        # Resolved from config.json before anything loads: unservable ids fail in seconds, not after a load.
        self.layer_ids = resolve_aux_layer_ids(aux_layer_ids, self.num_layers, target_architectures(target_path))
        self.loads = 0
        self.load_seconds = 0.0
        self._opened: tuple[CaptureBackend, torch.Tensor] | None = None

    def open(self) -> tuple[CaptureBackend, torch.Tensor]:
        """(backend, lm_head [V, H]); loads the target on the first call only."""
        if self._opened is None:
            o = self.options
            self.log(f"loading the target {self.target_path} for capture ({self.backend_name} backend)")
            started = time.perf_counter()
            cap, lm_head = open_backend(
                self.backend_name,
                self.target_path,
                self.layer_ids,
                device=o["device"],
                dtype=o["dtype"],
                batch_tokens=o["batch_tokens"],
                options=o["backend_options"],
                trust_remote_code=o["trust_remote_code"],
            )
            if cap.num_hidden_layers != self.num_layers:
                cap.close()
                raise HiddenStateError(
                    f"backend {self.backend_name} sees {cap.num_hidden_layers} layers, "
                    f"{self.target_path}/config.json says {self.num_layers}"
                )
            self.loads += 1
            self.load_seconds += time.perf_counter() - started
            self.log(f"target loaded in {time.perf_counter() - started:.1f}s (target loads in this job: {self.loads})")
            self._opened = (cap, lm_head)
        return self._opened

    def close(self) -> None:
        if self._opened is not None:
            self._opened[0].close()
            self._opened = None

    def __enter__(self) -> TargetSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
    trust_remote_code: bool = False,
    threads: int | None = None,
    min_next_token_agreement: float = 0.0,
    min_next_token_in_topk: float = 0.0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Capture the aux + final states of every sequence of one tokens shard with a target loaded for it alone,
    check them, write one shard. The pipeline captures all shards with one load: :func:`capture_shards`."""
    from aerie.target.model import set_threads

    if layout not in LAYOUTS:
        raise ValueError(f"hidden.layout: {layout!r} is not one of {', '.join(LAYOUTS)}")
    set_threads(threads)
    with TargetSession(
        target_path,
        aux_layer_ids=aux_layer_ids,
        backend=backend,
        backend_options=backend_options,
        batch_tokens=batch_tokens,
        device=device,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        log=log,
    ) as session:
        return capture_into(
            session,
            tokens_path,
            out_path,
            layout=layout,
            target_topk=target_topk,
            storage_dtype=storage_dtype,
            min_next_token_agreement=min_next_token_agreement,
            min_next_token_in_topk=min_next_token_in_topk,
            log=log,
        )


@torch.no_grad()
def capture_into(
    session: TargetSession,
    tokens_path: Path,
    out_path: Path,
    *,
    layout: str = "compact",
    target_topk: int = 32,
    storage_dtype: str = "bfloat16",
    min_next_token_agreement: float = 0.0,
    min_next_token_in_topk: float = 0.0,
    extra_facts: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Capture one tokens shard with the session's target (loading it if this is the first shard), check it
    on the full-precision states, write it atomically to ``out_path``. Nothing of one shard carries over to
    the next: the bytes equal those of a session opened for this shard alone."""
    if layout not in LAYOUTS:
        raise ValueError(f"hidden.layout: {layout!r} is not one of {', '.join(LAYOUTS)}")
    tensors, meta = read_tokens_shard(tokens_path)  # a shifted or partial loss mask stops here
    num_layers, layer_ids, backend, target_path = (
        session.num_layers,
        session.layer_ids,
        session.backend_name,
        session.target_path,
    )
    A = len(layer_ids)
    seqs = split_packed(tensors["input_ids"], tensors["seq_offsets"])
    masks = split_packed(tensors["loss_mask"], tensors["seq_offsets"])
    cap, lm_head = session.open()
    batch_tokens = session.options["batch_tokens"]
    started = time.perf_counter()  # after the load: "seconds" is what this shard's capture took
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
            raise HiddenStateError(
                f"{out_path}: backend {backend} returned {len(outs)} results for {len(idx)} sequences"
            )
        for s, (aux, final) in zip(idx, outs):
            n = len(seqs[s])
            if aux.shape != (n, A * H) or final.shape != (n, H):
                raise HiddenStateError(
                    f"{out_path}: sequence {s}: backend returned aux {tuple(aux.shape)}, "
                    f"final {tuple(final.shape)} for {n} tokens (expected ({n}, {A * H}), "
                    f"({n}, {H}))"
                )
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
                per_seq[s] = {
                    "aux_hidden_states": q,
                    "aux_scales": scale,
                    "target_topk_ids": top_ids.to(torch.int32),
                    "target_topk_logprobs": top_lp.half(),
                }
            else:
                store = getattr(torch, storage_dtype)
                per_seq[s] = {"aux_hidden_states": aux.to(store), "final_hidden_states": final.to(store)}
    if checks.rows:  # an empty shard (a dataset that reached its quota) has no states to judge
        checks.finish()

    if checks.rows != tensors["input_ids"].shape[0]:
        raise HiddenStateError(
            f"{out_path}: captured {checks.rows} positions, tokens shard has {tensors['input_ids'].shape[0]}"
        )
    agreement = agree / total if total else 1.0
    topk_rate = in_topk / total if total else 1.0
    check_agreement(str(out_path), agreement, topk_rate, k, min_next_token_agreement, min_next_token_in_topk)
    if per_seq:
        stored = {name: torch.cat([p[name] for p in per_seq]) for name in per_seq[0]}
    elif layout == "compact":  # zero sequences: the same tensors with no rows, so every reader stays simple
        stored = {
            "aux_hidden_states": torch.zeros(0, A * H, dtype=FP8),
            "aux_scales": torch.zeros(0, A),
            "target_topk_ids": torch.zeros(0, k, dtype=torch.int32),
            "target_topk_logprobs": torch.zeros(0, k, dtype=torch.float16),
        }
    else:
        store = getattr(torch, storage_dtype)
        stored = {
            "aux_hidden_states": torch.zeros(0, A * H, dtype=store),
            "final_hidden_states": torch.zeros(0, H, dtype=store),
        }

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
        **mask_facts(meta),
        "next_token_agreement": round(agreement, 6),
        "next_token_in_topk": round(topk_rate, 6),
        "next_token_agreement_positions": total,
        **(extra_facts or {}),
    }
    if layout == "compact":
        facts.update(
            aux_dtype="float8_e4m3fn",
            target_topk=k,
            target_topk_mass=round(mass_sum / mass_rows, 6) if mass_rows else None,
        )
    else:
        facts["storage_dtype"] = storage_dtype
    write_hidden_shard(
        out_path,
        {
            "input_ids": tensors["input_ids"],
            "loss_mask": tensors["loss_mask"],
            "seq_offsets": tensors["seq_offsets"],
            **stored,
        },
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


# ----------------------------------------------------------------------------------------------------------
# the capture job: every shard of a run with one target load (aerie.capture_store)


@dataclass(frozen=True)
class ShardTask:
    """One shard of the capture job: its tokens shard, its declared output, and its own log file."""

    tokens: Path
    out: Path
    log: Path | None = None


def _shard_logger(path: Path | None, job_log: Callable[[str], None]) -> Callable[[str], None]:
    """Lines go to the job's log and, appended with a timestamp, to the shard's own log (not a declared
    output: Snakemake never deletes it, so every attempt's story of the shard stays readable)."""
    if path is None:
        return job_log
    path.parent.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        job_log(msg)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}\n")

    return log


@torch.no_grad()
def capture_shards(
    shards: Sequence[ShardTask],
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
    trust_remote_code: bool = False,
    threads: int | None = None,
    min_next_token_agreement: float = 0.0,
    min_next_token_in_topk: float = 0.0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Capture every shard with at most one target load; each shard keeps its own file, checks and log.

    A shard is captured into the capture store and hard-linked to its output (aerie.capture_store). A store
    entry whose capture key matches - same tokens bytes, target and settings - is reused without any work,
    after its recorded next-token figures pass the current thresholds; so a rerun after a crash or a failed
    shard captures only what is missing, and loads the target only if something is. The first shard that
    fails stops the job (a capture problem is rarely confined to one shard, and GPU hours are not free):
    the shards finished before it stay in the store."""
    from aerie.capture_store import (
        KEY_FIELD,
        capture_key,
        capture_settings,
        file_sha256,
        publish,
        store_path,
        stored_facts,
        target_identity,
    )
    from aerie.target.model import set_threads

    if layout not in LAYOUTS:
        raise ValueError(f"hidden.layout: {layout!r} is not one of {', '.join(LAYOUTS)}")
    set_threads(threads)
    started = time.perf_counter()
    session = TargetSession(
        target_path,
        aux_layer_ids=aux_layer_ids,
        backend=backend,
        backend_options=backend_options,
        batch_tokens=batch_tokens,
        device=device,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        log=log,
    )
    settings = capture_settings(
        aux_layer_ids=session.layer_ids,
        layout=layout,
        backend=backend,
        backend_options=backend_options,
        batch_tokens=batch_tokens,
        device=device,
        dtype=dtype,
        target_topk=target_topk,
        storage_dtype=storage_dtype,
    )
    target = target_identity(target_path)
    captured: list[str] = []
    reused: list[str] = []
    capture_seconds = 0.0
    with session:
        for n, task in enumerate(shards, 1):
            shard_log = _shard_logger(task.log, log)
            store = store_path(task.out)
            try:
                key = capture_key(file_sha256(task.tokens), target, settings)
                facts = stored_facts(store, key)
                if facts is not None:
                    check_agreement(
                        str(store),
                        float(facts["next_token_agreement"]),
                        float(facts["next_token_in_topk"]),
                        int(facts.get("target_topk") or 0),
                        min_next_token_agreement,
                        min_next_token_in_topk,
                    )
                    shard_log(
                        f"{task.out} [{n}/{len(shards)}]: reused from the capture store ({store}: same "
                        f"tokens, target and settings), nothing captured"
                    )
                    reused.append(str(task.out))
                else:
                    shard_log(f"{task.out} [{n}/{len(shards)}]: capturing {task.tokens}")
                    store.parent.mkdir(parents=True, exist_ok=True)
                    summary = capture_into(
                        session,
                        task.tokens,
                        store,
                        layout=layout,
                        target_topk=target_topk,
                        storage_dtype=storage_dtype,
                        min_next_token_agreement=min_next_token_agreement,
                        min_next_token_in_topk=min_next_token_in_topk,
                        extra_facts={KEY_FIELD: key},
                        log=shard_log,
                    )
                    capture_seconds += summary["seconds"]
                    captured.append(str(task.out))
                publish(store, task.out)
            except Exception as e:
                shard_log(f"{task.out}: FAILED: {type(e).__name__}: {e}")
                log(
                    f"capture stopped at {task.out} ({n} of {len(shards)}): {len(captured)} captured and "
                    f"{len(reused)} reused before it stay in the capture store for the next attempt"
                )
                raise
    result = {
        "shards": len(shards),
        "captured": len(captured),
        "reused": len(reused),
        "target_loads": session.loads,
        "load_seconds": round(session.load_seconds, 2),
        "capture_seconds": round(capture_seconds, 2),
        "seconds": round(time.perf_counter() - started, 2),
    }
    log(
        f"aerie capture: {result['shards']} shards, {result['captured']} captured, {result['reused']} reused from "
        f"the capture store; target loads in this job: {session.loads} ({result['load_seconds']}s loading, "
        f"{result['capture_seconds']}s capturing)"
    )
    return result
