"""The culprit search as a pure function of probe outcomes (`failures.outcome.ProbeOutcome`, named by range key).

`search` decides which node range to probe next from what is known so far (single ops first, in
`single_order`, then the smallest failing contiguous range); `culprit.py` runs the probes in isolated
children and feeds their outcomes back. Being pure, a fresh child can replay the known outcomes after a crash.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from ...failures.outcome import ProbeOutcome



@dataclass(frozen=True, kw_only=True)
class Step:
    """One op node of the graph, in graph order (its `getitem` users travel with it)."""

    index: int
    node: str  # the FX node's name
    op: str  # `aten.histc.default`
    source: str | None  # the innermost user frame of the node's stack trace
    inputs: list[str]  # the real inputs, described: `float32[1, 4, 16, 16] stride=[…]`, `4`
    probe: bool  # probed alone (an op with a kernel)


# --------------------------------------------------------------------------- the search (pure)

def range_key(start: int, end: int) -> str:
    return f"{start}:{end}"


def parse_key(key: str) -> tuple[int, int]:
    a, _, b = key.partition(":")
    return int(a), int(b)


class StopSearch(Exception):
    """A probe ends the search early (out of time, or a replay reached an unknown probe)."""


@dataclass
class SearchState:
    """The search's answer: a failing single node, or the smallest failing range, or neither."""

    kind: str  # single | range | none | incomplete
    key: str | None = None
    probed: list[str] = field(default_factory=list)
    note: str = ""
    failing: list[str] = field(default_factory=list)  # every single op that failed alone (`key` is the first)


def single_order(steps: Sequence[Step], hints: Sequence[str]) -> list[int]:
    """Probe order of the single nodes: ops the layer's error names first, then graph order; a node with the op and
    described inputs of an earlier one is left out (the same probe)."""
    probe = [s.index for s in steps if s.probe]
    hinted = [i for i in probe if any(_op_matches(steps[i].op, h) for h in hints)]
    # then ops whose name holds the named op's (`_safe_softmax` runs `_softmax` on a device)
    bare = {h.split(".")[1].strip("_") for h in hints if h.count(".") >= 1 and h.split(".")[1].strip("_")}
    related = [i for i in probe if i not in hinted and any(b in _bare(steps[i].op) for b in bare)]
    order = hinted + related + [i for i in probe if i not in hinted and i not in related]
    seen: set[tuple[str, tuple[str, ...]]] = set()
    out = []
    for i in order:
        key = (steps[i].op, tuple(steps[i].inputs))
        if key not in seen:
            seen.add(key)
            out.append(i)
    return out


def _bare(op: str) -> str:
    parts = op.split(".")
    return parts[1] if len(parts) >= 3 else op


def _op_matches(op: str, hint: str) -> bool:
    parts = op.split(".")
    packet = ".".join(parts[:2]) if len(parts) >= 3 else op
    return hint in (op, packet) or (len(parts) >= 3 and hint == parts[1])


def search(n: int, singles: Sequence[int], probe: Callable[[str], ProbeOutcome], *,
           all_singles: bool = True) -> SearchState:
    """Singles first, in `singles` order, up to the first that fails alone; then, unless `all_singles` is off, the
    other ops that fail alone (`failing`), found by group testing: the graph on each side of that op is probed as a
    range, and a failing range is halved down to single ops (a compiler stops at the first op it cannot lower, an
    eager device at the first op it lacks: a range holding an op that fails alone fails too; only singles that
    failed alone are named). Else the whole graph, then the smallest failing contiguous range: the shortest failing
    prefix, then its latest failing start (each by bisection; every range it reports was itself probed and failed)."""
    state = SearchState(kind="none")

    def p(key: str) -> ProbeOutcome:
        state.probed.append(key)
        return probe(key)

    try:
        if _singles(singles, p, state, all_singles):
            return state
        if n == 0:
            state.note = "the graph has no op nodes"
            return state
        whole = p(range_key(0, n))
        if not whole.failed:
            state.note = ("no single op fails alone, and the whole graph passes alone at this level: the failure "
                          "needs more than the module's ops (its Python code, guards or the model around it)")
            return state
        lo, hi = 1, n  # the shortest failing prefix [0, e)
        while lo < hi:
            mid = (lo + hi) // 2
            if p(range_key(0, mid)).failed:
                hi = mid
            else:
                lo = mid + 1
        end = lo
        lo, hi = 0, end - 1  # the latest start s with [s, end) failing
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if p(range_key(mid, end)).failed:
                lo = mid
            else:
                hi = mid - 1
        state.kind, state.key = "range", range_key(lo, end)
        state.note = "no single op fails alone"
        return state
    except StopSearch:
        state.kind = "incomplete"
        return state


def _singles(singles: Sequence[int], p: Callable[[str], ProbeOutcome], state: SearchState, all_singles: bool) -> bool:
    """Probe the single ops; True (and `state` answered) when one or more failed alone. Out of time after a
    failing one: that answer, said to be partial."""
    try:
        first = next((i for i in singles if p(range_key(i, i + 1)).failed), None)
        if first is not None:
            state.failing.append(range_key(first, first + 1))
            if all_singles:
                probe_ops = set(singles)
                for s, e in ((0, first), (first + 1, max(singles) + 1)):
                    _halve(s, e, probe_ops, p, state)
    except StopSearch:
        if not state.failing:
            raise
        state.note = "out of time before every single op was probed: other ops may fail alone too"
    if state.failing:
        state.kind, state.key = "single", state.failing[0]
    return bool(state.failing)


def _halve(s: int, e: int, probe_ops: set[int], p: Callable[[str], ProbeOutcome], state: SearchState) -> None:
    """The single ops of [s, e) that fail alone, into `state.failing` in graph order: a range that fails is halved
    (a range without a probed op is not probed)."""
    while s < e and s not in probe_ops:
        s += 1
    while e > s and e - 1 not in probe_ops:
        e -= 1
    if s >= e:
        return
    key = range_key(s, e)
    if key in state.failing or not p(key).failed:
        return
    if e - s == 1:
        state.failing.append(key)
        return
    mid = (s + e) // 2
    _halve(s, mid, probe_ops, p, state)
    _halve(mid, e, probe_ops, p, state)
