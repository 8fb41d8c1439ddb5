"""`run_isolated`: a child that returns, raises, aborts, segfaults or hangs is reported, never fatal."""

from __future__ import annotations

from pathlib import Path

import pytest

from ci_runner.isolate import run_isolated
from ci_runner.modes import last_open_entry


@pytest.mark.parametrize(
    ("action", "status", "check"),
    [
        ("return", "ok", lambda r: r.value == {"echo": 3}),
        ("raise", "error", lambda r: r.error_type == "ValueError" and "bad input 3" in r.message),
        ("abort", "crashed", lambda r: r.signal == "SIGABRT"),
        ("segv", "crashed", lambda r: r.signal == "SIGSEGV"),
        ("exit", "error", lambda r: r.error_type == "SystemExit"),
        ("hard_exit", "crashed", lambda r: r.exit_code == 7),
        ("hang", "timeout", lambda r: "timed out" in r.message),
    ],
)
def test_child_outcomes(tmp_path: Path, action: str, status: str, check) -> None:
    journal = tmp_path / "journal.log"
    res = run_isolated("tests.fixtures.iso_targets:act", {"action": action, "n": 3}, timeout=5, journal=journal)
    assert res.status == status, res
    assert check(res), res
    if status in ("crashed", "timeout"):
        assert last_open_entry(journal, "item") == "item-3"


def test_a_hung_child_dies_with_its_parent(tmp_path: Path) -> None:
    """The cell worker is killed on timeout; its isolated probe (own session) must not live on."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pidfile = tmp_path / "child.pid"
    script = (
        "import sys; sys.path.insert(0, %r)\n"
        "from ci_runner.isolate import run_isolated\n"
        "run_isolated('tests.fixtures.iso_targets:hang_and_report', {'pidfile': %r}, timeout=600)\n"
    ) % (str(Path(__file__).resolve().parents[2]), str(pidfile))
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2])
    deadline = time.monotonic() + 60
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(pidfile.read_text())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the isolated child outlived its parent")
