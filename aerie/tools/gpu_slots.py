"""GPU slots for local runs: concurrent GPU jobs get disjoint ``CUDA_VISIBLE_DEVICES``.

Snakemake counts GPUs (``resources: gpu=N`` against ``--resources gpu=8``) but never says *which* GPUs a
job may use (snakemake issue #281), and it silently scales a job's request down to the global limit. So
each GPU rule script calls :func:`acquire_gpus` (or :func:`acquire_rule_gpus`) first thing, before torch
is imported:

- it fails with a message naming the rule, the config setting and the ``--resources gpu=`` limit when
  Snakemake granted fewer GPUs than the rule needs (instead of running a 1T-parameter model on too few
  GPUs, or on the CPU);
- it takes one lock file per device (non-blocking ``fcntl.flock`` in :func:`lock_dir`), all-or-nothing,
  waiting while other jobs hold them, and sets ``CUDA_VISIBLE_DEVICES`` to the devices it got;
- the locks live as long as the process: the kernel drops them when it exits or dies, SIGKILL included,
  so a killed job never leaves a GPU marked busy.

Where the devices come from (:func:`detect_devices`), first match wins:

1. ``AERIE_GPUS=N``: N fake devices ``0..N-1`` (tests, rehearsals); ``AERIE_GPUS=0`` means none;
2. a scheduler's allocation (``SLURM_JOB_ID`` and ``CUDA_VISIBLE_DEVICES`` set): used as is, no locks
   (SLURM already gave each job its own devices);
3. ``CUDA_VISIBLE_DEVICES`` set by the user: the pool to allocate from (``""`` or ``-1``: no GPU);
4. ``nvidia-smi -L``: every GPU of the machine (indices in PCI bus order, so ``CUDA_DEVICE_ORDER`` is set
   to ``PCI_BUS_ID`` to make CUDA number them the same way);
5. none of these: no GPU, and :func:`acquire_gpus` only logs ``no GPU: running on CPU``.

Locks are per user by default (``/tmp/aerie-gpu-locks-<uid>``); on a host shared by several users, point
``AERIE_GPU_LOCK_DIR`` of everyone at one directory they can all write. Only processes that take these
locks are seen: start GPU processes by hand through ``python -m aerie.tools.gpu_slots run N -- CMD`` (an SGLang
server, say) so that they take part.

``python -m aerie.tools.gpu_slots`` prints the devices this machine offers and who holds each; ``--count`` prints
how many there are.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ENV_LOCK_DIR = "AERIE_GPU_LOCK_DIR"
ENV_FAKE_GPUS = "AERIE_GPUS"
ENV_WAIT_S = "AERIE_GPU_WAIT_S"

# Scheduler variables that mean "CUDA_VISIBLE_DEVICES was set for this job by the scheduler".
SCHEDULER_JOB_VARS = ("SLURM_JOB_ID",)

# The lock files held by this process, kept open (and therefore locked) until it exits.
_held: dict[str, int] = {}


class GpuSlotError(RuntimeError):
    """A GPU job cannot get the GPUs it needs; the message says why and what to change."""


def lock_dir(env: Mapping[str, str] | None = None) -> Path:
    """``AERIE_GPU_LOCK_DIR``, else ``/tmp/aerie-gpu-locks-<uid>``.

    Not ``$XDG_RUNTIME_DIR``: systemd removes it when the user's last session ends, which would delete the
    lock files of a run left going under nohup or tmux while jobs still hold them.
    """
    env = os.environ if env is None else env
    return Path(env.get(ENV_LOCK_DIR) or f"/tmp/aerie-gpu-locks-{os.getuid()}")


def _nvidia_smi_devices() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return [m.group(1) for m in re.finditer(r"^GPU (\d+):", out.stdout, flags=re.M)]


def _split_visible(value: str) -> list[str]:
    ids = [x.strip() for x in value.split(",") if x.strip()]
    # CUDA stops at the first invalid entry; "-1" or "" is the usual way to hide every GPU.
    if not ids or ids[0] in ("-1", "none", "NoDevFiles"):
        return []
    return ids


def detect_devices(env: Mapping[str, str] | None = None) -> tuple[list[str], str]:
    """The device ids this process may allocate from, and where they came from.

    The source is one of ``AERIE_GPUS``, ``scheduler``, ``CUDA_VISIBLE_DEVICES``, ``nvidia-smi``, ``none``.
    """
    env = os.environ if env is None else env
    fake = env.get(ENV_FAKE_GPUS)
    if fake is not None and fake.strip() != "":
        try:
            n = int(fake)
        except ValueError:
            raise GpuSlotError(f"{ENV_FAKE_GPUS}={fake!r}: expected a number of (fake) GPUs") from None
        return [str(i) for i in range(max(n, 0))], ENV_FAKE_GPUS
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        scheduled = any(env.get(v) for v in SCHEDULER_JOB_VARS)
        return _split_visible(visible), "scheduler" if scheduled else "CUDA_VISIBLE_DEVICES"
    devices = _nvidia_smi_devices()
    return (devices, "nvidia-smi") if devices else ([], "none")


def gpu_count(env: Mapping[str, str] | None = None) -> int:
    """How many GPUs :func:`detect_devices` finds (what ``--resources gpu=`` should be on this machine)."""
    return len(detect_devices(env)[0])


def _lock_name(device: str) -> str:
    return "gpu-" + re.sub(r"[^A-Za-z0-9_.-]", "_", device) + ".lock"


def _holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        return "?"
    return text or "?"


def _try_lock(path: Path) -> int | None:
    """An open, exclusively locked fd on ``path``, or None when another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        # The file we locked must still be the one at `path` (not removed or replaced meanwhile).
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _write_holder(fd: int, device: str, rule: str) -> None:
    info = f"pid {os.getpid()} on {socket.gethostname()}, rule {rule}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, info.encode(), 0)


def release_gpus() -> None:
    """Release every lock this process holds (a process that exits releases them anyway)."""
    for device in list(_held):
        fd = _held.pop(device)
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)


def held_gpus() -> list[str]:
    return list(_held)


def _take(devices: list[str], count: int, directory: Path, rule: str) -> list[str] | None:
    """All-or-nothing: lock ``count`` free devices, or lock none and return None."""
    got: dict[str, int] = {}
    for device in devices:
        if device in _held:  # already ours (a second call in the same process)
            continue
        fd = _try_lock(directory / _lock_name(device))
        if fd is None:
            continue
        got[device] = fd
        if len(got) == count:
            break
    if len(got) < count:
        for fd in got.values():
            os.close(fd)
        return None
    for device, fd in got.items():
        _write_holder(fd, device, rule)
        _held[device] = fd
    return list(got)


def _setting_name(rule: str) -> str:
    return f"resources.{rule}_gpus"


def acquire_gpus(
    needed: int,
    granted: int | None,
    rule: str,
    *,
    setting: str | None = None,
    log: Callable[[str], None] | None = None,
    timeout_s: float | None = None,
    poll_s: float = 2.0,
    report_every_s: float = 60.0,
) -> list[str]:
    """Give this process ``max(needed, granted)`` GPUs of its own and return their ids.

    ``needed`` is what the rule needs (config ``resources.<rule>_gpus``, named by ``setting``); ``granted``
    is what Snakemake reserved for the job (``snakemake.resources.gpu``; it scales requests down to the
    ``--resources gpu=`` limit). Sets ``CUDA_VISIBLE_DEVICES`` (and ``CUDA_DEVICE_ORDER``) for this process
    and everything it starts; the devices stay locked until the process exits.

    - No GPU on this machine (CPU runs, CI): logs ``no GPU: running on CPU`` and returns ``[]``.
    - ``granted < needed``: raises :class:`GpuSlotError` naming the rule, the setting and the limit.
    - ``needed == granted == 0`` on a GPU machine: hides every GPU (``CUDA_VISIBLE_DEVICES=""``).
    - Devices held by other jobs: waits (logging who holds them every ``report_every_s``) up to
      ``timeout_s`` (default: ``AERIE_GPU_WAIT_S``, else forever), then raises :class:`GpuSlotError`.
    - Under a scheduler (SLURM): checks its allocation has enough devices and uses it as is.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    setting = setting or _setting_name(rule)
    needed = int(needed or 0)
    granted = needed if granted is None else int(granted or 0)
    if timeout_s is None and os.environ.get(ENV_WAIT_S):
        timeout_s = float(os.environ[ENV_WAIT_S])

    devices, source = detect_devices()
    if not devices:
        log(f"{rule}: no GPU: running on CPU (the rule asks for {needed} GPU(s); device source: {source})")
        return []
    if granted < needed:
        raise GpuSlotError(
            f"rule {rule} needs {needed} GPU(s) ({setting}: {needed}) but Snakemake granted gpu={granted}: "
            f"it scales a job's request down to the global limit. Raise the limit to at least {needed} "
            f"(--resources gpu={max(needed, len(devices))}, or `resources: gpu:` in the profile), check "
            f"`set-resources: {rule}: gpu:` in the profile, or lower {setting}"
        )
    count = max(needed, granted)
    if count == 0:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        log(f"{rule}: needs no GPU: CUDA_VISIBLE_DEVICES='' (GPUs stay free for GPU jobs)")
        return []
    if count > len(devices):
        raise GpuSlotError(
            f"rule {rule} needs {count} GPU(s) ({setting}: {needed}, granted gpu={granted}) but only "
            f"{len(devices)} are available here ({source}: {','.join(devices)})"
        )
    if source == "scheduler":
        chosen = devices[:count] if len(devices) > count else devices
        log(f"{rule}: GPUs {','.join(chosen)} allocated by the scheduler (CUDA_VISIBLE_DEVICES)")
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(chosen)
        return chosen

    directory = lock_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700 if not os.environ.get(ENV_LOCK_DIR) else 0o777)
    start = time.monotonic()
    last_report = None
    while True:
        chosen = _take(devices, count, directory, rule)
        if chosen is not None:
            break
        now = time.monotonic()
        if timeout_s is not None and now - start >= timeout_s:
            raise GpuSlotError(
                f"rule {rule}: no {count} free GPU(s) of {','.join(devices)} after {timeout_s:.0f} s "
                f"(holders: {_holders_text(devices, directory)}; lock dir {directory})"
            )
        if last_report is None or now - last_report >= report_every_s:
            last_report = now
            log(
                f"{rule}: waiting for {count} free GPU(s) of {len(devices)} ({source}); held: "
                f"{_holders_text(devices, directory)} (lock dir {directory})"
            )
        time.sleep(poll_s * (0.5 + random.random()))
    if source == "nvidia-smi":
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # nvidia-smi's numbering
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(chosen)
    waited = time.monotonic() - start
    log(
        f"{rule}: GPUs {','.join(chosen)} (CUDA_VISIBLE_DEVICES; {count} of {len(devices)} from {source}"
        + (f", after waiting {waited:.0f} s" if waited >= 1 else "")
        + f"; locks in {directory})"
    )
    return chosen


def _holders_text(devices: list[str], directory: Path) -> str:
    parts = []
    for device in devices:
        path = directory / _lock_name(device)
        state = holder_of(path)
        if state is not None:
            parts.append(f"GPU {device}: {state}")
    return "; ".join(parts) or "none (freed meanwhile)"


def holder_of(path: Path) -> str | None:
    """Who holds the lock file ``path`` (its recorded pid and rule), or None when it is free."""
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _holder(path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def acquire_rule_gpus(smk: Any, log: Callable[[str], None]) -> list[str]:
    """:func:`acquire_gpus` for a rule script's ``snakemake`` object; exits the job with the message on error.

    ``needed`` comes from ``params.gpus`` when the rule passes it, else from ``config["resources"]``
    (``<rule>_gpus``); ``granted`` from ``resources.gpu``.
    """
    rule = getattr(smk, "rule", None) or "job"
    granted = getattr(getattr(smk, "resources", None), "gpu", 0)
    needed = getattr(getattr(smk, "params", None), "gpus", None)
    if needed is None:
        config = getattr(smk, "config", None) or {}
        needed = (config.get("resources") or {}).get(f"{rule}_gpus", granted)
    try:
        return acquire_gpus(needed, granted, rule, log=log)
    except GpuSlotError as e:
        log(str(e))
        raise SystemExit(str(e)) from None


def _status() -> int:
    devices, source = detect_devices()
    directory = lock_dir()
    print(f"{len(devices)} GPU(s) from {source}: {','.join(devices) or '-'}; lock dir {directory}")
    for device in devices:
        state = holder_of(directory / _lock_name(device))
        print(f"GPU {device}: {'free' if state is None else 'held by ' + state}")
    return 0


def run_with_gpus(count: int, command: list[str], name: str | None = None) -> None:
    """Lock ``count`` GPUs, then exec ``command`` with them as CUDA_VISIBLE_DEVICES.

    For GPU processes started by hand (SGLang servers): ``command`` keeps the locks, and so do processes it
    starts that inherit its file descriptors (``subprocess`` closes them by default, a shell does not), so a
    server that outlives its launcher still shows its GPUs as busy.
    """
    name = name or Path(command[0]).name
    try:
        acquire_gpus(count, count, name, setting="the GPU count given to `aerie-gpu-slots run`")
    except GpuSlotError as e:
        raise SystemExit(str(e)) from None
    for fd in _held.values():
        os.set_inheritable(fd, True)  # the locks outlive exec: held by `command` until it exits
    os.execvp(command[0], command)


USAGE = """usage: aerie-gpu-slots                 devices and who holds each
       aerie-gpu-slots --count         how many GPUs (what --resources gpu= should be here)
       aerie-gpu-slots run N -- CMD..  run CMD holding N GPUs of its own (waits for them)
(python -m aerie.tools.gpu_slots ... is the same tool)"""


def main(argv: list[str] | None = None) -> int:
    """The ``aerie-gpu-slots`` tool (also ``python -m aerie.tools.gpu_slots``); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if not argv:
        return _status()
    if argv == ["--count"]:
        print(gpu_count())
        return 0
    if len(argv) >= 4 and argv[0] == "run" and argv[1].isdigit() and argv[2] == "--":
        run_with_gpus(int(argv[1]), argv[3:])
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
