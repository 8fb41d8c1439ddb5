"""How the numerics mode's divergences are grouped into issues (`registry.IssueGroup.key` of its ``divergence``
group; no torch): one issue per divergence pattern (else layer class, else module) and backend."""

from __future__ import annotations

from typing import Any, Mapping


def group_key(backend: str, model: str, finding: Mapping[str, Any], value: Any) -> tuple[str, ...] | None:
    details = finding.get("details") or {}
    pattern = details.get("pattern") or finding.get("module_class") or finding.get("module")
    return ("divergence", backend, str(pattern)) if pattern else None
