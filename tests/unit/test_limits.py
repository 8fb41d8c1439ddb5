"""`procs/limits.py`: the one rule every probing child (ops, layers, culprit) runs under (issue 44)."""

from __future__ import annotations

import faulthandler
import os
import time
from pathlib import Path

import pytest

from ci_runner.procs.isolate import IsolatedResult
from ci_runner.procs.limits import (NO_DEADLINE_S, ChildLimits, HangLimits, dead_item, finite, item_limits,
                                    stacks_on_signal)
from ci_runner.procs.progress import DUMP_SIGNAL, ProgressWatch

LIMITS = HangLimits(first=30.0, window=30.0, factor=4.0)


def test_the_first_item_runs_to_the_time_left_and_later_ones_to_the_second_limit(tmp_path: Path) -> None:
    record = tmp_path / "limits.jsonl"
    child = ChildLimits(LIMITS, deadline_wall=time.time() + 1000.0, record_file=record)
    first = child.limit("g:p0,p1")
    assert 990.0 < first <= 1000.0  # nothing measured yet: a slow first compile is bounded by the cell's time only
    child.finished(40.0)
    assert child.limit("p2") == 160.0  # 4 x the longest measured
    child.finished(5.0)
    assert child.limit("p3", measured=[10.0]) == 160.0  # the longest counts, whoever measured it
    rows = item_limits(record)
    assert rows["g:p0,p1"]["by"] == "time_left" and rows["g:p0,p1"]["longest_s"] is None
    assert rows["p2"] == {"name": "p2", "limit_s": 160.0, "by": "second_limit", "longest_s": 40.0}


def test_the_second_limit_is_never_under_twice_the_first_nor_past_the_deadline(tmp_path: Path) -> None:
    assert LIMITS.second([1.0]) == (60.0, 1.0)
    child = ChildLimits(LIMITS, deadline_wall=time.time() + 100.0, measured=[50.0])  # 200 s would pass the deadline
    assert child.limit("p0") <= 100.0
    assert LIMITS.watch(tmp_path / "j", "probe", since=0).window == 15.0  # at most half of probe_timeout


def test_the_verdict_on_a_dead_probe_says_what_was_measured() -> None:
    stalled = IsolatedResult(status="timeout", stalled="no progress for 15 s after 45 s: its processes used 0.00 s "
                                                        "of CPU and its output did not grow")
    hung = dead_item(stalled, timed_out=True, limits=LIMITS, record=None)
    assert hung is not None and hung.verdict == "hung" and hung.words.startswith("hung: no progress for 15 s")
    assert "(past probe_timeout, 30s)" in hung.words and hung.seconds == 30.0
    own = IsolatedResult(status="crashed", exit_code=1)  # its own watchdog (faulthandler) ended it
    stuck = dead_item(own, timed_out=True, limits=LIMITS,
                      record={"name": "p2", "limit_s": 160.0, "by": "second_limit", "longest_s": 40.0})
    assert stuck is not None and stuck.verdict == "hung" and stuck.seconds == 160.0
    assert "its second limit (4× the longest probe this cell measured, 40.0s)" in stuck.words
    cut = dead_item(own, timed_out=True, limits=LIMITS, record={"name": "p0", "limit_s": 900.0, "by": "time_left"})
    assert cut is not None and cut.verdict == "unfinished" and "not a hang" in cut.words
    assert dead_item(IsolatedResult(status="crashed", signal="SIGSEGV"), timed_out=False, limits=LIMITS,
                     record=None) is None  # a crash is no hang


def test_no_deadline_is_a_finite_limit() -> None:
    """A run with no deadline (remaining() is inf, as a zoo probe run's): the watchdog still gets a number
    `faulthandler` takes (an infinite one raised OverflowError in the probing child)."""
    limit = ChildLimits(LIMITS, deadline_wall=float("inf")).limit("p0")
    assert limit == NO_DEADLINE_S and finite(float("inf")) == NO_DEADLINE_S and finite(5.0) == 5.0


def test_inside_stacks_on_signal_the_parents_signal_writes_where_the_child_is(tmp_path: Path) -> None:
    """The probing children's one handler for the parent's watch: the signal a stalled child is sent before it is
    killed (`ProgressWatch.dump_signal`) writes every thread's stack to the given file, and is unhandled again after
    the block, a raising one too."""
    assert ProgressWatch(first_limit=1.0, window=1.0, item=lambda: None).dump_signal == DUMP_SIGNAL
    stacks = tmp_path / "stacks.txt"
    with open(stacks, "w", encoding="utf-8") as fh:
        with stacks_on_signal(fh):
            os.kill(os.getpid(), DUMP_SIGNAL)  # faulthandler writes from the signal handler, at once
        assert not faulthandler.unregister(DUMP_SIGNAL)  # removed on leaving
        with pytest.raises(RuntimeError), stacks_on_signal(fh):
            raise RuntimeError("a probe loop that raised")
        assert not faulthandler.unregister(DUMP_SIGNAL)
    text = stacks.read_text(encoding="utf-8")
    assert "test_inside_stacks_on_signal_the_parents_signal_writes_where_the_child_is" in text, text
