"""A hang is measured, not assumed (issue 44): `run_process` with a `ProgressWatch` ends a child whose item in flight
stopped using CPU time and writing output past its first limit, and leaves a busy one to run."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from ci_runner.procs.isolate import run_process
from ci_runner.procs.progress import ProgressWatch, session_cpu_s

pytestmark = pytest.mark.subprocess  # every test here starts child processes

# a child that works (CPU) for `busy` seconds, then sleeps: its session's CPU time stops growing
CHILD = ("import sys, time\n"
         "end = time.monotonic() + float(sys.argv[1])\n"
         "while time.monotonic() < end:\n"
         "    pass\n"
         "time.sleep(60)\n")


def _run(tmp_path: Path, busy: float, timeout: float) -> tuple[object, ProgressWatch, float]:
    watch = ProgressWatch(first_limit=1.5, window=1.0, item=lambda: "probe", dump_signal=None)
    t0 = time.monotonic()
    end = run_process([sys.executable, "-c", CHILD, str(busy)], timeout=timeout, stdout=tmp_path / "out.txt",
                      env=dict(os.environ), watch=watch)
    return end, watch, time.monotonic() - t0


def test_a_sleeping_child_is_stalled_and_a_busy_one_is_not(tmp_path: Path) -> None:
    end, watch, took = _run(tmp_path, busy=0.0, timeout=30)
    assert end.timed_out and end.stalled and "no progress for 1 s" in end.stalled, end
    assert watch.stall is not None and watch.stall.cpu_s is not None and watch.stall.cpu_s < 0.05
    assert took < 10, took  # measured at the first limit plus a window, not at the 30 s limit

    # busy past the first limit (4 s > 1.5 s): never called stalled while it works; stalled once it sleeps
    end, watch, took = _run(tmp_path, busy=4.0, timeout=30)
    assert end.stalled and watch.stall is not None and watch.stall.elapsed_s >= 4.0, (end, watch.stall)


def test_session_cpu_counts_this_session() -> None:
    before = session_cpu_s(os.getsid(0))
    assert before is not None and before > 0
    assert session_cpu_s(-12345) is None  # no such session
