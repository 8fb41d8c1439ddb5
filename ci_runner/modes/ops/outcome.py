"""The ops mode's probe-outcome model: what happened when one op call (a signature) was probed on the target.

`OpStatus` is the backend's verdict vocabulary; its values are the strings of the wire rows, so the JSON does not
change. `OpOutcome` is the typed record the parent code works with (`ProbeRunner`, the probe store, the mode's
findings and probe table, the zoo's cross table). Rows become records only at the wire boundary: `from_row` reads
a child's `probes-*.jsonl` line or a store file's `outcome`, `to_row` writes one back. The child side
(`probe.run_probe`, `grouptest`) builds the wire rows themselves.

This is a second record beside the layers engine's `failures.outcome.ProbeOutcome` on purpose: a layer probe is a
piece of a model that passes or fails (one `fail` status, a root-cause signature), while an op probe carries the
backend's own verdict (`unsupported`, `error`, `mismatch`, `probe_error` …), a comparison and the op the compiler
named. Both share the crash vocabulary (`failures.outcome.CRASH_STATUSES`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Mapping

from ...failures.outcome import CRASH_STATUSES
from ...registry import FindingKind

__all__ = ["CPU_FAILS_TOO", "KIND_OF_STATUS", "OpOutcome", "OpStatus", "SEVERITY"]


class OpStatus(str, Enum):
    """An op probe's verdict (the value is the wire string)."""

    PASS = "pass"
    UNSUPPORTED = "unsupported"  # the backend refuses the op (compile error, no kernel)
    ERROR = "error"  # the backend accepted it and failed otherwise
    CRASHED = "crashed"  # the probe process died
    TIMEOUT = "timeout"  # the probe process hung
    MISMATCH = "mismatch"  # ran, but differs from CPU eager
    PROBE_ERROR = "probe_error"  # the probe itself could not be built (op not resolved, Dynamo could not trace it)
    INCONCLUSIVE = "inconclusive"  # passed, but the backend never compiled and ran it
    NOT_RUN = "not_run"  # no verdict: time ran out, or the probe process failed before probing

    def __str__(self) -> str:
        return self.value

    @property
    def is_crash(self) -> bool:
        return self.value in CRASH_STATUSES

    @property
    def storable(self) -> bool:
        """A verdict the probe store keeps (not `not_run`, which says nothing about the backend)."""
        return self is not OpStatus.NOT_RUN


KIND_OF_STATUS: dict[OpStatus, FindingKind] = {
    OpStatus.UNSUPPORTED: FindingKind.UNSUPPORTED_OP, OpStatus.ERROR: FindingKind.OP_ERROR,
    OpStatus.CRASHED: FindingKind.OP_ERROR, OpStatus.TIMEOUT: FindingKind.OP_ERROR,
    OpStatus.MISMATCH: FindingKind.OP_MISMATCH, OpStatus.PROBE_ERROR: FindingKind.PROBE_ERROR}
SEVERITY: dict[OpStatus, int] = {OpStatus.UNSUPPORTED: 5, OpStatus.CRASHED: 4, OpStatus.TIMEOUT: 3,
                                 OpStatus.ERROR: 2, OpStatus.MISMATCH: 1, OpStatus.PROBE_ERROR: 0}
CPU_FAILS_TOO = "CPU eager fails too"  # `probe.invalid_probe_message`: invalid inputs, not the backend
_ALWAYS = ("id", "op", "status", "stage", "error_type", "message", "named_op", "named_text", "metrics", "seconds")


@dataclass(kw_only=True)
class OpOutcome:
    """One op probe's outcome. Keys of `_ALWAYS` are always on the wire row; the others only when set."""

    id: str = ""  # the probe's id in its batch (`s00012`, `p0003`); not kept in the store
    op: str = ""
    status: OpStatus
    stage: str | None = None  # trace | compile | run | compare
    error_type: str | None = None
    message: str = ""
    named_op: str | None = None  # the op the backend's error names, and its phrase (`compare.named_op_from_error`)
    named_text: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)  # a mismatch's error metrics
    seconds: float | None = None
    traceback: str | None = None
    compare: str | None = None  # ok | mismatch | skipped: why
    ran: dict[str, Any] | None = None  # what the backend compiled and executed (`ran_facts`)
    diagnostics: dict[str, Any] | None = None  # {"compiler": [...], "exception_chain": [...]}
    group: int | None = None  # passed inside a group of this many probes compiled as one graph (`grouptest`)
    fails_together: dict[str, Any] | None = None  # {"ops", "message"}: a set that fails only together
    extra: dict[str, Any] = field(default_factory=dict)  # any other wire key, kept as it came

    @property
    def kind(self) -> FindingKind | None:
        return KIND_OF_STATUS.get(self.status)

    @property
    def severity(self) -> int:
        return SEVERITY.get(self.status, -1)

    @property
    def storable(self) -> bool:
        """An outcome the probe store keeps and reuses: a verdict (`OpStatus.storable`), and not a probe whose
        synthetic inputs CPU eager rejects as well (it says nothing about the backend; later inputs may be valid)."""
        return self.status.storable and not (self.status is OpStatus.PROBE_ERROR
                                             and (self.message or "").startswith(CPU_FAILS_TOO))

    @property
    def is_finding(self) -> bool:
        """Failures become findings; so does a probe that could not be built (its op did not resolve, its module
        did not import, Dynamo could not trace it), but not one whose synthetic inputs CPU eager rejects as well."""
        if self.status is OpStatus.PROBE_ERROR:
            return not (self.message or "").startswith(CPU_FAILS_TOO)
        return self.status in KIND_OF_STATUS

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "OpOutcome":
        """A wire row (a child's jsonl line, a store file's `outcome`) as a record; unknown keys go to `extra`."""
        known = {f.name for f in fields(cls)} - {"extra"}
        kw = {k: v for k, v in row.items() if k in known and v is not None}
        kw["status"] = OpStatus(row.get("status") or OpStatus.NOT_RUN)
        kw["message"] = str(row.get("message") or "")
        return cls(**kw, extra={k: v for k, v in row.items() if k not in known})

    def to_row(self) -> dict[str, Any]:
        """The wire row: the `_ALWAYS` keys, the others when set, then `extra`."""
        row: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _ALWAYS or (f.name != "extra" and value is not None):
                row[f.name] = value.value if isinstance(value, OpStatus) else value
        return {**row, **self.extra}
