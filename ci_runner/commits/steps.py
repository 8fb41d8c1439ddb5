"""One bisection step: set the backend up at a commit (cached per commit), run the repro, classify the outcome.

Setup: each ``--setup`` command runs with ``bash -c`` in the scratch tree at the commit, with the repro
interpreter's folder first on PATH, a step timeout, and two variables:

* ``DEEPVIEW_BISECT_COMMIT``: the commit's hash;
* ``DEEPVIEW_BISECT_PREFIX``: a per-commit folder that outlives the bisection (``CACHE/<setup key>/<commit>/prefix``).
  It is put first on the repro's PYTHONPATH. A setup that installs there, e.g.
  ``python -m pip install --no-deps --no-build-isolation --target "$DEEPVIEW_BISECT_PREFIX" .``, is cached: a later
  step at that commit (another finding, another bisection) reuses it without rebuilding. A setup that installs
  into the interpreter itself leaves the prefix empty and runs again whenever the commit is stepped on.

A setup that fails is cached too (the commit is skipped without rebuilding). The repro runs with
`engine.repro.verify_script` (a fresh child of the given interpreter, with a timeout), compared with the finding by
the same rule that verified it (`rootcause.normalize_text` on both sides):

* exit 0 → ``good``; fails the same way as the finding → ``bad``;
* setup fails, or the repro fails differently (another error, a crash, a timeout) → ``skip``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..failures.failure import tail
from ..procs.isolate import run_command
from ..engine.repro import verify_script
from ..fsutil import atomic_write_json
from ..results.model import Finding
from ..backends.vendor import boilerplate_lines
from ..results.rootcause import signature
from .scratch import checkout
from .walk import Verdict

LOG_LIMIT = 6000


@dataclass(frozen=True, kw_only=True)
class Expectation:
    """How a finding's repro fails while the bug is there: its root-cause signature, error type and key text."""

    signature: str
    error_type: str | None
    text: tuple[str, ...]
    signal: bool  # a hard fault: death by signal or a hang reproduces it

    @classmethod
    def of(cls, f: Finding) -> "Expectation":
        sig = signature(f, boilerplate=boilerplate_lines())
        hard = (f.error_type or "").startswith("SIG") or f.error_type in ("crashed", "timeout", "Timeout")
        if hard:
            return cls(signature=sig.id, error_type=None, text=(), signal=True)
        text = (sig.message,) if f.error_type and sig.message else ()
        return cls(signature=sig.id, error_type=f.error_type or None, text=text, signal=False)


@dataclass(frozen=True, kw_only=True)
class Setup:
    commands: tuple[str, ...]
    python: str  # the interpreter setup installs into and the repro runs with (absolute)
    cache: Path  # CACHE/<setup key>
    timeout: float

    @staticmethod
    def key(commands: tuple[str, ...], python: str) -> str:
        return hashlib.sha256("\x1f".join((python, *commands)).encode("utf-8")).hexdigest()[:16]


@dataclass(kw_only=True)
class Step:
    commit: str
    verdict: Verdict
    seconds: float
    log: str
    repro_ran: bool = False
    setup_cached: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"commit": self.commit, "verdict": self.verdict, "seconds": round(self.seconds, 3), "log": self.log,
                "repro_ran": self.repro_ran, "setup_cached": self.setup_cached}


@dataclass(frozen=True, kw_only=True)
class Prepared:
    ok: bool
    prefix: Path | None  # None: nothing installed there (setup installed into the interpreter, or failed)
    log: str
    cached: bool


def _run_setup(command: str, *, cwd: Path, env: dict[str, str], timeout: float) -> tuple[bool, str]:
    """One setup command in bash (`isolate.run_command`: own session, killed whole on timeout or Ctrl-C)."""
    r = run_command(["bash", "-c", command], cwd=cwd, env=env, timeout=timeout, merge_stderr=True)
    text = f"$ {command}\n{r.stdout}"
    if r.returncode is None:
        return False, text + f"(timed out after {timeout:g}s)\n"
    if r.returncode != 0:
        return False, text + f"(exit {r.returncode})\n"
    return True, text


def prepare(setup: Setup, tree: Path, commit: str) -> Prepared:
    """Set the backend up at `commit`, or reuse the cached result of an earlier setup there."""
    folder = setup.cache / commit
    record = folder / "setup.json"
    prefix = folder / "prefix"
    if record.exists():
        try:
            data = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = {}
        if data.get("ok") is False:
            return Prepared(ok=False, prefix=None, log="(cached) " + str(data.get("log", "")), cached=True)
        if data.get("ok") is True and prefix.is_dir() and any(prefix.iterdir()):
            return Prepared(ok=True, prefix=prefix, log="(cached) setup of this commit reused", cached=True)
    shutil.rmtree(prefix, ignore_errors=True)
    prefix.mkdir(parents=True)
    checkout(tree, commit)
    bin_dir = str(Path(setup.python).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
           "DEEPVIEW_BISECT_COMMIT": commit, "DEEPVIEW_BISECT_PREFIX": str(prefix)}
    env.pop("PYTHONPATH", None)
    log, ok = "", True
    for command in setup.commands:
        ok, text = _run_setup(command, cwd=tree, env=env, timeout=setup.timeout)
        log += text
        if not ok:
            break
    atomic_write_json(record, {"ok": ok, "log": tail(log, LOG_LIMIT, marked=True)})
    used = ok and any(prefix.iterdir())
    return Prepared(ok=ok, prefix=prefix if used else None, log=tail(log, LOG_LIMIT, marked=True), cached=False)


def run_step(setup: Setup, tree: Path, commit: str, repro: Path, expect: Expectation) -> Step:
    """Set up at `commit`, run `repro`, classify (module docstring)."""
    t0 = time.monotonic()
    prep = prepare(setup, tree, commit)
    if not prep.ok:
        return Step(commit=commit, verdict="skip", seconds=time.monotonic() - t0, setup_cached=prep.cached,
                    log=tail(f"setup failed: skip\n{prep.log}", LOG_LIMIT, marked=True))
    env = {"PYTHONPATH": str(prep.prefix)} if prep.prefix else {}
    v = verify_script(repro, expect_text=list(expect.text), expect_error_type=expect.error_type, timeout=setup.timeout,
                      env=env, expect_signal=expect.signal, python=setup.python)
    if v.verified:
        verdict: Verdict = "bad"
    elif v.exit_code == 0:
        verdict = "good"
    else:
        verdict = "skip"
    log = f"{prep.log}\n--- repro: {verdict} ({v.note})\n{v.output_tail}"
    return Step(commit=commit, verdict=verdict, seconds=time.monotonic() - t0, log=tail(log, LOG_LIMIT, marked=True),
                repro_ran=True, setup_cached=prep.cached)
