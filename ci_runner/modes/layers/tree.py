"""The layers mode's data model: the module tree that ran and the search's answer (what one probe found is
`failures.outcome.ProbeOutcome`, shared with the culprit search)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from ...failures.outcome import ProbeOutcome

ROOT = ""  # the root module's qualified name
ROOT_LABEL = "<root>"  # how the root is named in findings and reports


def label(name: str) -> str:
    return name or ROOT_LABEL


def unlabel(name: str) -> str:
    return ROOT if name == ROOT_LABEL else name


# --------------------------------------------------------------------------- module tree

@dataclass(frozen=True, kw_only=True)
class ModuleNode:
    name: str
    module_class: str
    parent: str | None  # nearest *called* ancestor; None for the root
    calls: int  # how many times the module ran in the captured forward
    replayable: bool = True  # its first call's inputs can be rebuilt (no opaque objects)
    why_not: str | None = None


@dataclass
class ModuleTree:
    """The modules that ran in the captured forward, each under its nearest called ancestor.

    Containers without a forward of their own (ModuleList, ModuleDict) never run, so the search descends
    through them: `model.layers.0` is a child of `model`.
    """

    nodes: dict[str, ModuleNode]  # in first-call order
    children_of: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def build(cls, entries: Iterable[tuple[str, str, int, bool, str | None]]) -> "ModuleTree":
        """`entries`: (name, module_class, calls, replayable, why_not) in first-call order; the root must be there."""
        raw = list(entries)
        names = {e[0] for e in raw}
        if ROOT not in names:
            raise ValueError("the root module was not captured")
        nodes: dict[str, ModuleNode] = {}
        children: dict[str, list[str]] = {}
        for name, cls_name, calls, replayable, why_not in raw:
            parent = None if name == ROOT else _nearest_ancestor(name, names)
            nodes[name] = ModuleNode(name=name, module_class=cls_name, parent=parent, calls=calls,
                                     replayable=replayable, why_not=why_not)
            children.setdefault(name, [])
            if parent is not None:
                children.setdefault(parent, []).append(name)
        return cls(nodes=nodes, children_of=children)

    @property
    def root(self) -> str:
        return ROOT

    def children(self, name: str) -> list[str]:
        return self.children_of.get(name, [])

    def path(self, name: str) -> list[str]:
        """Qualified names from the root down to `name` (the root first)."""
        out = [name]
        node = self.nodes[name]
        while node.parent is not None:
            out.append(node.parent)
            node = self.nodes[node.parent]
        return out[::-1]

    def to_json(self) -> list[dict[str, Any]]:
        return [asdict(n) for n in self.nodes.values()]

    @classmethod
    def from_json(cls, data: Sequence[Mapping[str, Any]]) -> "ModuleTree":
        return cls.build((d["name"], d["module_class"], int(d["calls"]), bool(d["replayable"]), d.get("why_not"))
                         for d in data)


def _nearest_ancestor(name: str, names: set[str]) -> str:
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        cand = ".".join(parts[:i])
        if cand in names:
            return cand
    return ROOT



@dataclass
class SearchResult:
    outcomes: dict[str, ProbeOutcome]  # in the order tried
    minimal: list[str]  # smallest failing modules, in tree order
    complete: bool  # False when the search stopped early (time budget, restarts)

    @property
    def whole_model(self) -> ProbeOutcome | None:
        return self.outcomes.get(ROOT)


class StopSearch(Exception):
    """Raised by a probe to end the search early (out of time); the outcomes so far stand."""
