"""Repro scripts: rendered from Jinja2 templates in `ci_runner/templates/`, then run to verify them.

A repro exits non-zero while the failure is there and 0 once it is fixed, so it can live on as a
regression test. `verify_script` runs it in a fresh process (with the backend's env) and calls it
verified only when it fails the same way: same error type and the same key text (op or module), compared
after the volatile tokens of both (symbol ids like ``s96``, addresses, temporary paths, PIDs, counters) are
normalised by `rootcause.normalize_text`, so a compiler whose message names a fresh symbol each run verifies.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2

from ..fsutil import atomic_write_text
from .isolate import set_pdeathsig
from ..results.rootcause import normalize_text


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("ci_runner", "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # Python source, not HTML: values go in through |pyrepr only
    )


def pyrepr(value: Any) -> str:
    """A Python literal for `value` (strings, numbers, lists, dicts, None, bools)."""
    return repr(value)


def comment(text: Any) -> str:
    """Make arbitrary text safe inside `#` comments."""
    return re.sub(r"[\r\n]+", " ", str(text))


def render_template(name: str, **context: Any) -> str:
    env = _env()
    env.filters.setdefault("pyrepr", pyrepr)
    env.filters.setdefault("comment", comment)
    return env.get_template(name).render(**context)


def write_script(path: Path, text: str) -> Path:
    atomic_write_text(path, text)
    path.chmod(0o755)
    return path


@dataclass(frozen=True, kw_only=True)
class Verification:
    verified: bool
    exit_code: int | None
    output_tail: str
    note: str


def verify_script(script: Path, *, expect_text: Sequence[str], expect_error_type: str | None = None,
                  timeout: float = 60.0, env: Mapping[str, str] | None = None,
                  expect_signal: bool = False, python: str | None = None) -> Verification:
    """Run `script` alone; verified when it fails and its output names the same error type and text
    (both sides normalised by `rootcause.normalize_text`: `s96` and `s47` match).

    With `expect_signal`, a death by signal (abort, segfault) also counts as reproducing the failure.
    The child gets a clean PYTHONPATH-free environment plus `env`, so it cannot lean on the caller's imports
    beyond the installed packages (and the backend plugin's folder, which `env` may add). `python` runs it with
    another interpreter (default: this one), e.g. the one `bisect-commits` installs each commit into.
    """
    child_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    child_env.update(env or {})
    try:
        proc = subprocess.run([python or sys.executable, str(script.name)], cwd=script.parent, env=child_env,
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                              preexec_fn=set_pdeathsig)  # dies with the worker
    except subprocess.TimeoutExpired as exc:
        out = ((exc.stdout or b"") + (exc.stderr or b"")).decode("utf-8", "replace")[-4000:]
        return Verification(verified=expect_signal, exit_code=None, output_tail=out,
                            note=f"timed out after {timeout:g}s" + (" (hang reproduced)" if expect_signal else ""))
    out = (proc.stdout + proc.stderr).decode("utf-8", "replace")
    tail = out[-4000:]
    if proc.returncode == 0:
        return Verification(verified=False, exit_code=0, output_tail=tail, note="the repro passed: the failure did not reproduce")
    if proc.returncode < 0:
        return Verification(verified=expect_signal, exit_code=proc.returncode, output_tail=tail,
                            note=f"killed by signal {-proc.returncode}")
    norm_out = normalize_text(out)
    missing = [t for t in expect_text if normalize_text(t) not in norm_out]
    if expect_error_type and expect_error_type not in out:
        missing.append(expect_error_type)
    if missing:
        return Verification(verified=False, exit_code=proc.returncode, output_tail=tail,
                            note=f"failed differently: output lacks {', '.join(repr(m) for m in missing)}")
    return Verification(verified=True, exit_code=proc.returncode, output_tail=tail, note="reproduces the same failure")


def safe_filename(text: str, limit: int = 120) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:limit].strip("._") or "item"
