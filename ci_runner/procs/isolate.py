"""The child-process engine: run work in fresh child processes that may abort, segfault or hang.

Pieces (every mode, the cell runner, repro verification and the numerics toolbox use these; nothing else
starts a child process):

- `run_process(cmd, …)`: the one start site. A child in its own session, output to files, killed with its whole
  session by the one kill function (`kill_session`) past its time or when the wait is interrupted; `LiveChildren`
  lets Ctrl-C end every child at once; a foreign command (a repro script) gets a launcher that makes it die
  with this process. The outcome is a `ChildExit` (return code, timed out, signal).
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

import atexit
import contextlib
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

from ..watch import compiles
from ..failures.failure import first_line
from .progress import POLL_S, ProgressWatch
from ..fsutil import append_line, atomic_write_json

__all__ = [
    "IsolatedResult", "Journal", "Attempt", "SupervisedRun", "child_journal", "open_entry", "run_isolated",
    "run_process", "ChildExit", "LiveChildren", "kill_session", "file_tail", "supervise", "child_env",
    "set_pdeathsig", "die_with_parent", "arm_worker", "signal_name", "JOURNAL_ENV", "PARENT_ENV",
    "CommandResult", "run_command", "child_main", "WARM_ENV", "WarmServer", "WarmChild",
]

JOURNAL_ENV = "DEEPVIEW_CI_JOURNAL"
PARENT_ENV = "DEEPVIEW_CI_PARENT_PID"  # the process a child must die with (set by `child_env`)
WARM_ENV = "DEEPVIEW_CI_WARM_CHILDREN"  # "1": `run_isolated` forks its children from a warm server (`procs.warm`)
# differ between the children of one warm server (nothing the server imports reads them; pytest sets the last per test)
_PER_CHILD_ENV = (JOURNAL_ENV, PARENT_ENV, "PYTEST_CURRENT_TEST")
_WARM_KEEP = 2  # warm servers kept per process (each holds torch and transformers: ~0.5 GB); the oldest ends first
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


def child_journal(event: str, name: str, *, sync: bool = True) -> None:
    """From inside an isolated child: append `event<TAB>name` to the parent's journal, if it gave one (`sync`:
    `fsutil.append_line`'s; unsynced lines survive the child's crash, which is what the journal is for)."""
    path = os.environ.get(JOURNAL_ENV)
    if path:
        append_line(path, f"{event}\t{name}", sync=sync)


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
    stalled: str | None = None  # timed out because its `ProgressWatch` saw no progress: what it measured, in words

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
            return f"failed: {self.error_type}: {first_line(self.message, 10_000)}"
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


# --------------------------------------------------------------------------- the one start site

# A child that is not a Python entry point of this package (a repro script) cannot call `die_with_parent`
# itself: this stdlib-only launcher sets PR_SET_PDEATHSIG, checks the parent is still the one that started it,
# then execs the real command (the death signal survives exec). No `preexec_fn`: that runs Python code between
# fork and exec, which is unsafe in a threaded process (repro verification runs from a thread pool).
_LAUNCH = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(70)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


@dataclass(frozen=True, kw_only=True)
class ChildExit:
    """How a process started by `run_process` ended."""

    returncode: int | None  # the exit status (negative: the signal), as Popen reports it
    timed_out: bool  # it ran past its time and was killed
    stalled: str | None = None  # killed by its `ProgressWatch`: what it measured, in words

    @property
    def signal(self) -> str | None:
        """The signal that ended it on its own (`SIGSEGV`), None when it exited or was killed for time."""
        return None if self.timed_out else signal_name(self.returncode)

    def ended(self) -> str:
        """"killed by SIGSEGV" or "exited with code 3" (what a crash text says about the process)."""
        sig = signal_name(self.returncode)
        return f"killed by {sig}" if sig else f"exited with code {self.returncode}"


def kill_session(proc: subprocess.Popen[bytes], *, grace: float = 0.0) -> None:
    """The one kill: end a child and everything in its session (it leads one): SIGTERM and `grace` seconds to
    exit when `grace` > 0, then SIGKILL; waits for it. A child already gone is fine."""
    if grace > 0:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            proc.wait()
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class LiveChildren:
    """The children `run_process` is waiting for, so that Ctrl-C (`kill_all`) can end them all at once."""

    def __init__(self) -> None:
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()
        self.interrupted = False

    def add(self, p: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._procs.add(p)

    def discard(self, p: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._procs.discard(p)

    def kill_all(self, *, grace: float = 0.0) -> None:
        self.interrupted = True
        with self._lock:
            procs = list(self._procs)
        for p in procs:
            kill_session(p, grace=grace)


def run_process(cmd: Sequence[str], *, timeout: float, stdout: Path, stderr: Path | None = None,
                env: Mapping[str, str], cwd: Path | None = None, grace: float = 0.0, foreign: bool = False,
                append: bool = False, live: LiveChildren | None = None,
                warm_as: tuple[Sequence[str], Mapping[str, str]] | None = None,
                watch: ProgressWatch | None = None) -> ChildExit:
    """Run `cmd` in a fresh session to its end or `timeout` seconds, then `kill_session(grace=…)`: the one place
    this package starts a child process. Output goes to the file `stdout` (and `stderr`, else the same file;
    appended with `append`). `foreign`: the command is not this package's entry point, so the `_LAUNCH` wrapper
    makes it die with this process (ours call `die_with_parent` themselves). Any exception while waiting
    (Ctrl-C) kills the child before it propagates. With `WARM_ENV` set to "1" in `env`, an entry point of this
    package (`python -m ci_runner.…`) is forked from a warm server (`WarmServer`) instead of started cold.
    `warm_as=(argv, server_env)`: with `WARM_ENV` "1" in `server_env`, `argv` (such an entry point, doing what
    `cmd` does from `cwd`: it changes folder itself) is forked with the environment `env` from the server of
    `server_env` (the one this process's own children use); `cmd` runs cold when no server can serve. `watch`: polled
    about once a second (`procs/progress.py`); when it says the child's item in flight stalled, the child is ended
    there (`ChildExit.stalled`)."""
    argv = [sys.executable, "-c", _LAUNCH, str(os.getpid()), *cmd] if foreign else list(cmd)
    mode = "ab" if append else "wb"
    with contextlib.ExitStack() as files:
        out_fh = files.enter_context(open(stdout, mode))
        err_fh = files.enter_context(open(stderr, mode)) if stderr is not None else out_fh
        proc: Any = None
        if warm_as is not None and warm_as[1].get(WARM_ENV) == "1":
            proc = WarmServer.start(warm_as[0], stdout=stdout, stderr=stderr, env=env, server_env=warm_as[1])
        elif not foreign and env.get(WARM_ENV) == "1":
            proc = WarmServer.start(argv, stdout=stdout, stderr=stderr, env=env, cwd=cwd)
        if proc is None:  # cold (the default), not our entry point, or no warm server could start
            proc = subprocess.Popen(argv, stdout=out_fh, stderr=err_fh,
                                    stdin=subprocess.DEVNULL, env=dict(env), cwd=str(cwd) if cwd else None,
                                    start_new_session=True)
        if live is not None:
            live.add(proc)
        try:
            stalled = _wait(proc, timeout, watch, [stdout] if stderr is None else [stdout, stderr])
            if stalled is not None:
                kill_session(proc, grace=grace)
                return ChildExit(returncode=proc.returncode, timed_out=True, stalled=stalled)
        except subprocess.TimeoutExpired:
            kill_session(proc, grace=grace)
            return ChildExit(returncode=proc.returncode, timed_out=True)
        except BaseException:
            kill_session(proc, grace=grace)
            raise
        finally:
            if live is not None:
                live.discard(proc)
    return ChildExit(returncode=proc.returncode, timed_out=False)


def _wait(proc: Any, timeout: float, watch: ProgressWatch | None, files: Sequence[Path]) -> str | None:
    """Wait for `proc` up to `timeout` (TimeoutExpired past it); with a `watch`, poll it about once a second and
    return its verdict when it calls the child stalled (after `before_kill`)."""
    if watch is None:
        proc.wait(timeout=max(0.1, timeout))
        return None
    end = time.monotonic() + max(0.1, timeout)
    while True:
        left = end - time.monotonic()
        try:
            proc.wait(timeout=max(0.05, min(left, POLL_S)))
            return None
        except subprocess.TimeoutExpired:
            if left <= POLL_S:
                raise
        verdict = watch.poll(proc.pid, files)
        if verdict is not None:
            watch.before_kill(proc.pid)
            return verdict


def file_tail(path: Path, limit: int = 4000) -> str:
    """The last `limit` bytes of a file as text ("" when it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - limit))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


# --------------------------------------------------------------------------- one child running a target

def run_isolated(target: str, payload: Mapping[str, Any], *, timeout: float, journal: Path | None = None,
                 env: Mapping[str, str] | None = None, cwd: Path | None = None,
                 watch: ProgressWatch | None = None) -> IsolatedResult:
    """Run `target` ("module:function") on `payload` in a fresh child (its own session; it dies with this
    process); the child is killed after `timeout` seconds, or when `watch` says it stalled (`run_process`). Never
    raises for what the child does."""
    with tempfile.TemporaryDirectory(prefix="deepview-iso-") as tmp:
        payload_path = Path(tmp) / "payload.json"
        result_path = Path(tmp) / "result.json"
        stderr_path = Path(tmp) / "stderr.log"
        payload_path.write_text(json.dumps({"target": target, "payload": payload}), encoding="utf-8")
        cenv = isolated_env(env)
        if journal is not None:
            cenv[JOURNAL_ENV] = str(journal)
        end = run_process([sys.executable, "-m", "ci_runner.procs.isolate", str(payload_path), str(result_path)],
                          timeout=timeout, stdout=stderr_path, env=cenv, cwd=cwd, watch=watch)
        tail = file_tail(stderr_path)
        if end.timed_out:
            return IsolatedResult(status="timeout", message=end.stalled or f"timed out after {timeout:g}s",
                                  stderr_tail=tail, timeout=timeout, stalled=end.stalled)
        if result_path.exists():
            data = json.loads(result_path.read_text(encoding="utf-8"))
            done = compiles.Compiles.from_json(data.get("compiles"))
            compiles.add(done.graphs, done.compile_s)  # the child's compiles count here, where it was asked for
            return IsolatedResult(status=data["status"], value=data.get("value"), error_type=data.get("error_type"),
                                  message=data.get("message", ""), traceback=data.get("traceback", ""),
                                  exit_code=end.returncode, stderr_tail=tail, timeout=timeout)
        return IsolatedResult(status="crashed", message=f"child process {end.ended()}", exit_code=end.returncode,
                              signal=end.signal, stderr_tail=tail, timeout=timeout)


class WarmServer:
    """A warm server (`procs.warm`) of this process: started on first use, one per environment and working folder
    (the per-child variables aside), ended with this process. `WarmServer.start` forks an entry point of this
    package from it for `run_process`; None when no server can serve (then `run_process` starts the child cold)."""

    _servers: dict[tuple[Any, ...], "WarmServer"] = {}  # oldest first
    _ended: list["WarmServer"] = []  # stopped, not yet waited for
    _owner = 0  # the pid the servers belong to (a forked copy of this process starts its own)
    _guard = threading.Lock()

    def __init__(self, env: Mapping[str, str], cwd: Path | None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "ci_runner.procs.warm"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=dict(env), cwd=str(cwd) if cwd else None,
                                     start_new_session=True)
        self.lock = threading.Lock()
        self.cond = threading.Condition()
        self.replies: dict[str, int] = {}  # "id:<n>" -> pid, "pid:<pid>" -> return code
        self.next_id = 0
        self.alive = self.proc.stdout is not None and b'"ready"' in self.proc.stdout.readline()  # or EOF: it died
        threading.Thread(target=self._read, daemon=True, name="deepview-warm-reader").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self.cond:
                self.replies[f"id:{msg['id']}" if "id" in msg else f"pid:{msg['pid']}"] = \
                    msg["pid"] if "id" in msg else msg["returncode"]
                self.cond.notify_all()
        with self.cond:
            self.alive = False
            self.cond.notify_all()

    def await_reply(self, key: str, timeout: float | None) -> int | None:
        with self.cond:
            self.cond.wait_for(lambda: key in self.replies or not self.alive, timeout=timeout)
            return self.replies.pop(key, None)

    @classmethod
    def start(cls, argv: Sequence[str], *, stdout: Path, stderr: Path | None, env: Mapping[str, str],
              cwd: Path | None = None, server_env: Mapping[str, str] | None = None) -> "WarmChild | None":
        """`argv` (`python -m ci_runner.<module> ARGS…`) forked with the environment `env` from this process's
        server for `server_env` (default `env`) and `cwd` (started on first use); None when `argv` is not such an
        entry point or no server can serve it."""
        if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m" or not argv[2].startswith("ci_runner."):
            return None
        senv = env if server_env is None else server_env
        key = (tuple(sorted((k, v) for k, v in senv.items() if k not in _PER_CHILD_ENV)), str(cwd or os.getcwd()))
        with cls._guard:
            if cls._owner != os.getpid():
                cls._servers, cls._ended, cls._owner = {}, [], os.getpid()
                atexit.register(cls.close_all)
            server = cls._servers.pop(key, None)  # put back last: the most recently used
            if server is None or not server.alive:
                if server is not None:
                    cls._ended.append(server.stop())
                while len(cls._servers) >= _WARM_KEEP:
                    cls._ended.append(cls._servers.pop(next(iter(cls._servers))).stop())
                server = cls(senv, cwd)
            cls._servers[key] = server
        return server.fork(argv[2], argv[3:], stdout=stdout, stderr=stderr, env=env) if server.alive else None

    def fork(self, module: str, args: Sequence[str], *, stdout: Path, stderr: Path | None,
             env: Mapping[str, str]) -> "WarmChild | None":
        """`python -m <module> ARGS…` forked from this server (output appended: `run_process` opened the files)."""
        assert self.proc.stdin is not None
        with self.lock:
            self.next_id += 1
            rid = self.next_id
            req = {"id": rid, "module": module, "args": list(args), "stdout": str(stdout),
                   "stderr": str(stderr) if stderr is not None else None, "env": dict(env), "append": True}
            try:
                self.proc.stdin.write((json.dumps(req) + "\n").encode())
                self.proc.stdin.flush()
            except OSError:
                return None
        pid = self.await_reply(f"id:{rid}", None)
        return WarmChild(self, pid) if pid is not None else None  # None: the server died before it forked

    def stop(self) -> "WarmServer":
        """EOF on its stdin: the server's loop ends (its running children finish first; it is waited for later)."""
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.close()  # type: ignore[union-attr]
        return self

    @classmethod
    def close_all(cls) -> None:
        """End this process's servers (at exit) and wait for them: their children's CPU time is counted here."""
        servers = [*cls._servers.values(), *cls._ended] if cls._owner == os.getpid() else []
        cls._servers, cls._ended = {}, []
        for server in servers:
            try:
                server.stop().proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill_session(server.proc)


class WarmChild:
    """A child forked by a warm server, as `run_process` and `kill_session` use a `Popen`: `pid` (it leads its own
    session), `wait(timeout)` (the server reports its end), `returncode`."""

    def __init__(self, server: WarmServer, pid: int) -> None:
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            rc = self.server.await_reply(f"pid:{self.pid}", timeout)
            if rc is None and self.server.alive:
                raise subprocess.TimeoutExpired(f"warm child {self.pid}", timeout or 0.0)
            self.returncode = rc if rc is not None else -signal.SIGKILL  # its server died: so did it
        return self.returncode


@dataclass(frozen=True, kw_only=True)
class CommandResult:
    """How a command run by `run_command` ended, with its output."""

    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_command(argv: Sequence[str], *, timeout: float, cwd: Path | None = None, env: Mapping[str, str] | None = None,
                merge_stderr: bool = False) -> CommandResult:
    """A child that is not a Python entry point of this package (git, a build's shell command), through
    `run_process`: its own session, it dies with this process, and the whole session is killed at `timeout` or on
    Ctrl-C. Never raises for its exit."""
    with tempfile.TemporaryDirectory(prefix="deepview-cmd-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        end = run_process(argv, timeout=timeout, stdout=out, stderr=None if merge_stderr else err,
                          env=env if env is not None else os.environ, cwd=cwd, foreign=True)
        text = {p: p.read_bytes().decode("utf-8", "replace") if p.exists() else "" for p in (out, err)}
    return CommandResult(returncode=None if end.timed_out else end.returncode, stdout=text[out],
                         stderr="" if merge_stderr else text[err])


# --------------------------------------------------------------------------- the restart-after-crash loop

@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One child to start: its payload and its time limit."""

    payload: Mapping[str, Any]
    timeout: float
    watch: ProgressWatch | None = None  # ends the child when its item in flight stalls (`procs/progress.py`)


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
        last = run_isolated(target, step.payload, timeout=step.timeout, journal=journal, env=env, cwd=cwd,
                            watch=step.watch)
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

def isolated_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of `run_isolated`'s children: `child_env()`, `extra` (a backend's variables), unbuffered
    output. Repro verification forks from the warm server of this environment (`extra` None): the one its
    process's isolated children use."""
    out = child_env()
    out.update(extra or {})
    out["PYTHONUNBUFFERED"] = "1"
    return out


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child of this package (`python -m ci_runner.…`) this process starts: `env` (default:
    this one's) naming this process as the parent the child must die with (`die_with_parent`), and importing the
    same `ci_runner` as this process (`same_package_env`)."""
    out = dict(os.environ if env is None else env)
    out[PARENT_ENV] = str(os.getpid())
    out.update(same_package_env(out))
    return out


def same_package_env(env: Mapping[str, str]) -> dict[str, str]:
    """PYTHONPATH and PYTHONSAFEPATH so that a `python -m ci_runner.…` child runs this process's code (the CLI's),
    never a checkout that happens to be its working folder: `-m` would put that folder first on `sys.path`.
    PYTHONSAFEPATH (Python 3.11+) leaves it out; this package's folder goes first on PYTHONPATH unless it is an
    installed one (a site folder there would go before the standard library); the working folder follows (a model
    factory or plugin module there), unless it holds another `ci_runner`."""
    import site  # noqa: PLC0415 - only here

    root = Path(__file__).resolve().parents[2]
    sites = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()] if p}
    paths = [str(root)] if root not in sites else []
    cwd = Path.cwd()
    if cwd == root or not (cwd / "ci_runner").exists():
        paths.append(str(cwd))
    paths += [p for p in (env.get("PYTHONPATH") or "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "PYTHONSAFEPATH": "1"}


def set_pdeathsig() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (a foreign child gets the same from
    `run_process(foreign=True)`'s launcher)."""
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


def child_main(payload_path: str, result_path: str) -> int:
    """A child's entry (cold: `python -m ci_runner.procs.isolate`; warm: forked by `procs.warm`)."""
    die_with_parent()
    spec = json.loads(Path(payload_path).read_text(encoding="utf-8"))
    module_name, fn_name = spec["target"].split(":")
    before = compiles.tally()  # a warm server's fork starts with the server's count
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
        value = fn(spec["payload"])
        atomic_write_json(result_path, {"status": "ok", "value": value, "compiles": compiles.since(before).to_json()})
    except BaseException as exc:  # report everything, including SystemExit from a plugin
        atomic_write_json(result_path, {"status": "error", "error_type": type(exc).__name__, "message": str(exc)[:20000],
                                        "traceback": traceback.format_exc(limit=20)[-8000:],
                                        "compiles": compiles.since(before).to_json()})
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1], sys.argv[2]))
