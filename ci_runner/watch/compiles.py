"""The cost in compiles: how many graphs the backend compiled in this process, and the seconds that took (issue 44).

One tally per process. `backends.ran.CompileRecord` adds each graph it hands the backend (the seconds inside the
backend's compile of it); every backend compile a mode makes goes through it (`Backend.compile` and
`Backend.compile_recorded`, under `Backend.compile_watched`). An isolated child (`procs/isolate.py`) reports what it compiled with its result and
the parent folds it in (`add`), so a probe's compiles count where the probe was asked for; a child that crashed or
hung reports nothing. `ModeContext.each_phase` and the cell's mode loop read the tally before and after (`since`):
`data.compiles` per mode and phase.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["Compiles", "add", "tally", "since"]


@dataclass(frozen=True)
class Compiles:
    """Graphs compiled by the backend and the seconds spent in its compiles."""

    graphs: int = 0
    compile_s: float = 0.0

    def __add__(self, other: "Compiles") -> "Compiles":
        return Compiles(self.graphs + other.graphs, self.compile_s + other.compile_s)

    def __sub__(self, other: "Compiles") -> "Compiles":
        return Compiles(self.graphs - other.graphs, max(0.0, self.compile_s - other.compile_s))

    def __bool__(self) -> bool:
        return self.graphs > 0 or self.compile_s > 0.0

    def to_json(self) -> dict[str, int | float]:
        return {"graphs": self.graphs, "compile_s": round(self.compile_s, 3)}

    @classmethod
    def from_json(cls, data: object) -> "Compiles":
        """A `to_json` value (anything else: nothing compiled)."""
        if not isinstance(data, dict):
            return cls()
        graphs, seconds = data.get("graphs"), data.get("compile_s")
        return cls(graphs if isinstance(graphs, int) and not isinstance(graphs, bool) else 0,
                   float(seconds) if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) else 0.0)


_lock = threading.Lock()
_total = Compiles()


def add(graphs: int, compile_s: float) -> None:
    """Count `graphs` compiled in `compile_s` seconds (this process's, or a child's folded in)."""
    global _total
    with _lock:
        _total = _total + Compiles(int(graphs), float(compile_s))


def tally() -> Compiles:
    """Everything counted in this process so far."""
    with _lock:
        return _total


def since(before: Compiles) -> Compiles:
    """What was counted after `before` (a `tally()`)."""
    return tally() - before
