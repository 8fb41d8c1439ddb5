"""The small protocol for backend-specific knowledge, and the registry of backends that have some.

A vendor module (today `openvino`) gives its compile name (`NAME`), the facts its watch counts (`FACT_KEYS`) and a
`Watch` class (`VendorWatch`): evidence, from the backend's own logs or state, that work handed to it ran
elsewhere (a silent fallback), and `GROUP_TESTING`: whether probes compiled together get the verdicts they get
alone (the default of `ops.group_testing: auto`). Generic code asks `watch_for(compile_name)` and never names a vendor.
"""

from __future__ import annotations

from typing import Any, Protocol

from . import openvino

__all__ = ["VendorWatch", "watch_for", "vendor_fact_keys", "groups_agree"]


class VendorWatch(Protocol):
    """Started before a compile and run, stopped after; then `facts()` (counts for the row's `ran`) and
    `reason()` (why the backend did not run the work; None when it did or nothing was seen)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def facts(self) -> dict[str, Any]: ...

    def reason(self) -> str | None: ...


_VENDORS = {openvino.NAME: openvino}


def watch_for(compile_name: str | None) -> VendorWatch | None:
    """A fresh watch for the backend named `compile_name`, or None when this tool knows no fallback of it."""
    vendor = _VENDORS.get(compile_name or "")
    return vendor.Watch() if vendor is not None else None


def vendor_fact_keys() -> tuple[str, ...]:
    """Every fact a vendor watch may report (summed over probes by `ran.backend_ran`)."""
    return tuple(k for v in _VENDORS.values() for k in v.FACT_KEYS)


def groups_agree(compile_name: str | None) -> bool:
    """Whether probes compiled as one graph get the verdicts they get alone on this backend (true unless its vendor
    module says otherwise): `ops.group_testing: auto` groups only where they do."""
    vendor = _VENDORS.get(compile_name or "")
    return bool(getattr(vendor, "GROUP_TESTING", True))
