"""One rule for how long a probe may take (issue 44), shared by every probing child: the layers module search, the
culprit search and the ops probes. A hang is measured, not assumed; a slow compile is a figure, never a finding.

- **Parent side.** `HangLimits.watch` is the `ProgressWatch` (`procs/progress.py`) the parent puts on a probing child:
  past `first` seconds (the mode's `probe_timeout`), the item in flight (the journal's open `enter-<kind>` entry) is a
  hang only when its child's session used no CPU time and wrote no output over `window` seconds; the parent then has
  it dump its stacks and kills it.
- **Child side.** `ChildLimits.limit` is the limit the child's own watchdog (`faulthandler`) puts on one item: the
  *second limit*, `factor` × the longest item this cell measured and at least twice `first`, for an item still busy
  (a compiler that loops burns CPU time, so the parent's watch never calls it stalled); before anything was measured,
  or when the second limit would pass the cell's deadline, the time left. Each item's limit and why is appended to
  a JSON-lines file, so that the parent can tell a stuck item from one the cell's time cut short. Around its
  probing loop the child holds `stacks_on_signal`: the parent's signal (`progress.DUMP_SIGNAL`) before it kills a
  stalled child has it write every thread's stack.
- **Verdict.** `dead_item` reads why a child ended in an item: `hung` (stalled, or stuck past the second limit), or
  `unfinished` (cut short while still making progress: not failing, the search goes on from its parent), or None
  (it crashed).
"""

from __future__ import annotations

import faulthandler
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, Mapping, Sequence, TextIO

from ..fsutil import append_line, read_records
from ..options import HangOptions
from .isolate import IsolatedResult, open_entry
from .progress import DUMP_SIGNAL, ProgressWatch

__all__ = ["HangLimits", "ChildLimits", "DeadItem", "dead_item", "item_limits", "finite", "stacks_on_signal",
           "NO_DEADLINE_S"]

NO_DEADLINE_S = 7 * 86400.0  # a run with no deadline (remaining() is inf): the limit timers need a finite number


def finite(seconds: float) -> float:
    """`seconds`, at most NO_DEADLINE_S: an infinite budget as a limit a timer (`faulthandler`, a wait) accepts."""
    return min(seconds, NO_DEADLINE_S)


@contextmanager
def stacks_on_signal(file: TextIO | None = None) -> Iterator[None]:
    """A probing child's side of the parent's watch (`HangLimits.watch`): while inside, the signal the parent sends
    a stalled child before it kills it (`progress.DUMP_SIGNAL`) has faulthandler write every thread's stack to
    `file` (stderr when None), where the child was stuck; the handler is removed on leaving."""
    if file is None:
        faulthandler.register(DUMP_SIGNAL, all_threads=True)
    else:
        faulthandler.register(DUMP_SIGNAL, file=file, all_threads=True)
    try:
        yield
    finally:
        faulthandler.unregister(DUMP_SIGNAL)


@dataclass(frozen=True)
class HangLimits:
    """A mode's limits on one probe: `first` (probe_timeout), `window` (progress_window), `factor` (stuck_factor)."""

    first: float
    window: float
    factor: float

    def second(self, measured: Iterable[float]) -> tuple[float, float] | None:
        """(the second limit, the longest measured item it derives from); None before anything was measured."""
        seconds = [float(s) for s in measured if s is not None]
        if not seconds:
            return None
        longest = max(seconds)
        return max(2.0 * self.first, self.factor * longest), longest

    def watch(self, journal: Path, kind: str, *, since: int, outputs: Sequence[Path] = ()) -> ProgressWatch:
        """The parent's watch on a child whose items are journalled as `enter-<kind>` after byte `since`; the window
        is at most half of `first`."""
        return ProgressWatch(first_limit=self.first, window=min(self.window, self.first / 2),
                             item=lambda: open_entry(journal, kind, since=since), outputs=tuple(outputs))

    @classmethod
    def of(cls, probe_timeout: float, hang: HangOptions) -> "HangLimits":
        """A mode's limits from its `probe_timeout` and its `hang` options (`progress_window`, `stuck_factor`)."""
        return cls(first=probe_timeout, window=hang.progress_window, factor=hang.stuck_factor)

    def to_json(self) -> dict[str, float]:
        return {"first": self.first, "window": self.window, "factor": self.factor}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "HangLimits":
        return cls(first=float(data["first"]), window=float(data["window"]), factor=float(data["factor"]))


@dataclass
class ChildLimits:
    """The child's side (see the module text): the limit of each item, from what this cell measured so far."""

    limits: HangLimits
    deadline_wall: float  # time.time() of the cell's deadline for this child
    record_file: Path | None = None  # where each item's limit is appended (`{"name", "limit_s", "by", "longest_s"}`)
    measured: list[float] = field(default_factory=list)  # seconds of the items that finished

    def limit(self, name: str, measured: Iterable[float] = ()) -> float:
        """The watchdog's limit for item `name` (recorded); `measured`: durations known besides `self.measured`."""
        left = finite(self.deadline_wall - time.time())
        second = self.limits.second([*self.measured, *measured])
        stuck = second is not None and second[0] < left
        limit = max(1.0, second[0] if stuck and second is not None else left)
        if self.record_file is not None:
            # flushed, not fsynced: read by the parent after this child dies, never after the machine does; the ops
            # probes write one per guarded section, as their journal lines (`sync=False` there too)
            append_line(self.record_file, json.dumps({"name": name, "limit_s": round(limit, 3),
                                                      "by": "second_limit" if stuck else "time_left",
                                                      "longest_s": round(second[1], 3) if second else None}),
                        sync=False)
        return limit

    def finished(self, seconds: float) -> None:
        """An item finished (passed or failed) in `seconds`: a measurement the next limits derive from."""
        self.measured.append(float(seconds))


def item_limits(record_file: Path) -> dict[str, dict[str, Any]]:
    """The limits a child recorded, by item name (the last record of a name wins)."""
    return read_records(record_file, dict, lambda r: str(r.get("name")))


@dataclass(frozen=True)
class DeadItem:
    """Why a child ended in an item it was running."""

    verdict: Literal["hung", "unfinished"]
    words: str  # what was measured, e.g. "hung: no progress for 30 s after 130 s: …"
    seconds: float  # the limit it ran into


def dead_item(res: IsolatedResult, *, timed_out: bool, limits: HangLimits,
              record: Mapping[str, Any] | None) -> DeadItem | None:
    """The verdict on the item a child died in (`timed_out`: killed by a time limit, the parent's or its own
    watchdog's); None when it crashed. `record`: the limit the child recorded for the item."""
    if not timed_out:
        return None
    if res.stalled:
        return DeadItem("hung", f"hung: {res.stalled} (past probe_timeout, {limits.first:g}s)", limits.first)
    if record is not None and record.get("by") == "second_limit":
        seconds = float(record.get("limit_s") or 0.0)
        return DeadItem("hung", f"did not finish within {seconds:.0f}s, its second limit ({limits.factor:g}× the "
                                f"longest probe this cell measured, {float(record.get('longest_s') or 0.0):.1f}s): "
                                f"stuck past it", seconds)
    seconds = float((record or {}).get("limit_s") or 0.0)
    return DeadItem("unfinished", "was still making progress when the cell's time ran out: cut short, not a hang (a "
                                  "slow compile is a figure, not a finding)", seconds)
