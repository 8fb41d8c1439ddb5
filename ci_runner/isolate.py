"""Run one function in a fresh child process with a timeout; report crashes instead of dying.

Used by modes whose probes may abort, segfault or hang inside a backend. The function is named as
``"module:function"``, takes one JSON-able payload and returns a JSON-able value.

    res = run_isolated("ci_runner.modes.ops:probe_batch", {...}, timeout=60, journal=path)
    res.status  # "ok" | "error" | "crashed" | "timeout"

The child appends progress to `journal` (if given) through `child_journal()`, so after a crash the
caller can tell which item was running (see `modes.last_open_entry`).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .fsutil import append_line, atomic_write_json

_JOURNAL_ENV = "DEEPVIEW_CI_JOURNAL"


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

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def child_journal(event: str, name: str) -> None:
    """From inside an isolated child: append `event<TAB>name` to the parent's journal, fsync'd."""
    path = os.environ.get(_JOURNAL_ENV)
    if path:
        append_line(path, f"{event}\t{name}")


def run_isolated(target: str, payload: Mapping[str, Any], *, timeout: float, journal: Path | None = None,
                 env: Mapping[str, str] | None = None, cwd: Path | None = None) -> IsolatedResult:
    with tempfile.TemporaryDirectory(prefix="deepview-iso-") as tmp:
        payload_path = Path(tmp) / "payload.json"
        result_path = Path(tmp) / "result.json"
        stderr_path = Path(tmp) / "stderr.log"
        payload_path.write_text(json.dumps({"target": target, "payload": payload}), encoding="utf-8")
        child_env = dict(os.environ)
        child_env.update(env or {})
        child_env["PYTHONUNBUFFERED"] = "1"
        if journal is not None:
            child_env[_JOURNAL_ENV] = str(journal)
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", "ci_runner.isolate", str(payload_path), str(result_path)],
                                    stdout=err, stderr=err, stdin=subprocess.DEVNULL, env=child_env,
                                    cwd=str(cwd) if cwd else None, start_new_session=True)
            try:
                proc.wait(timeout=max(0.1, timeout))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                return IsolatedResult(status="timeout", message=f"timed out after {timeout:g}s",
                                      stderr_tail=_tail(stderr_path))
            except BaseException:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                raise
        tail = _tail(stderr_path)
        if result_path.exists():
            data = json.loads(result_path.read_text(encoding="utf-8"))
            return IsolatedResult(status=data["status"], value=data.get("value"), error_type=data.get("error_type"),
                                  message=data.get("message", ""), traceback=data.get("traceback", ""),
                                  exit_code=proc.returncode, stderr_tail=tail)
        sig = None
        if proc.returncode is not None and proc.returncode < 0:
            try:
                sig = signal.Signals(-proc.returncode).name
            except ValueError:
                sig = f"signal {-proc.returncode}"
        what = f"killed by {sig}" if sig else f"exited with code {proc.returncode}"
        return IsolatedResult(status="crashed", message=f"child process {what}", exit_code=proc.returncode,
                              signal=sig, stderr_tail=tail)


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", errors="replace")


def _die_with_parent() -> None:
    """Linux: SIGKILL this child when its parent dies (it runs in its own session, so killing the
    parent's process group would miss it, and a hung probe must not outlive its cell)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _child(payload_path: str, result_path: str) -> int:
    _die_with_parent()
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
