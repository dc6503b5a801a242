"""The target opened for capture: the backends that run it and the session that loads it at most once.

A backend returns, per sequence, the EAGLE-3 aux layers' outputs (SGLang's layer convention, see
aerie.target_model.config) and the final post-norm hidden state: ``hf`` in-process with forward hooks on the aux
layers only (aerie.target_model.capture), its hooks checked against transformers' ``output_hidden_states`` once per
load;
``sglang`` through SGLang's engine (aerie.hidden.sglang, imported only when asked for), with the lm_head read
from the target's safetensors. :class:`TargetSession` loads one lazily and counts the loads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from transformers import AutoModelForCausalLM

from aerie.formats.backends import backend_named
from aerie.hidden.checks import HiddenStateError
from aerie.hidden.head import place_lm_head
from aerie.hidden.sglang.capture import SGLangCapture  # SGLang's env only, when asked for
from aerie.hidden.sglang.mapping import lm_head_copy, target_dims
from aerie.target_model.capture import AuxHiddenCapture, base_decoder
from aerie.target_model.config import (
    read_config,
    read_text_config,
    resolve_aux_layer_ids,
    target_architectures,
    weight_dtype_bytes,
)
from aerie.target_model.model import pick_device, pick_dtype


class CaptureBackend(Protocol):
    """What a capture backend provides: :class:`HFCapture`, or aerie.hidden.sglang's ``SGLangCapture``."""

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
    """In-process transformers forward, hooks on the aux layers only (aerie.target_model.capture.AuxHiddenCapture)."""

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
        # The model alone, as aerie.target_model.model.load_target loads it: capture never needs the tokenizer.
        # trust_remote_code (config target.trust_remote_code): Kimi K2.5 and its rehearsal target load through
        # their own modeling code, a wrapper whose decoder stack is language_model.model (aerie.target_model.capture).
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
    log: Callable[[str], None] = print,
) -> tuple[CaptureBackend, torch.Tensor]:
    """(backend, the target's lm_head weight [V, H] on the capture device) for ``hidden.backend``.

    This is the target load (minutes to tens of minutes for a 1T-parameter model): callers open it once for
    every shard of a run (:class:`TargetSession`). ``trust_remote_code`` is for the ``hf`` backend (the
    ``sglang`` backend takes its own from ``hidden.sglang``)."""
    opener = OPENERS[backend_named("hidden", name).name]
    return opener(target_path, layer_ids, dtype, device, batch_tokens, options, trust_remote_code, log)


def open_sglang_capture(
    target_path: str,
    layer_ids: list[int],
    *,
    dtype: str = "auto",
    device: str = "auto",
    options: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> tuple[Any, torch.Tensor, dict[str, Any]]:
    """(SGLangCapture, the lm_head copy [V, H], what the copy holds where) for ``hidden.backend: sglang``; also
    what ``aerie-sglang-capture check`` runs. ``options``: ``hidden.sglang``, SGLangCapture's keyword arguments.

    SGLang keeps its weights to itself, so lm_head is read from the target's safetensors, onto the GPU
    ``aerie.hidden.sglang.lm_head_copy`` names (SGLang's rank-0 GPU unless ``target.device`` says otherwise),
    with its top-k workspace, *before* SGLang starts: SGLang then sizes its KV pool around both."""
    options = dict(options or {})
    config = read_config(target_path)
    dims = target_dims(config)
    resolved = "cpu" if device == "auto" and not torch.cuda.is_available() else device
    copy = lm_head_copy(dims["vocab_size"], dims["hidden_size"], options, resolved, weight_dtype_bytes(config))
    placed: list[tuple[torch.Tensor, dict[str, Any]]] = []
    # After SGLangCapture's checks (version, ids, arguments: seconds), before its workers start.
    cap = SGLangCapture(
        target_path,
        layer_ids,
        dtype=dtype,
        before_start=lambda: placed.append(place_lm_head(target_path, copy, log)),
        **options,
    )
    head, facts = placed[0]
    return cap, head, facts


def _open_hf(target_path, layer_ids, dtype, device, batch_tokens, options, trust_remote_code, log):
    cap = HFCapture(
        target_path,
        layer_ids,
        device=device,
        dtype=dtype,
        batch_tokens=batch_tokens,
        trust_remote_code=trust_remote_code,
    )
    return cap, cap.lm_head


def _open_sglang(target_path, layer_ids, dtype, device, batch_tokens, options, trust_remote_code, log):
    # SGLang batches by its own scheduler and takes trust_remote_code from hidden.sglang
    cap, head, _ = open_sglang_capture(target_path, layer_ids, dtype=dtype, device=device, options=options, log=log)
    return cap, head


# hidden.backend -> how it opens (aerie.formats.backends names them; every name there has one here, tested)
OPENERS: dict[str, Callable[..., tuple[CaptureBackend, torch.Tensor]]] = {"hf": _open_hf, "sglang": _open_sglang}


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
        backend_named("hidden", backend)  # a ValueError naming hidden.backend when it is none of them
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
                log=self.log,
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
