"""Warm starts for this package's child processes: a fork server that imports torch, Dynamo and transformers once.

A fresh child (an isolated child of `isolate.run_isolated`, a cell worker of `run/execute.py`) spends ~5.5 of its
first ~6.5 CPU s on this 2-core machine importing torch, Dynamo and transformers, and a run starts many children.
The warm server (`python -m ci_runner.procs.warm`, started by `isolate.WarmServer` on first use, once per
environment and working folder) imports them once, runs one warm-up compile on the meta device (`warm_compile`:
what a first compile imports), then forks one child per request. Each child is still a
process of its own: its own session, output files and environment (`PARENT_ENV` names the server, which it dies
with; the server dies with the process that started it), and it runs its module as `python -m` would (`runpy`,
as `__main__`), exit status and signal reported as `subprocess.Popen` reports them. Only what the server imported
before the fork is shared; a child whose environment differs from the server's in more than the per-child
variables (`isolate._PER_CHILD_ENV`) gets a server of its own.

Protocol, one JSON object per line: requests on the server's stdin ``{"id": n, "module": "ci_runner.…", "args":
[…], "stdout": path, "stderr": path|null, "env": {…}, "append": bool}``; replies on its stdout ``{"id": n,
"pid": pid}`` when the child is forked and ``{"pid": pid, "returncode": rc}`` when it has ended (negative: the
signal).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import sys
import traceback
from typing import Any

from .isolate import PARENT_ENV

PRELOAD = ("torch", "torch._dynamo", "transformers")  # what every child imports first (~5.5 CPU s here)


_REPLIES = 1  # the fd replies go to: the server's stdout, moved aside by `serve` (fd 1 then is its stderr)
BASE_PATH: list[str] = []  # set by `serve`: the interpreter's own `sys.path` entries (`procs/script.py` uses them)


def pythonpath_entries(value: str | None) -> list[str]:
    """A PYTHONPATH value's folders, absolute (relative ones are taken from the working folder, as Python does)."""
    return [os.path.abspath(p) for p in (value or "").split(os.pathsep) if p]


def interpreter_path() -> list[str]:
    """This interpreter's `sys.path` less what PYTHONPATH and the `-m` working folder added: what a fresh
    `python SCRIPT` with no PYTHONPATH puts after the script's own folder (site folders and .pth entries kept)."""
    given = {*pythonpath_entries(os.environ.get("PYTHONPATH")), os.getcwd()}
    return [p for p in sys.path if p and os.path.abspath(p) not in given]


def _reply(obj: dict[str, Any]) -> None:
    os.write(_REPLIES, (json.dumps(obj) + "\n").encode())


def _open(path: str, append: bool) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)


def _run_child(req: dict[str, Any]) -> int:
    """In the forked child: a session of its own, its output files, its environment, then the cold child's entry."""
    os.setsid()
    os.close(_REPLIES)  # the server's pipe to its requester stays the server's
    out = _open(req["stdout"], bool(req.get("append")))
    err = _open(req["stderr"], bool(req.get("append"))) if req.get("stderr") else out
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.environ.clear()
    os.environ.update(req["env"])
    os.environ[PARENT_ENV] = str(os.getppid())  # the server: the child dies with it (`die_with_parent`)
    sys.argv = ["-m", *req["args"]]  # as `python -m <module> ARGS…` sees them (runpy sets argv[0])
    sys.modules.pop(req["module"], None)  # not imported yet, as in a cold child (the server imports `isolate`)
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:  # what the interpreter does with it
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    return 0


def _fork(req: dict[str, Any]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = _run_child(req)
    except BaseException:  # an uncaught exception: the interpreter's traceback and status 1
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()  # what a cold child's interpreter runs at exit
    except BaseException:
        pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _reap() -> bool:
    """Report every child that has ended; whether any is still running."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        try:
            _reply({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})
        except OSError:
            pass  # the requester is gone: nobody to tell


def warm_compile() -> None:
    """One `torch.compile` (aot_autograd) of a tiny function on the meta device, then Dynamo reset as a fresh
    process has it: the modules a first compile imports (functorch, networkx, …: ~0.8 CPU s of every compiling
    child's start) are loaded once here. Meta tensors run no kernel, so no thread pool starts before the forks."""
    try:
        import torch  # deferred: imported by the server first (PRELOAD), when installed
        import torch._dynamo.utils as dynamo_utils  # deferred: as above
    except ImportError:
        return
    try:
        torch.compile(lambda x: torch.nn.functional.silu(x) * 2, backend="aot_eager")(torch.empty(4, device="meta"))
    except Exception:  # noqa: BLE001 - a warm-up only: a child compiles cold if this cannot
        pass
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    dynamo_utils.compilation_time_metrics.clear()


def serve() -> int:
    """The server's loop: fork a child per request line, report each end; stop when the requester closes stdin."""
    global _REPLIES
    starter = os.getppid()  # not PR_SET_PDEATHSIG (`die_with_parent`): that fires when the starter's THREAD ends,
    if os.environ.get(PARENT_ENV, str(starter)) != str(starter):  # and servers are started from pool threads
        os._exit(70)  # the starter died before this began
    BASE_PATH[:] = interpreter_path()
    _REPLIES = os.dup(1)
    os.dup2(2, 1)  # whatever an import prints goes to stderr, never into the replies
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # not installed: the children import what they need themselves
    warm_compile()
    _reply({"ready": os.getpid()})
    buf, done = b"", False
    while True:
        ready, _, _ = select.select([] if done else [0], [], [], 0.05)
        running = _reap()
        # the starter died: so does this server, and its children with it (theirs). Checked on every turn, also
        # after EOF: a dying starter's pipes close before its children are re-parented
        if os.getppid() != starter:
            os._exit(70)
        if done and not running:
            return 0
        if done or not ready:
            continue
        data = os.read(0, 1 << 16)
        if not data:  # the requester is done with this server: its running children end first
            done = True
            continue
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            _reply({"id": req["id"], "pid": _fork(req)})


if __name__ == "__main__":
    sys.exit(serve())
