"""`run_isolated`: a child that returns, raises, aborts, segfaults or hangs is reported, never fatal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ci_runner.procs.isolate import WARM_ENV, open_entry, run_isolated
from tests.fixtures.paths import ROOT

pytestmark = pytest.mark.subprocess  # every test here starts child processes (the child engine)


def _assert_dies_with_its_starter(starter: str, pidfile: Path, what: str, cwd: Path | None = None) -> None:
    """Start `starter` (Python source) in a process, wait for the child it starts to write `pidfile`, SIGKILL the
    starter, and assert that the child dies too."""
    parent = subprocess.Popen([sys.executable, "-c", starter], cwd=cwd)
    deadline = time.monotonic() + 60
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
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
        raise AssertionError(f"the {what} child outlived the process that started it")


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
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_child_outcomes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, action: str, status: str, check,
                        warm: bool) -> None:
    """Cold (`python -m ci_runner.procs.isolate`) and warm (forked from a warm server): the same outcomes."""
    monkeypatch.setenv(WARM_ENV, "1" if warm else "0")
    journal = tmp_path / "journal.log"
    res = run_isolated("tests.fixtures.iso_targets:act", {"action": action, "n": 3}, timeout=5, journal=journal)
    assert res.status == status, res
    assert check(res), res
    if status in ("crashed", "timeout"):
        assert open_entry(journal, "item") == "item-3"


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_hung_child_dies_with_its_parent(tmp_path: Path, warm: bool) -> None:
    """The cell worker is killed on timeout; its isolated probe (own session) must not live on (warm: the child of
    a warm server, which dies with the process that started it)."""
    pidfile = tmp_path / "child.pid"
    script = (
        f"import os; os.environ[{WARM_ENV!r}] = {'1' if warm else '0'!r}\n"
        "import sys; sys.path.insert(0, %r)\n"
        "from ci_runner.procs.isolate import run_isolated\n"
        "run_isolated('tests.fixtures.iso_targets:hang_and_report', {'pidfile': %r}, timeout=600)\n"
    ) % (str(ROOT), str(pidfile))
    _assert_dies_with_its_starter(script, pidfile, "isolated", cwd=ROOT)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_warm_child_is_forked_from_a_server_that_imported_torch(monkeypatch: pytest.MonkeyPatch, warm: bool) -> None:
    monkeypatch.setenv(WARM_ENV, "1" if warm else "0")
    first = run_isolated("tests.fixtures.iso_targets:whoami", {}, timeout=60)
    second = run_isolated("tests.fixtures.iso_targets:whoami", {}, timeout=60)
    assert first.ok and second.ok, (first, second)
    assert first.value["pid"] != second.value["pid"]  # a process per child, warm or cold
    assert first.stderr_tail == second.stderr_tail == ""  # nothing said about how it started
    if warm:  # forked by one server (its parent, not this process), torch imported before the child began
        assert first.value["ppid"] == second.value["ppid"] != os.getpid()
        assert first.value["torch"] and first.value["env"] == "1"
        # the server's warm-up compile loaded what a first compile imports, and left no trace of itself
        assert first.value["functorch"] and first.value["counters"] == {} and first.value["compiled_codes"] == 0
    else:
        assert first.value["ppid"] == os.getpid() and not first.value["torch"]


def test_a_warm_server_started_from_a_pool_thread_outlives_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The modes start children from thread pools (probes, repro checks). The server a pool thread started serves
    the next request from another thread after the first one ended (PR_SET_PDEATHSIG would have killed it with
    its starting thread: a new server, torch imported again, per pool)."""
    import threading

    monkeypatch.setenv(WARM_ENV, "1")
    monkeypatch.setenv("DEEPVIEW_TEST_POOL", "fresh")  # a server of its own, started by the first thread below
    got = []
    for _ in range(2):
        t = threading.Thread(target=lambda: got.append(run_isolated("tests.fixtures.iso_targets:whoami", {},
                                                                     timeout=60)))
        t.start()
        t.join()
        time.sleep(0.5)  # the ended thread's death signal, had the server asked for one, has been delivered
    assert all(r.ok for r in got), got
    assert got[0].value["ppid"] == got[1].value["ppid"] != os.getpid()


def test_describe_says_what_happened_to_the_child() -> None:
    from ci_runner.procs.isolate import IsolatedResult

    assert IsolatedResult(status="crashed", signal="SIGSEGV").describe() == "crashed (SIGSEGV)"
    assert IsolatedResult(status="crashed", message="child process exited with code 7").describe() == \
        "crashed (child process exited with code 7)"
    assert IsolatedResult(status="timeout", timeout=60.0).describe() == "timed out after 60 s"
    assert IsolatedResult(status="error", error_type="ValueError", message="bad\nmore").describe() == \
        "failed: ValueError: bad"


def test_journal_open_entry_counts_only_lines_since_an_offset(tmp_path: Path) -> None:
    from ci_runner.procs.isolate import Journal

    j = Journal(tmp_path / "j.log")
    j.enter("item", "a")
    since = j.size()
    assert j.open_entry("item") == "a" and j.open_entry("item", since=since) is None
    j.enter("item", "b")
    j.enter("item", "c")
    j.leave("item", "b")  # closes b and everything opened after it
    assert j.open_entry("item", since=since) is None
    j.enter("item", "d")
    assert j.open_entry("item", since=since) == "d" and j.open_entry("other") is None


def _supervise_items(tmp_path: Path, items: list[str], fail: dict[str, str], **kw: object):
    from ci_runner.procs.isolate import Attempt, supervise

    out = tmp_path / "done.jsonl"
    crashed: dict[str, str] = {}
    pending = list(items)

    def done_items() -> list[str]:
        import json

        return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []

    def next_attempt(n: int) -> Attempt | str | None:
        left = [i for i in pending if i not in done_items() and i not in crashed]
        if not left:
            return None
        return Attempt(payload={"items": left, "fail": fail, "out": str(out)}, timeout=3)

    def on_crash(item: str | None, res) -> str | None:
        if item is None:
            return f"died outside any item: {res.describe()}"
        crashed[item] = res.status
        return None

    run = supervise("tests.fixtures.iso_targets:items", journal=tmp_path / "journal.log", kind="item",
                    next_attempt=next_attempt, on_crash=on_crash, **kw)
    return run, done_items(), crashed


def test_supervise_restarts_after_each_crash_and_attributes_the_item_in_flight(tmp_path: Path) -> None:
    run, done, crashed = _supervise_items(tmp_path, ["a", "b", "c", "d", "e"], {"b": "abort", "d": "hang"})
    assert crashed == {"b": "crashed", "d": "timeout"}
    assert done == ["a", "c", "e"]
    assert run.stop_reason is None and run.children == 3 and run.restarts == 2
    assert open_entry(tmp_path / "journal.log", "item") is None  # the loop closed what the children left open


def test_supervise_gives_up_after_max_restarts(tmp_path: Path) -> None:
    run, done, crashed = _supervise_items(tmp_path, ["a", "b", "c"], {"a": "abort", "b": "abort", "c": "abort"},
                                          max_restarts=1)
    assert list(crashed) == ["a", "b"] and done == []
    assert run.stop_reason is not None and "max_restarts=1" in run.stop_reason


def test_supervise_stops_when_a_child_dies_outside_any_item(tmp_path: Path) -> None:
    from ci_runner.procs.isolate import Attempt, supervise

    calls: list[str | None] = []

    def on_crash(item: str | None, res) -> str | None:
        calls.append(item)
        return "stop" if item is None else None

    run = supervise("tests.fixtures.iso_targets:no_such_function", journal=tmp_path / "j.log", kind="item",
                    next_attempt=lambda n: Attempt(payload={}, timeout=30), on_crash=on_crash)
    assert calls == [None] and run.stop_reason == "stop" and run.last is not None and run.last.status == "error"


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_verify_script_runs_from_threads_and_each_outcome_is_named(tmp_path: Path, warm: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Repro verification runs in parallel (a thread pool): the one start site, no `preexec_fn`; a failing
    script verifies, a passing one does not, a hung one is killed at its timeout, an abort is a signal. Warm (forked
    from the server the children use, `procs/script.py`), a script sees what `python SCRIPT` sees: its folder and
    its own PYTHONPATH, not the folders the server was given (this checkout), and prints the same traceback."""
    from concurrent.futures import ThreadPoolExecutor

    from ci_runner.engine.repro import verify_script

    monkeypatch.setenv(WARM_ENV, "1" if warm else "0")
    (tmp_path / "plug").mkdir()
    (tmp_path / "plug" / "acme_plug.py").write_text("NAME = 'acme'\n")
    bodies = {"fails": "raise RuntimeError('unsupported operator aten.x.default')\n", "passes": "print('ok')\n",
              "hangs": "import time\ntime.sleep(60)\n", "aborts": "import os\nos.abort()\n",
              "plugin": "import acme_plug\nraise RuntimeError('unsupported operator aten.x.default in ' + acme_plug.NAME)\n",
              "checkout": "import tests.fixtures.paths\nraise RuntimeError('unsupported operator aten.x.default')\n"}
    scripts = {}
    for name, body in bodies.items():
        scripts[name] = tmp_path / f"{name}.py"
        scripts[name].write_text(body)
    with ThreadPoolExecutor(max_workers=3) as pool:
        futs = {n: pool.submit(verify_script, s, expect_text=["unsupported operator aten.x.default"],
                               expect_error_type="RuntimeError", timeout=3 if n == "hangs" else 60,
                               expect_signal=n == "aborts",
                               env={"PYTHONPATH": "plug"} if n == "plugin" else None)
                for n, s in scripts.items()}
        got = {n: f.result() for n, f in futs.items()}
    assert got["fails"].verified and got["fails"].exit_code == 1, got["fails"]
    assert got["fails"].output_tail.startswith(f'Traceback (most recent call last):\n  File "{scripts["fails"]}", line 1')
    assert not got["passes"].verified and got["passes"].exit_code == 0
    assert not got["hangs"].verified and got["hangs"].exit_code is None and "timed out" in got["hangs"].note
    assert got["aborts"].verified and got["aborts"].exit_code == -signal.SIGABRT, got["aborts"]
    assert got["plugin"].verified and "in acme" in got["plugin"].output_tail, got["plugin"]
    assert not got["checkout"].verified and "ModuleNotFoundError: No module named 'tests'" in got["checkout"].output_tail


def test_a_foreign_child_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """`run_process(foreign=True)` (a repro script, which cannot call `die_with_parent`): killing the starter
    kills the script too."""
    pidfile = tmp_path / "child.pid"
    hang = tmp_path / "hang.py"
    hang.write_text(f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    starter = (
        "import os, sys; sys.path.insert(0, %r)\nfrom pathlib import Path\n"
        "from ci_runner.procs.isolate import run_process\n"
        "run_process([sys.executable, %r], timeout=600, stdout=Path(%r), env=dict(os.environ), foreign=True)\n"
    ) % (str(ROOT), str(hang), str(tmp_path / "out.log"))
    _assert_dies_with_its_starter(starter, pidfile, "foreign")
