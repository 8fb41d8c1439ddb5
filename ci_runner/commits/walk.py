"""The bisection walk, with `git bisect` semantics, over a list of candidate commits (oldest first).

The last candidate is the bad ref (bad by assumption, as in ``git bisect bad REF``); the good ref is before the
first. Each probe asks `classify(index)` for ``good``, ``bad`` or ``skip``. A skipped commit is never asked again;
the next probe is the untested commit nearest the middle of the open range (as ``git bisect skip`` does). The walk
ends with the first bad commit, or with the smallest range when skipped commits surround it, or when a budget
(steps, total time) runs out: then the open range is the answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Literal

Verdict = Literal["good", "bad", "skip"]


@dataclass(frozen=True, kw_only=True)
class Budget:
    """`max_steps` commits tried, `step_timeout` seconds for each setup and each repro run, `total_timeout` in all."""

    max_steps: int = 30
    step_timeout: float = 600.0
    total_timeout: float = 3600.0


@dataclass(kw_only=True)
class WalkResult:
    first_bad: int | None  # index of the first bad commit, when known exactly
    low: int  # the last index known good (-1: the good ref)
    high: int  # the first index known bad (the bad ref when never disproved)
    stopped: str = ""  # why the walk ended early ("" when it found an answer)
    tried: list[int] = field(default_factory=list)

    @property
    def range(self) -> tuple[int, int]:
        """Indices (inclusive) of the commits that may be the first bad one."""
        return (self.low + 1, self.high)


def next_probe(low: int, high: int, skipped: set[int]) -> int | None:
    """The untested, unskipped index in (low, high) nearest the middle; None when there is none."""
    mid = (low + high) // 2
    for offset in range(0, high - low):
        for i in (mid - offset, mid + offset + 1) if offset else (mid,):
            if low < i < high and i not in skipped:
                return i
    return None


def walk(count: int, classify: Callable[[int], Verdict], budget: Budget, *,
         clock: Callable[[], float] = time.monotonic) -> WalkResult:
    """Bisect `count` candidates (index `count - 1` is the bad ref) with `classify`."""
    low, high = -1, count - 1
    skipped: set[int] = set()
    tried: list[int] = []
    start = clock()
    while True:
        probe = next_probe(low, high, skipped)
        if probe is None:
            exact = high if high - low == 1 else None
            return WalkResult(first_bad=exact, low=low, high=high, tried=tried,
                              stopped="" if exact is not None else "every commit left in the range was skipped")
        if len(tried) >= budget.max_steps:
            return WalkResult(first_bad=None, low=low, high=high, tried=tried,
                              stopped=f"the step budget ran out ({budget.max_steps} steps)")
        if clock() - start >= budget.total_timeout:
            return WalkResult(first_bad=None, low=low, high=high, tried=tried,
                              stopped=f"the time budget ran out ({budget.total_timeout:g}s)")
        tried.append(probe)
        verdict = classify(probe)
        if verdict == "good":
            low = probe
        elif verdict == "bad":
            high = probe
        else:
            skipped.add(probe)
