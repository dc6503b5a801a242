"""Progress of a long job with its rate and ETA: a tqdm bar in the job's log, and on a terminal when run by hand.

Every long stage (responses, capture, training, benchmark) counts its work with one :func:`job_progress`. The log
gets tqdm's own status line (``training:  45% 450/1000 [01:00<01:13, 7.50step/s, loss=2.31]``) at
most once every ``every_s`` seconds, plus the last one when the job closes it, so a long run's log stays small
(30 s: ~120 lines an hour). A terminal (stderr a TTY, outside a Snakemake job, whose stderr is shared by every
job it runs) also gets a live bar. tqdm formats the rate, the ETA and the units; nothing here prints by hand.

Torch-free and cheap: a job that counts nothing pays nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

# Seconds between two progress lines in a job's log.
LOG_EVERY_S = 30.0
# A log line is tqdm's status without the bar: "training:  45% 450/1000 [01:00<01:13, 7.50step/s, loss=2.31]".
LOG_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
LOG_FORMAT_NO_TOTAL = "{desc}: {n_fmt} [{elapsed}, {rate_fmt}{postfix}]"


class _LogLines:
    """A file for tqdm that turns each refresh into one log line (tqdm writes ``\\r`` + the status)."""

    def __init__(self, log: Callable[[str], None]):
        self._log = log
        self._last = ""

    def write(self, text: str) -> int:
        line = text.strip("\r\n\x1b[A ")
        if line and line != self._last:
            self._last = line
            self._log(line)
        return len(text)

    def flush(self) -> None:
        pass


def on_a_terminal() -> bool:
    """A person watching: stderr is a terminal and no Snakemake job shares it (a rule's script imports
    snakemake.script)."""
    return sys.stderr.isatty() and "snakemake.script" not in sys.modules


class JobProgress:
    """Counts one job's work: ``update(n)``, ``set(n)``, ``postfix(**values)``, ``close()`` (also a context
    manager). The same figures go to the log (throttled) and, when one watches, to a terminal bar."""

    def __init__(
        self,
        desc: str,
        total: float | None,
        *,
        unit: str,
        log: Callable[[str], None] | None,
        initial: float = 0,
        every_s: float = LOG_EVERY_S,
        terminal: bool | None = None,
        unit_scale: bool = False,
    ):
        common: dict[str, Any] = dict(
            desc=desc, total=total, unit=unit, initial=initial, unit_scale=unit_scale, dynamic_ncols=False
        )
        self._bars: list[tqdm] = []
        if log is not None:
            # mininterval throttles; maxinterval/miniters keep tqdm from skipping updates once it learns a rate
            self._bars.append(
                tqdm(
                    **common,
                    file=_LogLines(log),
                    mininterval=every_s,
                    maxinterval=max(every_s, 10.0),
                    miniters=1,
                    bar_format=LOG_FORMAT if total else LOG_FORMAT_NO_TOTAL,
                )
            )
        if terminal if terminal is not None else on_a_terminal():
            self._bars.append(tqdm(**common, file=sys.stderr, mininterval=0.5, leave=True))

    def update(self, n: float = 1) -> None:
        for bar in self._bars:
            bar.update(n)

    def set(self, n: float) -> None:
        """Set the count (a job that knows its total done so far rather than the increment)."""
        for bar in self._bars:
            if n != bar.n:
                bar.update(n - bar.n)

    def postfix(self, **values: Any) -> None:
        """Figures shown after the rate (loss, dollars...), refreshed with the next line."""
        for bar in self._bars:
            bar.set_postfix(values, refresh=False)

    @property
    def n(self) -> float:
        return self._bars[0].n if self._bars else 0

    def close(self) -> None:
        for bar in self._bars:
            bar.refresh()  # the final state, whatever the throttle
            bar.close()
        self._bars = []

    def __enter__(self) -> JobProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def job_progress(
    desc: str,
    total: float | None,
    *,
    unit: str,
    log: Callable[[str], None] | None = None,
    initial: float = 0,
    every_s: float = LOG_EVERY_S,
    terminal: bool | None = None,
    unit_scale: bool = False,
) -> JobProgress:
    """A job's progress (see the module): ``log`` is the job's log (None: the terminal only)."""
    return JobProgress(
        desc,
        total,
        unit=unit,
        log=log,
        initial=initial,
        every_s=every_s,
        terminal=terminal,
        unit_scale=unit_scale,
    )
