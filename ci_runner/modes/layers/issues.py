"""How the layers mode's findings are grouped into issues (`registry.IssueGroup.key` of its ``layer`` group; no
torch): a layer failure whose culprit search found one op failing alone is filed under that op (the ``culprit``
group: one issue per op and backend, listing every layer and model it breaks), else per submodule."""

from __future__ import annotations

from typing import Any, Mapping


def culprit_op(finding: Mapping[str, Any]) -> str | None:
    """The op a layer finding's culprit search found failing alone (`details.culprit`), else None (a node range
    or no culprit: those stay grouped per submodule)."""
    c = (finding.get("details") or {}).get("culprit") or {}
    ops = c.get("ops") or []
    if c.get("found") and c.get("kind") == "single" and len(ops) == 1:
        return str(ops[0])
    return None


def group_key(backend: str, model: str, finding: Mapping[str, Any], value: Any) -> tuple[str, ...] | None:
    """``("culprit", backend, op)`` when one op fails alone, else ``("layer", backend, model, module)``."""
    if not value:
        return None
    op = culprit_op(finding)
    if op is not None:
        return ("culprit", backend, op)
    return ("layer", backend, model, str(value))
