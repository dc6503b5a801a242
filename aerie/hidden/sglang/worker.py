"""The capture's worker processes: one per tensor-parallel rank, spawned by :class:`SGLangCapture`.

A spawned child rebuilds its target function and arguments by unpickling them, which imports them by module
and name. So everything a worker receives is importable whatever the parent runs as (``python -m``, a console
script, a Snakemake script): the target is :func:`run_rank` of this module, the backend travels as a
``"module:qualname"`` reference and the payload as bytes, both resolved inside :func:`run_rank` where any
failure is reported to the parent with its traceback. A crash that kills the interpreter (a segfault in a
kernel) is written by :mod:`faulthandler` to a per-rank file the parent reads when it finds the worker dead.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import os
import pickle
import queue
import signal
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from aerie.hidden.sglang.batches import states_digest
from aerie.hidden.sglang.mapping import SGLangCaptureError


def backend_reference(backend: type) -> str:
    """``"module:qualname"`` of a backend class, refused unless a worker process can import it by that name."""
    module, qualname = getattr(backend, "__module__", None), getattr(backend, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname:
        raise SGLangCaptureError(
            f"capture backend {backend!r} is defined in {'a function' if '<locals>' in qualname else '__main__'}: "
            f"the worker processes import it by name, so it must live at the top level of an importable module"
        )
    ref = f"{module}:{qualname}"
    if resolve_backend(ref) is not backend:
        raise SGLangCaptureError(f"capture backend {backend!r}: {ref} names another object")
    return ref


def resolve_backend(ref: str) -> Any:
    """The object a ``"module:qualname"`` reference names (ValueError when it does not name one)."""
    module, sep, qualname = ref.partition(":")
    if not sep or not module or not qualname:
        raise ValueError(
            f"backend reference {ref!r}: expected MODULE:CLASS, e.g. aerie.hidden.sglang.sglang_0523:SGLang0523"
        )
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"backend reference {ref!r}: module {module} has no {qualname}") from None
    return obj


def fault_log_path(directory: str | Path, rank: int) -> Path:
    """Where rank ``rank`` writes the Python stacks of a fatal signal (faulthandler)."""
    return Path(directory) / f"rank{rank}.fault.txt"


def exit_reason(exitcode: int | None, fault_log: Path | None = None) -> str:
    """Why a worker process ended, in words: its exit code or signal, and the stack faulthandler wrote."""
    if exitcode is None:
        reason = "still running"
    elif exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        reason = f"killed by {name}"
        if -exitcode == signal.SIGKILL:
            reason += " (out of host memory and killed by the OOM killer, or killed by hand)"
    else:
        reason = f"exit code {exitcode}"
    fault = ""
    if fault_log is not None:
        with contextlib.suppress(OSError):
            fault = fault_log.read_text(errors="replace").strip()
    if fault:
        reason += f"; its fatal-error stack:\n{fault[-4000:]}"
    return reason


def _to_shared_cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    """Copy into shared memory once, so the queue hands the parent the storage without another copy."""
    if t is None:
        return None
    out = torch.empty(t.shape, dtype=t.dtype).share_memory_()
    out.copy_(t)
    return out


def _next_job(inbox: Any, parent_pid: int) -> Any:
    """The parent's next message; None when it says stop or has died (a worker must not outlive it)."""
    while True:
        try:
            return inbox.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return None


def run_rank(
    backend_ref: str,
    payload: bytes,
    rank: int,
    ranks: int,
    gpu_id: int,
    inbox: Any,
    outbox: Any,
    parent_pid: int,
    fault_dir: str,
) -> None:
    """One of ``ranks`` tensor-parallel ranks: load, report, then run every batch the parent sends (all ranks
    run each forward together; rank 0 sends the states back, with more than one rank each rank also sends
    the per-token digest of its own states, :func:`~aerie.hidden.sglang.batches.states_digest`). Every
    failure, including importing the backend and unpickling the payload, goes to the parent as
    ``("error", rank, traceback)``."""
    runner = backend = None
    fault_file = None
    try:
        fault_file = open(fault_log_path(fault_dir, rank), "w")  # noqa: SIM115 - open for the process's life
        faulthandler.enable(fault_file, all_threads=True)
        backend = resolve_backend(backend_ref)
        runner = backend.load(pickle.loads(payload), rank, gpu_id)
        outbox.put(("ready", rank, backend.runner_info(runner) if rank == 0 else None))
        while (job := _next_job(inbox, parent_pid)) is not None:
            batch_id, seqs = job
            aux, final = backend.extend(runner, seqs)
            digest = states_digest(aux, final) if ranks > 1 else None
            if rank == 0:
                outbox.put(("result", rank, batch_id, _to_shared_cpu(aux), _to_shared_cpu(final), digest))
            else:
                outbox.put(("digest", rank, batch_id, digest))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        outbox.put(("error", rank, traceback.format_exc()))
    finally:
        if runner is not None:
            with contextlib.suppress(Exception):
                backend.release(runner)
        if fault_file is not None:
            faulthandler.disable()
            fault_file.close()


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Start spawned workers without re-running ``__main__`` in them.

    A spawned child imports the parent's main script unless it is hidden; the hidden rule's Snakemake script
    has top-level code (it would capture again in every rank). The workers need only this module."""
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if main is not None and hasattr(main, k)}
    try:
        if main is not None:
            main.__spec__ = None
            if hasattr(main, "__file__"):
                del main.__file__
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)
