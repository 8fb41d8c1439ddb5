"""The one probe-outcome model of the layers engine: what happened when one piece of a model (a submodule, or a
range of a graph's op nodes in the culprit search) was compiled and run alone on the target.

The layer search (`modes/layers/search.py`) and the culprit search (`modes/layers/culprit_search.py`) both record
`ProbeOutcome`s, one JSON line each in their `probes.jsonl` (`append_outcome` / `read_outcomes`: the last line for
a name wins, a torn last line from a crash is ignored). The ops mode has its own typed record,
`modes/ops/outcome.OpOutcome` with its `OpStatus` vocabulary (`unsupported`, `mismatch`, …): an op probe carries
the backend's verdict, a comparison and the op the compiler named, where a piece here passes or fails. The two
share the crash vocabulary, `CRASH_STATUSES`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping

from ..fsutil import append_record, read_records
from ..results.rootcause import error_signature

__all__ = ["CRASH_STATUSES", "FAILED_STATUSES", "UNFINISHED", "ProbeOutcome", "append_outcome", "read_outcomes"]

CRASH_STATUSES = ("crashed", "timeout")  # the probe's process died or hung (both models)
FAILED_STATUSES = ("fail", *CRASH_STATUSES)  # `inconclusive` is not failing: a search treats it as a pass
UNFINISHED = "unfinished"  # a probe cut short while still making progress: not failing (its failing parent is named)


@dataclass(kw_only=True)
class ProbeOutcome:
    """What happened when one piece was compiled and run alone on its inputs."""

    name: str  # what was probed: a module's qualified name (layers), a node range `start:end` (culprit)
    status: str  # pass | fail | crashed | timeout | skipped | inconclusive (passed, but the backend never ran it)
    # | unfinished (cut short by the time left while still making progress: not a hang, not failing)
    stage: str | None = None  # compile | run (for failures)
    error_type: str | None = None
    message: str = ""
    traceback: str = ""
    executing: str | None = None  # eager devices: the innermost submodule running when it failed
    signal: str | None = None
    duration_s: float = 0.0
    calls_tried: int = 0
    ran: dict[str, Any] = field(default_factory=dict)  # what the backend compiled and executed (`ran_facts`)
    diagnostics: list[str] = field(default_factory=list)  # the compiler's own lines (fd 2, exception chain)
    inferred_from: str | None = None  # not probed: the outcome of this twin module (same place in a twin parent)

    @property
    def failed(self) -> bool:
        return self.status in FAILED_STATUSES

    @property
    def cause(self) -> str:
        """The failure's root-cause signature (`rootcause`); status and error type for a crash or hang; "" if none."""
        return self.cause_of(())

    def cause_of(self, boilerplate: Collection[str]) -> str:
        """`cause`, keyed past a backend's `boilerplate` lines (`backends.boilerplate_lines`, `rootcause.cause_line`)."""
        if self.status == "fail":
            return error_signature(self.error_type or "", self.message, self.traceback, boilerplate=boilerplate).id
        return f"{self.status}:{self.error_type}" if self.failed else ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ProbeOutcome":
        """Also reads the culprit search's earlier rows, which named the range `key`."""
        known = set(cls.__dataclass_fields__)
        fields = {k: v for k, v in data.items() if k in known}
        if "name" not in fields and "key" in data:
            fields["name"] = data["key"]
        return cls(**fields)


def read_outcomes(path: Path) -> dict[str, ProbeOutcome]:
    """Outcomes appended so far (the last line for a name wins; a torn last line is ignored)."""
    return read_records(path, ProbeOutcome.from_json, lambda o: o.name)


def append_outcome(path: Path, outcome: ProbeOutcome) -> None:
    append_record(path, outcome.to_json())
