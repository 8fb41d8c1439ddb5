"""CI-aware progress output: live lines on a terminal, plain events under CI, `::group::` on GitHub."""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import Mapping, TextIO

from .errors import ExecutionError

STEP_SUMMARY_LIMIT = 1024 * 1024  # bytes per step summary ($GITHUB_STEP_SUMMARY), GitHub's hard limit
STATUS_MARK = {"pass": "ok", "fail": "FAIL", "error": "ERROR", "timeout": "TIMEOUT", "crashed": "CRASHED", "skipped": "skipped",
               "inconclusive": "INCONCLUSIVE"}


@dataclass(frozen=True, kw_only=True)
class OutputStyle:
    github: bool
    ci: bool
    tty: bool

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None, stream: TextIO | None = None) -> "OutputStyle":
        env = os.environ if env is None else env
        stream = stream or sys.stderr
        return cls(
            github=env.get("GITHUB_ACTIONS") == "true",
            ci=env.get("CI", "").lower() in ("1", "true", "yes"),
            tty=bool(getattr(stream, "isatty", lambda: False)()),
        )


class Progress:
    """Thread-safe progress reporter for cells (cells may finish in parallel)."""

    def __init__(self, total: int, *, style: OutputStyle | None = None, stream: TextIO | None = None, quiet: bool = False) -> None:
        self.total = total
        self.done = 0
        self.stream = stream or sys.stderr
        self.style = style or OutputStyle.detect(stream=self.stream)
        self.quiet = quiet
        self._lock = threading.Lock()
        self._costs: dict[str, float] = {}  # cells still to finish in this run: their expected cost (`expect`)
        self._width = 1
        self._spent = 0.0  # seconds the cells finished so far took, and their expected cost
        self._spent_cost = 0.0

    def expect(self, costs: Mapping[str, float], width: int = 1) -> None:
        """The cells this run will start, with their expected costs (relative weights), `width` at a time: each
        finished cell's line then ends with the time left, those costs at the pace of the cells finished so far."""
        with self._lock:
            self._costs.update(costs)
            self._width = max(1, width)

    def _eta(self, cell_id: str, duration_s: float | None) -> str:
        with self._lock:
            cost = self._costs.pop(cell_id, None)
            if cost is None or duration_s is None:
                return ""
            self._spent += duration_s
            self._spent_cost += cost
            left = sum(self._costs.values())
            if not left or self._spent_cost <= 0:
                return ""
            seconds = left * self._spent / self._spent_cost / self._width
        return f" · about {format_duration(seconds)} left"

    def _write(self, text: str) -> None:
        if self.quiet:
            return
        with self._lock:
            self.stream.write(text + "\n")
            self.stream.flush()

    def info(self, text: str) -> None:
        self._write(text)

    def cell_started(self, cell_id: str) -> None:
        if self.style.github and not self.style.tty:
            return  # the group is opened when the cell finishes, so parallel output never interleaves
        self._write(f"[{self.done}/{self.total}] {cell_id}: running")

    def cell_reused(self, cell_id: str, status: str) -> None:
        with self._lock:
            self.done += 1
        self._write(f"[{self.done}/{self.total}] {cell_id}: {STATUS_MARK.get(status, status)} (finished earlier; --force reruns it)")

    def cell_rerun(self, cell_id: str, reason: str) -> None:
        """A cell that finished in an earlier run runs again: why, on one line."""
        self._write(f"{cell_id}: rerun ({reason})")

    def cell_finished(self, cell_id: str, status: str, duration_s: float, detail: str = "") -> None:
        with self._lock:
            self.done += 1
        line = (f"[{self.done}/{self.total}] {cell_id}: {STATUS_MARK.get(status, status)} in {duration_s:.1f}s"
                + self._eta(cell_id, duration_s))
        if self.style.github:
            body = f"::group::{line}\n{detail}\n::endgroup::" if detail else f"::group::{line}\n::endgroup::"
            self._write(body)
        else:
            self._write(line + (f"\n    {detail}" if detail else ""))


def format_duration(seconds: float) -> str:
    """`45s`, `3m05s`, `1h02m`."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


# --------------------------------------------------------------------------- step summary


def truncate_utf8(text: str, limit: int, *, note: str = "") -> str:
    """Cut `text` to at most `limit` UTF-8 bytes (note included), at a line boundary when possible."""
    data = text.encode("utf-8", "replace")  # a lone surrogate (a compiler's bad byte) becomes "?"
    if len(data) <= limit:
        return data.decode("utf-8")
    note_b = note.encode("utf-8")
    room = limit - len(note_b)
    if room <= 0:
        return note_b[: max(limit, 0)].decode("utf-8", errors="ignore")
    cut = data[:room]
    nl = cut.rfind(b"\n")
    if nl > 0:
        cut = cut[: nl + 1]
    return cut.decode("utf-8", errors="ignore") + note


def append_step_summary(
    text: str,
    *,
    env: Mapping[str, str] | None = None,
    limit: int = STEP_SUMMARY_LIMIT,
    pointer: str = "see the full report in the run's artifacts",
) -> int:
    """Append markdown to ``GITHUB_STEP_SUMMARY`` within the per-step cap; return bytes written.

    GitHub drops a step summary over 1 MiB (`STEP_SUMMARY_LIMIT`).
    What the step already wrote counts against the cap. Text that does not fit is truncated with a
    note ending in `pointer`. Returns 0 when the variable is unset or no room is left.
    """
    path = (os.environ if env is None else env).get("GITHUB_STEP_SUMMARY")
    if not path:
        return 0
    try:
        used = os.path.getsize(path)
    except FileNotFoundError:
        used = 0
    except OSError as exc:
        raise ExecutionError(f"{path}: cannot read step summary: {exc.strerror}") from None
    if not text.endswith("\n"):
        text += "\n"
    room = limit - used
    note = f"\n> [!WARNING]\n> Summary truncated to GitHub's 1 MiB step-summary limit; {pointer}.\n"
    if room < len(note.encode("utf-8")) + 64:
        return 0
    out = truncate_utf8(text, room, note=note)
    data = out.encode("utf-8", "replace")
    try:
        with open(path, "ab") as fh:
            fh.write(data)
    except OSError as exc:
        raise ExecutionError(
            f"{path}: cannot append to the step summary: {exc.strerror}",
            hint="GITHUB_STEP_SUMMARY must name a writable file (it is set by the runner)",
        ) from None
    return len(data)
