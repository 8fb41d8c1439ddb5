"""CI-aware progress output: live lines on a terminal, plain events under CI, `::group::` on GitHub."""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import Mapping, TextIO

STEP_SUMMARY_LIMIT = 1024 * 1024  # bytes per step summary ($GITHUB_STEP_SUMMARY), GitHub's hard limit
STATUS_MARK = {"pass": "ok", "fail": "FAIL", "error": "ERROR", "timeout": "TIMEOUT", "crashed": "CRASHED", "skipped": "skipped"}


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

    def cell_finished(self, cell_id: str, status: str, duration_s: float, detail: str = "") -> None:
        with self._lock:
            self.done += 1
        line = f"[{self.done}/{self.total}] {cell_id}: {STATUS_MARK.get(status, status)} in {duration_s:.1f}s"
        if self.style.github:
            body = f"::group::{line}\n{detail}\n::endgroup::" if detail else f"::group::{line}\n::endgroup::"
            self._write(body)
        else:
            self._write(line + (f"\n    {detail}" if detail else ""))
