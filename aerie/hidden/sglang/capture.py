"""SGLangCapture: the hidden stage's SGLang backend, driving one worker process per tensor-parallel rank."""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import queue
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from aerie.hidden.sglang.batches import check_replicated, check_sequences, split_capture
from aerie.hidden.sglang.mapping import (
    ANY_VERSION_ENV,
    TESTED_SGLANG_VERSION,
    SGLangCaptureError,
    SGLangUnavailableError,
    check_capture_mapping,
    gpu_ids,
    plan_forwards,
    sglang_server_kwargs,
    target_dims,
)
from aerie.hidden.sglang.sglang_0523 import SGLang0523
from aerie.hidden.sglang.worker import (
    backend_reference,
    exit_reason,
    fault_log_path,
    main_module_hidden,
    resolve_backend,
    run_rank,
)
from aerie.target_model.config import check_servable_aux_layer_ids, predicted_capture_inputs, read_config


class SGLangCapture:
    """Capture backend for aerie.hidden: EAGLE-3 aux states + final post-norm states through SGLang.

    >>> cap = SGLangCapture("/models/Kimi-K2.5", [1, 29, 57], tp_size=8, trust_remote_code=True)
    >>> [(aux, final)] = cap.capture([torch.tensor(ids)])  # aux [T, 3*7168], final [T, 7168], CPU
    >>> cap.close()

    ``backend``: the class that talks to SGLang (default :class:`SGLang0523`), at the top level of an
    importable module, or its ``"module:Class"`` name. ``early_mapping_check``: refuse ids SGLang is known
    to map differently before the model loads (off only to exercise the check on the loaded model).
    ``before_start``: called once the arguments are checked, before the workers start (aerie.hidden places its
    lm_head copy there, so that SGLang sizes its memory pools around it).

    Tensor parallelism: in SGLang 0.5.23 every rank holds the whole residual stream after each layer's
    all-reduce (RowParallelLinear reduces; the LogitsProcessor gathers only the vocab-parallel logits), so
    the aux and final states are replicated across ranks. Every rank runs every forward (their collectives
    pair up); rank 0 sends the states, and every rank a per-token digest of its own (:func:`states_digest`),
    which must agree with rank 0's: states that are not replicated (a partial sum, rows split across ranks)
    fail the batch instead of being stored.
    """

    backend: Any = SGLang0523
    early_mapping_check = True
    startup_timeout_s = 7200.0  # loading Kimi K2.5 on 8 GPUs takes many minutes
    batch_timeout_s = 3600.0
    poll_s = 1.0
    stop_grace_s = 30.0

    num_hidden_layers: int
    hidden_size: int
    vocab_size: int

    def __init__(
        self,
        target_path: str,
        layer_ids: list[int],
        *,
        dtype: str = "auto",
        backend: Any = None,
        early_mapping_check: bool | None = None,
        before_start: Callable[[], Any] | None = None,
        **sglang_kwargs: Any,
    ):
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._fault_dir: str | None = None
        self._closed = False
        self._batch_id = 0
        self.rank_agreement = 0.0  # the largest difference of a rank's states from rank 0's (tensor parallel)
        if backend is not None:
            self.backend = resolve_backend(backend) if isinstance(backend, str) else backend
        if early_mapping_check is not None:
            self.early_mapping_check = early_mapping_check
        version = self.backend.installed_version()
        if version != TESTED_SGLANG_VERSION and os.environ.get(ANY_VERSION_ENV) != "1":
            raise SGLangUnavailableError(
                f"SGLang {version} is installed; aerie's SGLang capture uses internals of SGLang "
                f"{TESTED_SGLANG_VERSION} (envs/sglang.yaml). Install that version, or set {ANY_VERSION_ENV}=1 to "
                f"try this one (then run `aerie-sglang-capture check` first)"
            )
        self.sglang_version = version
        config_path = Path(target_path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path}: the SGLang capture needs a local model folder")
        dims = target_dims(read_config(target_path))
        self.num_hidden_layers, self.hidden_size, self.vocab_size = (
            dims["num_hidden_layers"],
            dims["hidden_size"],
            dims["vocab_size"],
        )
        self.layer_ids = check_servable_aux_layer_ids(layer_ids, self.num_hidden_layers)
        if self.early_mapping_check:
            predicted = predicted_capture_inputs(dims["architectures"], self.layer_ids)
            check_capture_mapping(self.layer_ids, predicted, "/".join(dims["architectures"]) or str(target_path))
        self.server_kwargs = sglang_server_kwargs(target_path, self.layer_ids, dtype, sglang_kwargs)
        backend_ref = backend_reference(self.backend)  # before SGLang is set up: the workers import it by name
        payload = pickle.dumps(self.backend.prepare(self.server_kwargs))
        if before_start is not None:
            before_start()

        ctx = torch.multiprocessing.get_context("spawn")
        self._outbox = ctx.Queue()
        self._fault_dir = tempfile.mkdtemp(prefix="aerie-sglang-capture-")
        atexit.register(self.close)
        try:
            with main_module_hidden():
                gpus = gpu_ids(self.server_kwargs)
                for rank, gpu in enumerate(gpus):
                    inbox = ctx.Queue()
                    # Not daemonic: SGLang may start processes of its own. close() (also at exit) stops them, and a
                    # worker whose parent died stops by itself.
                    proc = ctx.Process(
                        target=run_rank,
                        name=f"aerie-sglang-capture-tp{rank}",
                        args=(
                            backend_ref,
                            payload,
                            rank,
                            len(gpus),
                            gpu,
                            inbox,
                            self._outbox,
                            os.getpid(),
                            self._fault_dir,
                        ),
                    )
                    proc.start()
                    self._procs.append(proc)
                    self._inboxes.append(inbox)
            info = None
            for _ in self._procs:
                msg = self._receive(("ready",), self.startup_timeout_s, "loading the target")
                info = msg[2] if msg[1] == 0 else info
            self.info: dict[str, Any] = info
            # The authority: what the loaded model will really capture.
            check_capture_mapping(self.layer_ids, info["layers_to_capture"], info.get("model_class", "the target"))
            if info["hidden_size"] != self.hidden_size or info["num_hidden_layers"] != self.num_hidden_layers:
                raise SGLangCaptureError(
                    f"SGLang's model config has {info['num_hidden_layers']} layers x {info['hidden_size']}, "
                    f"{config_path} says {self.num_hidden_layers} x {self.hidden_size}"
                )
        except BaseException:
            self.close()
            raise

    def capture(self, seqs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per 1-D int sequence: (aux [T, A*H], final [T, H]) on CPU, in SGLang's dtype; aux = the
        decoder-layer outputs for the aux ids concatenated in ascending id order (= transformers
        output_hidden_states[id + 1]); final = the post-norm last hidden state at every position."""
        if self._closed:
            raise SGLangCaptureError("this SGLangCapture is closed (after close() or a failed capture)")
        ids = check_sequences(seqs, self.vocab_size)
        info = self.info
        out: list[Any] = [None] * len(ids)
        try:
            for fwd in plan_forwards(
                [len(s) for s in ids],
                max_tokens=info["max_tokens"],
                max_requests=info["max_requests"],
                context_len=info["context_len"],
                chunk_tokens=info.get("chunk_tokens"),
            ):
                self._batch_id += 1
                for inbox in self._inboxes:  # every rank runs the same forward (their collectives pair up)
                    inbox.put((self._batch_id, [ids[i] for i in fwd]))
                aux, final = self._collect(self._batch_id)
                pieces = split_capture(aux, final, [len(ids[i]) for i in fwd], len(self.layer_ids), self.hidden_size)
                for i, piece in zip(fwd, pieces):
                    out[i] = piece
        except BaseException:
            # A failed rank leaves the others inside a collective: the workers cannot be reused.
            self.close()
            raise
        return out

    def _collect(self, batch: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Rank 0's (aux, final) of ``batch``, once every other rank's digest agrees with rank 0's."""
        result, digests = None, {}
        while result is None or len(digests) < len(self._procs):
            msg = self._receive(("result", "digest"), self.batch_timeout_s, "capturing")
            if msg[2] != batch:
                raise SGLangCaptureError(f"rank {msg[1]} answered batch {msg[2]}, expected {batch}")
            if msg[0] == "result":
                result, digests[0] = (msg[3], msg[4]), msg[5]
            else:
                digests[msg[1]] = msg[3]
        if len(self._procs) > 1:
            self.rank_agreement = max(self.rank_agreement, check_replicated(digests, batch))
        return result

    def _dead_workers_error(self, doing: str) -> SGLangCaptureError | None:
        """The error to raise when a worker has exited: its own report if it sent one, else how it ended."""
        dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]
        if not dead:
            return None
        with contextlib.suppress(queue.Empty):  # an error message may have been sent just before exit
            msg = self._outbox.get(timeout=self.poll_s)
            if msg[0] == "error":
                return SGLangCaptureError(f"SGLang worker rank {msg[1]} failed while {doing}:\n{msg[2]}")
        lines = [
            f"rank {r}: {exit_reason(code, fault_log_path(self._fault_dir, r) if self._fault_dir else None)}"
            for r, code in dead
        ]
        return SGLangCaptureError(
            f"SGLang worker(s) exited while {doing} without reporting an error:\n"
            + "\n".join(lines)
            + "\n(a worker that dies before its first line of Python prints its traceback on this process's stderr)"
        )

    def _receive(self, kinds: tuple[str, ...], timeout: float, doing: str) -> tuple:
        """The next message of one of ``kinds``; raises on a worker's error, a dead worker, or the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self._outbox.get(timeout=self.poll_s)
            except queue.Empty:
                error = self._dead_workers_error(doing)
                if error is not None:
                    raise error from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no answer from the SGLang workers after {timeout:.0f} s while {doing}"
                    ) from None
                continue
            if msg[0] == "error":
                raise SGLangCaptureError(f"SGLang worker rank {msg[1]} failed while {doing}:\n{msg[2]}")
            if msg[0] in kinds:
                return msg
            raise SGLangCaptureError(f"unexpected message {msg[0]!r} from SGLang worker rank {msg[1]} while {doing}")

    def close(self) -> None:
        """Stop the workers (a normal exit first, then SIGTERM, then SIGKILL); idempotent."""
        self._closed = True
        for inbox in self._inboxes:
            with contextlib.suppress(Exception):
                inbox.put(None)
        deadline = time.monotonic() + self.stop_grace_s
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs, self._inboxes = [], []
        if self._fault_dir is not None:
            shutil.rmtree(self._fault_dir, ignore_errors=True)
            self._fault_dir = None
        atexit.unregister(self.close)

    def __enter__(self) -> SGLangCapture:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
