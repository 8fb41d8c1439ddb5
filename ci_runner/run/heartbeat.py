"""Progress inside a cell: the worker's heartbeat file, and the run's console lines read from it.

The cell worker (`run/cellrun.py`) rewrites `DIR/cells/<cell-id>/heartbeat.json` at each mode and phase boundary
(`Heartbeat.event`, fed by `ModeContext.journal`) and as each mode ends (`Heartbeat.mode_done`): the mode and phase
it is in, when they started, the modes it finished with their status and seconds. It is written atomically but not
fsynced (a few small writes per mode: cheap), and read by CI logs, by a person, and by the run (`Watch`), which
prints one line as each mode starts and ends and as each phase starts, with the elapsed seconds, while the worker
runs. After a killed worker the parent reads it for how long the open mode ran (`mode_seconds`).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import ExecutionError
from ..fsutil import atomic_write_text
from ..results.model import HEARTBEAT_NAME

_EVENTS = {"enter-mode", "leave-mode", "enter-workload", "leave-workload", "enter-phase", "leave-phase"}


def _now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def read_heartbeat(cell_dir: Path) -> dict[str, Any]:
    """The cell's heartbeat, or {} when there is none or it cannot be read."""
    try:
        data = json.loads((cell_dir / HEARTBEAT_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class Heartbeat:
    """The worker's side: where the cell is, rewritten at boundaries. A worker restarted after a crash continues the
    `modes_done` of the one before it."""

    def __init__(self, cell_dir: Path, cell_id: str) -> None:
        self.path = cell_dir / HEARTBEAT_NAME
        before = read_heartbeat(cell_dir)
        done = before.get("modes_done") if before.get("cell") == cell_id else None
        first = before.get("cell_started") if done is not None else None
        self.state: dict[str, Any] = {"cell": cell_id, "pid": os.getpid(), "mode": None, "phase": None,
                                      "cell_started": first if isinstance(first, (int, float)) else time.time(),
                                      "mode_started": None, "phase_started": None,
                                      "modes_done": list(done) if isinstance(done, list) else []}
        self._lock = threading.Lock()

    def event(self, event: str, name: str) -> None:
        """A journal event: the boundaries change the state and rewrite the file; others are ignored."""
        if event not in _EVENTS:
            return
        with self._lock:
            now = time.time()
            if event == "enter-mode":
                self.state.update(mode=name, phase=None, mode_started=now, phase_started=None)
            elif event == "leave-mode":
                self.state.update(mode=None, phase=None, mode_started=None, phase_started=None)
            elif event.startswith("enter-"):  # `<mode>.<phase>`
                self.state.update(phase=name.split(".", 1)[-1], phase_started=now)
            else:
                self.state.update(phase=None, phase_started=None)
            self._write()

    def note(self, text: str) -> None:
        """Something the run says once on the console for this cell (`Watch`: "<cell>: note: <text>")."""
        with self._lock:
            self.state.setdefault("notes", []).append(text)
            self._write()

    def mode_done(self, mode: str, status: str, seconds: float) -> None:
        with self._lock:
            self.state["modes_done"].append({"mode": mode, "status": status, "seconds": round(seconds, 1)})
            self._write()

    def _write(self) -> None:
        now = time.time()
        since = {f"{k}_elapsed_s": round(now - self.state[f"{k}_started"], 1) if self.state[f"{k}_started"] else None
                 for k in ("cell", "mode", "phase")}
        try:
            atomic_write_text(self.path, json.dumps({**self.state, **since, "updated_at": _now_iso()}) + "\n",
                              sync=False)
        except (OSError, ExecutionError):  # progress is never worth failing the cell for (`fsutil.OutputError`)
            pass


def mode_seconds(cell_dir: Path, mode: str) -> float | None:
    """How long `mode` had run when the heartbeat was last written with it open (for a worker that was killed)."""
    hb = read_heartbeat(cell_dir)
    started = hb.get("mode_started")
    if hb.get("mode") != mode or not isinstance(started, (int, float)):
        return None
    return max(0.0, time.time() - started)


class Watch:
    """The run's side: polls a running cell's heartbeat every `every` seconds (a thread) and says each mode's start
    and end and each phase's start through `say` (one line each). Use as a context manager around the worker."""

    def __init__(self, cell_dir: Path, cell_id: str, say: Callable[[str], None], every: float = 1.0) -> None:
        self.cell_dir, self.cell_id, self.say, self.every = cell_dir, cell_id, say, every
        self._done = len(read_heartbeat(cell_dir).get("modes_done") or [])
        self._noted = len(read_heartbeat(cell_dir).get("notes") or [])
        self._at: tuple[Any, Any] = (None, None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"watch {cell_id}", daemon=True)

    def __enter__(self) -> "Watch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll()

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.poll()

    def poll(self) -> None:
        hb = read_heartbeat(self.cell_dir)
        done = hb.get("modes_done") or []
        for d in done[self._done:]:
            self.say(f"{self.cell_id}: {d.get('mode')} {d.get('status')} in {d.get('seconds')}s")
        self._done = max(self._done, len(done))
        notes = hb.get("notes") or []
        for text in notes[self._noted:]:
            self.say(f"{self.cell_id}: note: {text}")
        self._noted = max(self._noted, len(notes))
        mode, phase = hb.get("mode"), hb.get("phase")
        if mode and mode != self._at[0]:
            self.say(f"{self.cell_id}: {mode} started")
        if mode and phase and (mode, phase) != self._at:
            started = hb.get("mode_started")
            into = f" ({time.time() - started:.0f}s into {mode})" if isinstance(started, (int, float)) else ""
            self.say(f"{self.cell_id}: {mode}: phase {phase} started{into}")
        self._at = (mode, phase)
