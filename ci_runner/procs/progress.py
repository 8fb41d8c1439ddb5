"""A hang is measured, not assumed (issue 44): is a child that ran past its limit still making progress?

`run_process` polls a `ProgressWatch` about once a second while its child runs. The watch follows the item in flight
(`item()`: a probe's name, from the child's journal) and samples, for the child's whole session (it leads one: the
compiler's own subprocesses count), the CPU time its processes used (`session_cpu_s`: utime + stime of each, and of
their children already reaped, from `/proc/<pid>/stat`) and the size of the child's output files. An item past
`first_limit` seconds is stalled only when, over the last `window` seconds, the CPU time grew by less than
`min_cpu_s` and no output file grew: then `poll` returns the verdict in words and `run_process` ends the child (after
`dump_signal`, so that its `faulthandler` writes where it was stuck). An item still progressing is left to run: a
longer limit, if any, is the child's own (the layers probe's `second limit`). Where `/proc` cannot be read (not
Linux), the CPU time is unknown and only the output counts.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

DUMP_SIGNAL = signal.SIGUSR1  # what the parent sends a stalled child (`procs.limits.stacks_on_signal`)

__all__ = ["ProgressWatch", "Stall", "session_cpu_s", "POLL_S"]

POLL_S = 1.0  # how often run_process asks the watch
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def session_cpu_s(sid: int, proc: Path = Path("/proc")) -> float | None:
    """CPU seconds used by every live process of session `sid` (and by their children already reaped), or None when
    `/proc` cannot be read."""
    total = 0
    found = False
    try:
        entries = os.listdir(proc)
    except OSError:
        return None
    for name in entries:
        if not name.isdigit():
            continue
        try:
            text = (proc / name / "stat").read_text(encoding="ascii", errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        rest = text.rpartition(")")[2].split()
        if len(rest) < 15 or not rest[3].lstrip("-").isdigit() or int(rest[3]) != sid:
            continue
        found = True
        total += sum(int(v) for v in rest[11:15])  # utime stime cutime cstime, in clock ticks
    return total / _TICK if found else None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


@dataclass(frozen=True)
class Stall:
    """What the watch measured when it called an item stalled."""

    item: str
    elapsed_s: float  # since the item started (as first seen)
    window_s: float
    cpu_s: float | None  # CPU seconds the session used over the window (None: unknown)

    def words(self) -> str:
        cpu = "its CPU time is unknown" if self.cpu_s is None else f"its processes used {self.cpu_s:.2f} s of CPU"
        return (f"no progress for {self.window_s:.0f} s after {self.elapsed_s:.0f} s: {cpu} and its output did not "
                f"grow")


@dataclass
class ProgressWatch:
    """See the module text. `item()` names the item in flight (None between items); `outputs`: files whose growth
    counts as progress besides the ones `run_process` writes."""

    first_limit: float
    window: float
    item: Callable[[], str | None]
    outputs: Sequence[Path] = ()
    min_cpu_s: float | None = None  # default: 1% of one core over the window, at least 0.05 s
    dump_signal: int | None = DUMP_SIGNAL
    stall: Stall | None = None
    _current: str | None = field(default=None, repr=False)
    _started: float = field(default=0.0, repr=False)
    _samples: deque[tuple[float, float | None, int]] = field(default_factory=deque, repr=False)

    def poll(self, pid: int, files: Sequence[Path] = ()) -> str | None:
        """One sample of the child `pid` (its session); the verdict in words when the item in flight has stalled."""
        now = time.monotonic()
        name = self.item()
        if name != self._current:
            self._current, self._started = name, now
            self._samples.clear()
        if name is None:
            return None
        size = sum(_size(p) for p in (*files, *self.outputs))
        self._samples.append((now, session_cpu_s(pid), size))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window:
            self._samples.popleft()
        t0, cpu0, size0 = self._samples[0]
        if now - self._started < self.first_limit or now - t0 < self.window * 0.95:
            return None
        cpu1 = self._samples[-1][1]
        used = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
        floor = self.min_cpu_s if self.min_cpu_s is not None else max(0.05, 0.01 * self.window)
        if size != size0 or (used is not None and used >= floor):
            return None
        self.stall = Stall(item=name, elapsed_s=now - self._started, window_s=now - t0, cpu_s=used)
        return self.stall.words()

    def before_kill(self, pid: int) -> None:
        """Ask the stalled child to write where it is stuck (`faulthandler.register(dump_signal)`), then let it."""
        if self.dump_signal is None:
            return
        try:
            os.kill(pid, self.dump_signal)
        except OSError:
            return
        time.sleep(1.0)
