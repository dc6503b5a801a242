"""The SGLang servers of the serving benchmark: their settings, command lines, and every process they leave.

:func:`sglang_settings` checks the config's ``sglang:`` section, :func:`server_command` builds the
``launch_server`` argv of the baseline, of a drafter (its kind's flags: :func:`drafter_flags`) and of SGLang's NGRAM
(:func:`ngram_flags`) (flag spellings of SGLang 0.5.23),
:func:`redact_command` hides secrets before a command is recorded, and :func:`kill_leftovers` finds a stopped
server's processes by a marker in their environment and kills what outlives the grace period (GPU memory must
be free before the next server starts).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aerie.benchmark.methods import folder_kind

# Defaults of the config's `sglang:` section (config/schema.yaml; keep in sync).
SGLANG_DEFAULTS: dict[str, Any] = {
    "tp": 1,
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
    "mem_fraction_static": None,
    "extra_args": [],
    "ngram_extra_args": [],
    "concurrency": [1],
}

# Besides the baseline (no speculation) a benchmark starts drafter servers - each trained drafter and each reference
# folder with its kind's flags (DrafterKind.sglang_flags: EAGLE-3's ``--speculative-algorithm EAGLE3`` with the
# configured steps / topk / draft tokens, DFlash's ``DFLASH`` with its block) - and SGLang's own n-gram speculation
# (0.5.23: ``--speculative-algorithm NGRAM``, no draft model; python/sglang/srt/arg_groups/fields/spec.py lists it
# among the builtins, arg_groups/speculative_hook.py ``_handle_ngram`` fills its defaults: speculative_eagle_topk =
# speculative_ngram_max_bfs_breadth (10), speculative_num_draft_tokens 12, speculative_num_steps = 12 // 10).
# ``ngram`` runs it at the EAGLE-3 width (speculative_num_draft_tokens, breadth 1: a chain, as EAGLE-3 at topk 1),
# ``ngram_default`` at SGLang's defaults.
NGRAM_DEFAULT_DRAFT_TOKENS = 12  # _handle_ngram's speculative_num_draft_tokens: the verified token and 11 drafts

# Flags the harness sets itself; extra_args must not override them (argparse keeps the last value).
MANAGED_FLAGS = frozenset(
    {
        "--model-path",
        "--model",
        "--tp-size",
        "--tensor-parallel-size",
        "--tp",
        "--host",
        "--port",
        "--mem-fraction-static",
        "--speculative-algorithm",
        "--speculative-draft-model-path",
        "--speculative-draft-model",
        "--speculative-num-steps",
        "--speculative-eagle-topk",
        "--speculative-num-draft-tokens",
        "--speculative-dflash-block-size",  # DFLASH's alias of --speculative-num-draft-tokens
        "--speculative-draft-window-size",  # a drafter's own (DFlash: its sliding window), never every server's
    }
)

# The NGRAM servers' width is the harness's (ngram: the EAGLE-3 server's; ngram_default: SGLang's own), so
# ngram_extra_args may tune the n-gram matcher but not set the width.
NGRAM_MANAGED_FLAGS = MANAGED_FLAGS | {"--speculative-ngram-max-bfs-breadth"}

_SECRET_FLAG = re.compile(r"api[-_]?key|secret|passw|auth|(?:hf|access|bearer)[-_]?token", re.IGNORECASE)

MARKER_ENV = "AERIE_SGLANG_HARNESS_SERVER"  # set in the server's environment: finds its leftovers


def sglang_settings(section: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config's ``sglang:`` section with defaults filled in, checked (ValueError on a bad value)."""
    section = dict(section or {})
    unknown = set(section) - set(SGLANG_DEFAULTS)
    if unknown:
        raise ValueError(f"sglang: unknown keys {sorted(unknown)} (known: {sorted(SGLANG_DEFAULTS)})")
    s = {**SGLANG_DEFAULTS, **section}
    for key in ("tp", "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"):
        if not isinstance(s[key], int) or isinstance(s[key], bool) or s[key] < 1:
            raise ValueError(f"sglang.{key} must be an integer >= 1, got {s[key]!r}")
    f = s["mem_fraction_static"]
    if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
        raise ValueError(f"sglang.mem_fraction_static must be in (0, 1], got {f!r}")
    for key, managed in (("extra_args", MANAGED_FLAGS), ("ngram_extra_args", NGRAM_MANAGED_FLAGS)):
        args = s[key]
        if not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"sglang.{key} must be a list of strings, got {args!r}")
        clash = sorted({a.split("=", 1)[0] for a in args} & managed)
        if clash:
            raise ValueError(f"sglang.{key} sets {clash}, which the harness sets itself from the config")
    conc = s["concurrency"]
    if (
        not isinstance(conc, (list, tuple))
        or not conc
        or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in conc)
    ):
        raise ValueError(f"sglang.concurrency must be a non-empty list of integers >= 1, got {conc!r}")
    s["extra_args"] = list(s["extra_args"])
    s["ngram_extra_args"] = list(s["ngram_extra_args"])
    s["concurrency"] = list(conc)
    return s


def server_command(
    target_path: str | Path,
    port: int,
    sglang: Mapping[str, Any] | None = None,
    *,
    speculative: Sequence[str] = (),
    python: str | None = None,
    host: str = "127.0.0.1",
) -> list[str]:
    """The ``launch_server`` argv of the target with ``speculative`` flags (none: the baseline; a drafter's:
    :func:`drafter_flags`; SGLang's NGRAM: :func:`ngram_flags`).

    Flag spellings are SGLang 0.5.23's (``--tp-size`` is the field's own flag, ``--tp`` only works as
    an argparse abbreviation). ``extra_args`` come last, verbatim.
    """
    s = sglang_settings(sglang)
    cmd = [
        python or sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(target_path),
        "--tp-size",
        str(s["tp"]),
        "--host",
        host,
        "--port",
        str(int(port)),
    ]
    if s["mem_fraction_static"] is not None:
        cmd += ["--mem-fraction-static", str(s["mem_fraction_static"])]
    return cmd + list(speculative) + s["extra_args"]


def ngram_flags(sglang: Mapping[str, Any] | None, *, at_chain_width: bool) -> list[str]:
    """SGLang's NGRAM: at the EAGLE-3 chain's width (the same number of draft tokens, one chain: ``ngram``) or at
    SGLang's own defaults (``ngram_default``), with ``ngram_extra_args``."""
    s = sglang_settings(sglang)
    flags = ["--speculative-algorithm", "NGRAM"]
    if at_chain_width:
        flags += ["--speculative-num-draft-tokens", str(s["speculative_num_draft_tokens"])]
        flags += ["--speculative-ngram-max-bfs-breadth", "1"]
    return flags + s["ngram_extra_args"]


def drafter_flags(
    folder: str | Path, sglang: Mapping[str, Any] | None, *, served_as: str | Path | None = None
) -> list[str]:
    """The flags that serve the drafter folder (trained or a reference), its kind's (``DrafterKind.sglang_flags``,
    read from its config.json); ``served_as``: the path or Hub id the flags name instead (a model card's)."""
    kind, config = folder_kind(folder)
    return kind.sglang_flags(served_as if served_as is not None else folder, config, sglang_settings(sglang))


def redact_command(argv: Sequence[str]) -> list[str]:
    """``argv`` with the value of every secret-looking flag (``--api-key`` ...) replaced by ``***``."""
    out: list[str] = []
    hide_next = False
    for a in argv:
        if hide_next:
            out.append("***")
            hide_next = False
        elif a.startswith("-") and _SECRET_FLAG.search(a.split("=", 1)[0]):
            if "=" in a:
                out.append(a.split("=", 1)[0] + "=***")
            else:
                out.append(a)
                hide_next = True
        else:
            out.append(a)
    return out


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value ``argv`` gives ``flag`` (``--flag V`` or ``--flag=V``; the last one wins, as in argparse)."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


# ---- the server's processes ---------------------------------------------------------------------------


def process_alive(pid: int) -> bool:
    """False for a process that is gone or a zombie (exited, waiting for its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] not in "ZXx"
    except FileNotFoundError:
        return False
    except (OSError, ValueError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries this server's marker (Linux /proc; [] elsewhere)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    pids = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            pids.append(int(name))
    return pids


def kill_leftovers(marker: str, grace: float) -> list[int]:
    """Wait up to ``grace`` s for the server's processes to exit, then SIGKILL the rest; returns those."""
    deadline = time.monotonic() + grace
    while True:
        left = [p for p in marked_pids(marker) if process_alive(p)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 10
    while any(process_alive(p) for p in left) and time.monotonic() < end:
        time.sleep(0.05)
    return left
