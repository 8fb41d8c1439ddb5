"""The child-process engine: run work in fresh child processes that may abort, segfault or hang.

Pieces (every mode and the numerics toolbox use these, nothing else starts a Python child):

- `run_isolated(target, payload, timeout=…)`: one child runs ``"module:function"`` on a JSON payload and
  returns a JSON value; the outcome is an `IsolatedResult` (ok | error | crashed | timeout), never an exception.
  `IsolatedResult.describe()` is the one sentence for what happened to the child.
- The journal: an append-only, fsync'd file of ``event<TAB>name`` lines (`Journal`). A child writes
  ``enter-<kind>``/``leave-<kind>`` around each item (`child_journal`); after a crash `open_entry` names the
  innermost item entered and not left: the item in flight.
- `supervise(...)`: the restart-after-crash loop. It runs children until the work is done: when one dies, the
  journal names the item in flight, the caller records it crashed/timeout (`Supervised.on_crash`), and a fresh
  child goes on with the rest.
- `run_command(argv, timeout=…)`: a child that is not Python of this package (git, a build's shell command), with
  the same session, timeout and die-with-parent rules.
- Process hygiene: every child dies with its parent (`die_with_parent`), and a cell worker ends itself past
  its budget (`arm_worker`), so an interrupted or killed run leaves no process behind.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..fsutil import append_line, atomic_write_json

__all__ = [
    "IsolatedResult", "CommandResult", "run_command", "Journal", "Attempt", "SupervisedRun", "child_journal", "open_entry", "run_isolated",
    "supervise", "child_env", "set_pdeathsig", "die_with_parent", "arm_worker", "signal_name", "JOURNAL_ENV", "PARENT_ENV",
]

JOURNAL_ENV = "DEEPVIEW_CI_JOURNAL"
PARENT_ENV = "DEEPVIEW_CI_PARENT_PID"  # the process a child must die with (set by `child_env`)
_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # looked up once here: a `preexec_fn` must not dlopen/dlsym between fork and exec


# --------------------------------------------------------------------------- the journal

class Journal:
    """An append-only journal file of ``event<TAB>name`` lines, each fsync'd as it is written."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def write(self, event: str, name: str) -> None:
        append_line(self.path, f"{event}\t{name}")

    def enter(self, kind: str, name: str) -> None:
        self.write(f"enter-{kind}", name)

    def leave(self, kind: str, name: str) -> None:
        self.write(f"leave-{kind}", name)

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def open_entry(self, kind: str = "module", *, since: int = 0) -> str | None:
        return open_entry(self.path, kind, since=since)


def open_entry(journal: Path | str, kind: str = "module", *, since: int = 0) -> str | None:
    """The innermost `enter-<kind>` without a matching `leave-<kind>` in the lines written from byte `since` on:
    what was running when a process died. A `leave` closes its entry and every entry opened after it."""
    try:
        with open(journal, "rb") as fh:
            fh.seek(since)
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    stack: list[str] = []
    for line in text.splitlines():
        event, _, name = line.partition("\t")
        if event == f"enter-{kind}":
            stack.append(name)
        elif event == f"leave-{kind}" and name in stack:
            while stack and stack.pop() != name:
                pass
    return stack[-1] if stack else None


def child_journal(event: str, name: str) -> None:
    """From inside an isolated child: append `event<TAB>name` to the parent's journal, if it gave one."""
    path = os.environ.get(JOURNAL_ENV)
    if path:
        append_line(path, f"{event}\t{name}")


# --------------------------------------------------------------------------- one child

@dataclass(frozen=True, kw_only=True)
class IsolatedResult:
    status: str  # ok | error | crashed | timeout
    value: Any = None
    error_type: str | None = None
    message: str = ""
    traceback: str = ""
    exit_code: int | None = None
    signal: str | None = None
    stderr_tail: str = ""
    timeout: float | None = None  # the limit the child ran under

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def describe(self) -> str:
        """What happened to the child, as the end of a sentence: "crashed (SIGSEGV)", "timed out after 60 s",
        "failed: ValueError: bad input" (the message's first line), "finished"."""
        if self.status == "crashed":
            return f"crashed ({self.signal or self.message})"
        if self.status == "timeout":
            return f"timed out after {self.timeout:.0f} s" if self.timeout is not None else "timed out"
        if self.status == "error":
            first = self.message.splitlines()[0] if self.message else ""
            return f"failed: {self.error_type}: {first}"
        return "finished"

    def failure(self, what: str, tail: int = 1500) -> dict[str, str]:
        """The `reason` and `stderr_tail` of a tool's result when its child did not finish:
        {"reason": "<what> could not run: the child crashed (SIGSEGV)", "stderr_tail": "…"}."""
        return {"reason": f"{what} could not run: the child {self.describe()}",
                "stderr_tail": (self.stderr_tail or "")[-tail:]}


def signal_name(returncode: int | None) -> str | None:
    """`SIGSEGV` for a process that died by a signal (negative return code), else None."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_isolated(target: str, payload: Mapping[str, Any], *, timeout: float, journal: Path | None = None,
                 env: Mapping[str, str] | None = None, cwd: Path | None = None) -> IsolatedResult:
    """Run `target` ("module:function") on `payload` in a fresh child (its own session; it dies with this
    process); the child is killed after `timeout` seconds. Never raises for what the child does."""
    with tempfile.TemporaryDirectory(prefix="deepview-iso-") as tmp:
        payload_path = Path(tmp) / "payload.json"
        result_path = Path(tmp) / "result.json"
        stderr_path = Path(tmp) / "stderr.log"
        payload_path.write_text(json.dumps({"target": target, "payload": payload}), encoding="utf-8")
        cenv = child_env()
        cenv.update(env or {})
        cenv["PYTHONUNBUFFERED"] = "1"
        if journal is not None:
            cenv[JOURNAL_ENV] = str(journal)
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", "ci_runner.engine.isolate", str(payload_path), str(result_path)],
                                    stdout=err, stderr=err, stdin=subprocess.DEVNULL, env=cenv,
                                    cwd=str(cwd) if cwd else None, start_new_session=True)
            try:
                proc.wait(timeout=max(0.1, timeout))
            except subprocess.TimeoutExpired:
                _kill_session(proc)
                return IsolatedResult(status="timeout", message=f"timed out after {timeout:g}s",
                                      stderr_tail=_tail(stderr_path), timeout=timeout)
            except BaseException:
                _kill_session(proc)
                raise
        tail = _tail(stderr_path)
        if result_path.exists():
            data = json.loads(result_path.read_text(encoding="utf-8"))
            return IsolatedResult(status=data["status"], value=data.get("value"), error_type=data.get("error_type"),
                                  message=data.get("message", ""), traceback=data.get("traceback", ""),
                                  exit_code=proc.returncode, stderr_tail=tail, timeout=timeout)
        sig = signal_name(proc.returncode)
        what = f"killed by {sig}" if sig else f"exited with code {proc.returncode}"
        return IsolatedResult(status="crashed", message=f"child process {what}", exit_code=proc.returncode,
                              signal=sig, stderr_tail=tail, timeout=timeout)


@dataclass(frozen=True, kw_only=True)
class CommandResult:
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_command(argv: Sequence[str], *, timeout: float, cwd: Path | None = None, env: Mapping[str, str] | None = None,
                merge_stderr: bool = False) -> CommandResult:
    """A child that is not a Python entry point of this package (git, a build's shell command): its own session, it
    dies with this process, and the whole session is killed at `timeout` or on Ctrl-C. Never raises for its exit."""
    proc = subprocess.Popen(list(argv), cwd=str(cwd) if cwd else None, env=dict(env) if env is not None else None,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            start_new_session=True, preexec_fn=set_pdeathsig)
    try:
        out, err = proc.communicate(timeout=max(0.1, timeout))
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        out, err = proc.communicate()
        return CommandResult(returncode=None, stdout=(out or b"").decode("utf-8", "replace"),
                             stderr=(err or b"").decode("utf-8", "replace"))
    except BaseException:
        _kill_session(proc)
        raise
    return CommandResult(returncode=proc.returncode, stdout=(out or b"").decode("utf-8", "replace"),
                         stderr=(err or b"").decode("utf-8", "replace"))


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- the restart-after-crash loop

@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One child to start: its payload and its time limit."""

    payload: Mapping[str, Any]
    timeout: float


@dataclass(frozen=True, kw_only=True)
class SupervisedRun:
    children: int  # children started
    restarts: int  # children that died in an item and were replaced
    stop_reason: str | None  # why the loop stopped before the work was done; None when it was done
    last: IsolatedResult | None  # the last child's outcome


def supervise(target: str, *, journal: Path, kind: str,
              next_attempt: Callable[[int], "Attempt | str | None"],
              on_crash: Callable[[str | None, IsolatedResult], "str | None"],
              on_ok: Callable[[IsolatedResult], "str | None"] = lambda _r: None,
              max_restarts: int | None = None, env: Mapping[str, str] | None = None,
              cwd: Path | None = None) -> SupervisedRun:
    """Run children of `target` until the work is done, restarting after each one that dies in an item.

    Before each child, `next_attempt(n)` (n = children started so far) gives its `Attempt`, or a stop reason
    (str), or None when nothing is left. After a child that returned, `on_ok(result)` may give a stop reason.
    After a child that did not return (error, crashed, timeout), `on_crash(item, result)` records the item in
    flight (`item`: the journal's open `enter-<kind>` entry written by that child, or None when it died outside
    any item) and returns a stop reason, or None to go on; the loop then closes that entry in the journal
    (`leave-<kind>`), so the journal stays balanced. More than `max_restarts` replaced children stop the loop.
    """
    jr = Journal(journal)
    children = restarts = 0
    last: IsolatedResult | None = None

    def done(stop: str | None) -> SupervisedRun:
        return SupervisedRun(children=children, restarts=restarts, stop_reason=stop, last=last)

    while True:
        step = next_attempt(children)
        if step is None or isinstance(step, str):
            return done(step)
        since = jr.size()
        last = run_isolated(target, step.payload, timeout=step.timeout, journal=journal, env=env, cwd=cwd)
        children += 1
        if last.ok:
            stop = on_ok(last)
            if stop is not None:
                return done(stop)
            continue
        item = jr.open_entry(kind, since=since)
        stop = on_crash(item, last)
        if item is not None:
            jr.leave(kind, item)
        if stop is not None:
            return done(stop)
        restarts += 1
        if max_restarts is not None and restarts > max_restarts:
            return done(f"gave up after {restarts} crashed children (max_restarts={max_restarts})")


# --------------------------------------------------------------------------- process hygiene

def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child this process starts: `env` (default: this one's) naming this process as the
    parent the child must die with (`die_with_parent`)."""
    out = dict(os.environ if env is None else env)
    out[PARENT_ENV] = str(os.getpid())
    return out


def set_pdeathsig() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies. Also usable as a `preexec_fn` for a
    child that is not a Python entry point of this package (a repro script being verified)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies: PR_SET_PDEATHSIG on Linux; elsewhere a thread that ends the
    process once it is re-parented. A child runs in its own session, so killing the parent's process group
    would miss it, and a hung child must not outlive the process that started it."""
    ppid = os.getppid()
    set_pdeathsig()
    expected = os.environ.get(PARENT_ENV, "")
    if expected.isdigit() and int(expected) != ppid:  # the parent died before prctl took effect
        os._exit(70)
    if _PRCTL is not None:
        return

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != ppid:
                os._exit(70)

    threading.Thread(target=watch, daemon=True, name="deepview-parent-watch").start()


def arm_worker(budget_s: float, *, grace_s: float = 10.0) -> None:
    """For a cell worker: die with the parent run, and end itself (and its process group, when it leads one)
    `grace_s` after its budget: the parent kills it at the budget, this holds when the parent cannot."""
    die_with_parent()
    limit = max(0.0, budget_s) + grace_s

    def expire() -> None:
        time.sleep(limit)
        sys.stderr.write(f"deepview-ci worker: past its budget of {budget_s:.1f}s; ending itself\n")
        sys.stderr.flush()
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(124)

    threading.Thread(target=expire, daemon=True, name="deepview-worker-deadline").start()


def _child(payload_path: str, result_path: str) -> int:
    die_with_parent()
    spec = json.loads(Path(payload_path).read_text(encoding="utf-8"))
    module_name, fn_name = spec["target"].split(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
        value = fn(spec["payload"])
        atomic_write_json(result_path, {"status": "ok", "value": value})
    except BaseException as exc:  # report everything, including SystemExit from a plugin
        atomic_write_json(result_path, {"status": "error", "error_type": type(exc).__name__, "message": str(exc)[:20000],
                                        "traceback": traceback.format_exc(limit=20)[-8000:]})
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))
