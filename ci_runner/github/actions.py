"""GitHub Actions environment helpers: step outputs, the step summary and annotations.

Each function reads the environment from an injected mapping (``env=None`` means ``os.environ``),
so tests and callers never need to patch globals. Outside GitHub Actions they do nothing harmful:
`set_output` returns ``False`` when its file variable is unset. The step summary (``GITHUB_STEP_SUMMARY``,
1 MiB cap) is written by `ci_runner.log.append_step_summary`, which the reports use too.

Platform limits honoured here (GitHub's documentation of workflow commands and job limits):

- ``GITHUB_OUTPUT``: always written in the delimiter form ``name<<DELIM`` … ``DELIM`` with a random
  delimiter that is checked not to occur in the value, so multiline values and values that look like
  ``key=value`` lines are safe.
- Annotations: at most 10 errors, 10 warnings (and 10 notices) per step and 50 per job. `AnnotationCap`
  enforces it; with ``RUNNER_TEMP`` set it keeps the job total in a small state file so that several
  steps of one job share the 50.
"""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, TextIO

from ..errors import ExecutionError

STEP_CAPS: dict[str, int] = {"error": 10, "warning": 10, "notice": 10}
JOB_CAP = 50
LEVELS: tuple[str, ...] = ("error", "warning", "notice", "debug")


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def in_actions(env: Mapping[str, str] | None = None) -> bool:
    """True when running as a GitHub Actions step (``GITHUB_ACTIONS=true``)."""
    return _env(env).get("GITHUB_ACTIONS", "").lower() == "true"


# --------------------------------------------------------------------------- outputs


def format_output(name: str, value: str, *, delimiter: str | None = None) -> str:
    """The ``GITHUB_OUTPUT`` record for one output, in the multiline delimiter form."""
    if not name or any(c in name for c in "\r\n=") or "<<" in name:
        raise ValueError(f"invalid GitHub output name {name!r}: no '=', '<<' or line breaks")
    value = str(value)
    delim = delimiter or f"ghadelimiter_{uuid.uuid4()}"
    while delim in value or delim in name:  # astronomically unlikely with a uuid, but never wrong
        delim = f"ghadelimiter_{uuid.uuid4()}"
    return f"{name}<<{delim}\n{value}\n{delim}\n"


def set_output(name: str, value: str, *, env: Mapping[str, str] | None = None) -> bool:
    """Append a step output to ``GITHUB_OUTPUT``; ``False`` (and no write) when it is not set."""
    path = _env(env).get("GITHUB_OUTPUT")
    if not path:
        return False
    record = format_output(name, value)
    try:
        with open(path, "a", encoding="utf-8", newline="\n") as fh:
            fh.write(record)
    except OSError as exc:
        raise ExecutionError(
            f"{path}: cannot write GitHub output {name!r}: {exc.strerror}",
            hint="GITHUB_OUTPUT must name a writable file (it is set by the runner)",
        ) from None
    return True


# --------------------------------------------------------------------------- annotations


def escape_data(value: str) -> str:
    """Escape a workflow-command message: ``%``, CR and LF."""
    return str(value).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(value: str) -> str:
    """Escape a workflow-command property value: as data, plus ``:`` and ``,``."""
    return escape_data(value).replace(":", "%3A").replace(",", "%2C")


def format_annotation(
    level: str,
    message: str,
    file: str | None = None,
    line: int | None = None,
    title: str | None = None,
    *,
    end_line: int | None = None,
    col: int | None = None,
) -> str:
    """The ``::level file=…,line=…,title=…::message`` workflow command, escaped."""
    if level not in LEVELS:
        raise ValueError(f"annotation level {level!r} is not one of {', '.join(LEVELS)}")
    props: list[tuple[str, str]] = []
    if file:
        props.append(("file", str(file)))
    if line is not None:
        props.append(("line", str(int(line))))
    if end_line is not None:
        props.append(("endLine", str(int(end_line))))
    if col is not None:
        props.append(("col", str(int(col))))
    if title:
        props.append(("title", str(title)))
    head = f"::{level}"
    if props and level != "debug":
        head += " " + ",".join(f"{k}={escape_property(v)}" for k, v in props)
    return f"{head}::{escape_data(message)}"


def annotate(
    level: str,
    message: str,
    file: str | None = None,
    line: int | None = None,
    title: str | None = None,
    *,
    stream: TextIO | None = None,
) -> str:
    """Write one annotation command to `stream` (stdout); return the line. No cap: see `AnnotationCap`."""
    cmd = format_annotation(level, message, file, line, title)
    out = stream if stream is not None else sys.stdout
    out.write(cmd + "\n")
    out.flush()
    return cmd


@dataclass
class AnnotationCap:
    """Counts annotations against GitHub's per-step and per-job caps and drops the excess.

    A caller that has more to say than fits checks `remaining()` first and spends the last slot on
    an "and N more" annotation. With `state_file`, the job-wide count survives across steps.
    """

    step_caps: dict[str, int] = field(default_factory=lambda: dict(STEP_CAPS))
    job_cap: int = JOB_CAP
    state_file: Path | None = None
    used: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "AnnotationCap":
        e = _env(env)
        tmp = e.get("RUNNER_TEMP")
        state = None
        if tmp:
            job = "".join(c if c.isalnum() or c in "-_" else "_" for c in e.get("GITHUB_JOB", "job"))
            state = Path(tmp) / f"deepview-ci-annotations-{job}.count"
        return cls(state_file=state)

    def _job_used(self) -> int:
        if self.state_file is None:
            return sum(self.used.values())
        try:
            return int(self.state_file.read_text(encoding="utf-8").strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def _job_add(self, n: int) -> None:
        if self.state_file is None:
            return
        try:
            self.state_file.write_text(str(self._job_used() + n), encoding="utf-8")
        except OSError:
            pass  # best effort: the per-step cap still holds

    def remaining(self, level: str) -> int:
        """How many more annotations of `level` this step may emit."""
        if level == "debug":
            return sys.maxsize
        step_left = self.step_caps.get(level, 10) - self.used.get(level, 0)
        job_left = self.job_cap - self._job_used()
        return max(0, min(step_left, job_left))

    def allow(self, level: str) -> bool:
        """Count one annotation if the caps allow it; otherwise record it as dropped."""
        if self.remaining(level) <= 0:
            self.dropped[level] = self.dropped.get(level, 0) + 1
            return False
        if level != "debug":
            self.used[level] = self.used.get(level, 0) + 1
            self._job_add(1)
        return True

    def annotate(
        self,
        level: str,
        message: str,
        file: str | None = None,
        line: int | None = None,
        title: str | None = None,
        *,
        stream: TextIO | None = None,
    ) -> str | None:
        """`annotate` if the caps allow; the command line, or ``None`` when dropped."""
        if not self.allow(level):
            return None
        return annotate(level, message, file, line, title, stream=stream)
