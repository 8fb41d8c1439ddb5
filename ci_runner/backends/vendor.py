"""The small protocol for backend-specific knowledge, and the registry of backends that have some.

A vendor module (today `openvino`, `iree`) gives its compile name (`NAME`, other names in `NAMES`), the facts its
watch counts (`FACT_KEYS`) and a `Watch` class (`VendorWatch`): evidence, from the backend's own logs or state, that
work handed to it ran elsewhere (a silent fallback), `GROUP_TESTING`: whether probes compiled together get the
verdicts they get alone (the default of `ops.group_testing: auto`), and `BOILERPLATE`: error-message lines that say
nothing of the cause (root causes skip them). Each is optional. Generic code asks `watch_for(compile_name)` and
`boilerplate_lines()` and never names a vendor.
"""

from __future__ import annotations

from typing import Any, Protocol

from . import iree, openvino

__all__ = ["VendorWatch", "watch_for", "vendor_fact_keys", "groups_agree", "boilerplate_lines"]


class VendorWatch(Protocol):
    """Started before a compile and run, stopped after; then `facts()` (counts for the row's `ran`) and
    `reason()` (why the backend did not run the work; None when it did or nothing was seen)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def facts(self) -> dict[str, Any]: ...

    def reason(self) -> str | None: ...


_VENDORS = {name: v for v in (openvino, iree) for name in getattr(v, "NAMES", (v.NAME,))}


def watch_for(compile_name: str | None) -> VendorWatch | None:
    """A fresh watch for the backend named `compile_name`, or None when this tool knows no fallback of it."""
    watch = getattr(_VENDORS.get(compile_name or ""), "Watch", None)
    return watch() if watch is not None else None


def vendor_fact_keys() -> tuple[str, ...]:
    """Every fact a vendor watch may report (summed over probes by `ran.backend_ran`)."""
    return tuple(dict.fromkeys(k for v in _VENDORS.values() for k in getattr(v, "FACT_KEYS", ())))


def groups_agree(compile_name: str | None) -> bool:
    """Whether probes compiled as one graph get the verdicts they get alone on this backend (true unless its vendor
    module says otherwise): `ops.group_testing: auto` groups only where they do."""
    vendor = _VENDORS.get(compile_name or "")
    return bool(getattr(vendor, "GROUP_TESTING", True))


def boilerplate_lines() -> frozenset[str]:
    """Every vendor's error-message lines that say nothing of the cause (`rootcause.cause_line` skips them). One
    set for all backends: a line is specific enough to be one backend's, and a results file mixes backends."""
    return frozenset(line for v in _VENDORS.values() for line in getattr(v, "BOILERPLATE", ()))
