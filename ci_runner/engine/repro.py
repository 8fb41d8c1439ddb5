"""Repro scripts: rendered from Jinja2 templates in `ci_runner/templates/`, then run to verify them.

A repro exits non-zero while the failure is there and 0 once it is fixed, so it can live on as a
regression test. `verify_script` runs it in a fresh process (`isolate.run_process`: its own session, dying
with the caller; safe to call from several threads at once) with the backend's env, and calls it
verified only when it fails the same way: same error type and the same key text (op or module), compared
after the volatile tokens of both (symbol ids like ``s96``, addresses, temporary paths, PIDs, counters) are
normalised by `rootcause.normalize_text`, so a compiler whose message names a fresh symbol each run verifies.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jinja2

from ..backends import backend_recipe, boilerplate_lines, is_self_test
from ..failures.failure import REPRO_FUNCTIONS, first_line
from ..fsutil import atomic_write_text
from ..quoting import TEMPLATE_FILTERS, shell_command
from ..procs.isolate import isolated_env, run_process
from ..results.rootcause import cause_line, normalize_text, without_type


def run_command(script: str, folder: Path, pythonpath: Sequence[str] = ()) -> str:
    """The command that runs `script` from `folder`, as printed in a repro's header and the reports: with the
    plugin folders it needs (`backends.plugin_pythonpath`) on PYTHONPATH relative to `folder`, so that the
    command holds no path of the machine that wrote it and works wherever the run folder and checkout sit alike."""
    rel = [os.path.relpath(p, folder) for p in pythonpath]
    return shell_command(["python", script], {"PYTHONPATH": os.pathsep.join(rel)} if rel else None)


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("ci_runner", "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # Python source, not HTML: values go in through the `quoting` filters only
    )
    env.filters.update(TEMPLATE_FILTERS)  # pyrepr, comment, dotted, shq
    return env


def plain_source(fn: Callable[..., Any]) -> str:
    """A function's source for a standalone script, without this package's type-checker comments.

    Read once, then cached: `inspect` reads the file on disk, which may have changed under a long-running process.
    """
    key = f"{fn.__module__}.{fn.__qualname__}"
    source = _SOURCES.get(key)
    if source is None:
        source = _SOURCES[key] = re.sub(r"  # type: ignore\[[^\]]*\]", "", inspect.getsource(fn))
    return source


_SOURCES: dict[str, str] = {}
# the one failure classifier, as every repro script embeds it (`{{ failure_source }}`: unwrap, stage_of, …)
FAILURE_SOURCE = "\n\n".join(plain_source(fn) for fn in REPRO_FUNCTIONS)


def render_template(name: str, **context: Any) -> str:
    return _env().get_template(name).render(failure_source=FAILURE_SOURCE, **context)


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


# What every rendered repro prints as its first statement (the templates' first line after the header): a run
# whose output lacks it never reached the script's own code (it failed to compile, e.g. a SyntaxError that echoes
# the header comment holding the finding's error text), so nothing it printed can verify the finding.
START_MARKER = "REPRO STARTED"


def _did_not_start(script: Path, out: str) -> str | None:
    """Why the run of `script` (output `out`) does not count as the script having run, or None when it did: the
    script must compile, and one that prints the start marker must have printed it."""
    try:
        source = script.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"the repro could not be read ({exc})"
    try:
        compile(source, str(script), "exec")
    except (SyntaxError, ValueError) as exc:  # ValueError: a NUL byte in the source
        return f"the repro did not run: it does not compile ({type(exc).__name__}: {first_line(str(exc), 200)})"
    if f"print({START_MARKER!r}" in source.replace('"', "'") and START_MARKER not in out:
        return f"the repro did not run: it failed before its first line ({first_line(_last_line(out), 200) or 'no output'})"
    return None


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def expected_cause(message: str, error_type: str | None = None) -> str:
    """The cause line a repro's output must show for `message`: its first line past a backend's boilerplate
    (`rootcause.cause_line`, the line root causes are keyed on), normalised (`rootcause.normalize_text`)."""
    return normalize_text(cause_line(without_type(message, error_type), boilerplate_lines(), 120)).strip()


def _is_boilerplate(text: str) -> bool:
    norm = normalize_text(text).strip().rstrip(".")
    return bool(norm) and any(normalize_text(b).strip().rstrip(".").startswith(norm) for b in boilerplate_lines())


def verify_script(script: Path, *, expect_text: Sequence[str], expect_error_type: str | None = None,
                  timeout: float = 60.0, env: Mapping[str, str] | None = None,
                  expect_signal: bool = False, python: str | None = None, expect_hang: bool | None = None,
                  expect_message: str | None = None) -> Verification:
    """Run `script` alone; verified only when it demonstrably ran and fails the same way as the finding.

    * It ran: the script compiles, and one that prints `START_MARKER` (every template's first statement) printed it.
    * A crash or error finding: it exits non-zero, its output names the same error type (as a word) and holds every
      `expect_text` and the finding's cause line (`expect_message` keyed past a backend's boilerplate line by
      `rootcause.cause_line`, as root causes are); both sides normalised by `rootcause.normalize_text` (`s96` and
      `s47` match). A text that is only a backend's boilerplate line (IREE's "JIT compilation failed") is no
      evidence: it is dropped, and an expectation left with no evidence at all verifies nothing.
    * `expect_signal`: a death by signal (abort, segfault) reproduces a hard fault; `expect_hang` (default:
      `expect_signal`, as before the two were told apart): still running at `timeout` reproduces a hang. A hard
      fault's repro that exits on its own, with or without an error, does not reproduce it.

    Anything else leaves it unverified, and the note says what the repro did. The child gets a clean
    PYTHONPATH-free environment plus `env`, so it cannot lean on the caller's imports beyond the installed packages
    (and the backend plugin's folder, which `env` may add). `python` runs it with another interpreter (default: this
    one), e.g. the one `bisect-commits` installs each commit into.
    """
    hang_ok = expect_signal if expect_hang is None else expect_hang
    script_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    script_env.update(env or {})
    # warm (the opt-in `WARM_ENV`): forked from the server this process's children use, torch already imported;
    # not for another interpreter, nor for variables of the backend's that torch may read as it is imported
    warm = None if python is not None or set(env or {}) - {"PYTHONPATH"} else \
        ([sys.executable, "-m", "ci_runner.procs.script", str(script.parent), script.name], isolated_env())
    with tempfile.TemporaryDirectory(prefix="deepview-repro-") as tmp:
        out_path, err_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        end = run_process([python or sys.executable, str(script.name)], timeout=timeout, stdout=out_path, stderr=err_path,
                          env=script_env, cwd=script.parent, foreign=True, warm_as=warm)  # foreign: it dies with the worker
        out = (out_path.read_bytes() + err_path.read_bytes()).decode("utf-8", "replace")
    tail = out[-4000:]
    hard = hang_ok or expect_signal
    not_started = _did_not_start(script, out)
    if not_started:
        return Verification(verified=False, exit_code=None if end.timed_out else end.returncode, output_tail=tail,
                            note=not_started)
    if end.timed_out:
        return Verification(verified=hang_ok, exit_code=None, output_tail=tail,
                            note=f"timed out after {timeout:g}s" + (" (hang reproduced: still stuck past the limit)"
                                                                    if hang_ok else ": it hung instead of failing"))
    if end.returncode == 0:
        return Verification(verified=False, exit_code=0, output_tail=tail,
                            note="the repro passed: the failure did not reproduce")
    if end.returncode is not None and end.returncode < 0:
        return Verification(verified=expect_signal, exit_code=end.returncode, output_tail=tail,
                            note=f"killed by signal {-end.returncode}" + ("" if expect_signal else
                                                                          ": it crashed instead of failing"))
    ended = first_line(_last_line(out), 200) or "no output"
    if hard and not expect_text and not expect_message:
        what = "a hang" if hang_ok and not expect_signal else "a hard fault" if expect_signal and not hang_ok else \
            "a hang or hard fault"
        return Verification(verified=False, exit_code=end.returncode, output_tail=tail,
                            note=f"failed differently: exit code {end.returncode} instead of {what} ({ended})")
    norm_out = normalize_text(out)
    texts = [t for t in expect_text if t and not _is_boilerplate(t)]
    dropped = len([t for t in expect_text if t]) - len(texts)
    cause = expected_cause(expect_message, expect_error_type) if expect_message else ""
    if cause and _is_boilerplate(cause):
        cause = ""
    missing = [t for t in texts if normalize_text(t) not in norm_out]
    if cause and cause not in norm_out:
        missing.append(cause[:160])
    if expect_error_type and not re.search(rf"(?<!\w){re.escape(expect_error_type)}\b", out):  # a qualified name counts
        missing.append(expect_error_type)
    if missing:
        return Verification(verified=False, exit_code=end.returncode, output_tail=tail,
                            note=f"failed differently: output lacks {', '.join(repr(m) for m in missing)} "
                                 f"(it ended: {ended})")
    if not texts and not cause and dropped:
        return Verification(verified=False, exit_code=end.returncode, output_tail=tail,
                            note=f"not the same failure shown: the only shared text is a backend's boilerplate line "
                                 f"(it ended: {ended})")
    return Verification(verified=True, exit_code=end.returncode, output_tail=tail, note="reproduces the same failure")


def key_text(message: str) -> list[str]:
    """A stable piece of the error text for verification (its cause line past a backend's boilerplate, before node
    names or numbers vary)."""
    line = cause_line(message, boilerplate_lines(), 120)  # past a backend's boilerplate line, as root causes key it
    for cut in (" in node ", " at 0x", "\n"):
        if cut in line:
            line = line.split(cut, 1)[0]
    line = line.strip()
    return [line[:80]] if len(line) >= 8 else []


def safe_filename(text: str, limit: int = 120) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:limit].strip("._") or "item"


# --------------------------------------------------------------------------------------------- the backend in a repro

def plugin_modules(spec: Any) -> list[str]:
    mods = list(spec.imports)
    if spec.compile and ":" in spec.compile:
        mods.append(spec.compile.split(":", 1)[0])
    if is_self_test(spec):
        mods.append("ci_runner")
    return list(dict.fromkeys(mods))


def template_backend(spec: Any, *, compile_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The backend as every repro writes it: the one context of `templates/_repro_backend.py.j2` (`backend`).
    From `backends.backend_recipe`: kind eager | sim | callable | registered and what that kind needs (name, module,
    attr, options), the compile options (`compile_options` when the repro sets some itself, e.g. `dynamic`), the
    env, the plugin imports (the callable's own module is imported by `get_backend`), the plugin modules a reader
    needs (`plugin_modules`), the device and simdev's options (None off simdev)."""
    r = backend_recipe(spec)
    kind = "callable" if r.kind == "plugin" else r.kind
    return {"kind": kind, "name": r.name if kind in ("sim", "registered") else None, "module": r.module,
            "attr": r.attr, "options": dict(r.options),
            "compile_options": dict(r.compile_options if compile_options is None else compile_options),
            "env": {str(k): str(v) for k, v in r.env.items()}, "imports": list(dict.fromkeys(spec.imports)),
            "plugin_modules": plugin_modules(spec), "device": r.device,
            "simdev": dict(r.simdev_options) if r.simdev_options is not None else None}


# --------------------------------------------------------------------------------------------- the model in a repro

def model_source(spec: Any, seed: int, loaded: Any, folder: Path) -> dict[str, Any] | None:
    """How a repro script rebuilds the model `spec` (loaded as `loaded`), for `_repro_layer_common.build_model`: its
    factory, or its transformers class from `config.json` (written into `folder`); None when neither can (a `path:`
    or plugin model whose class transformers does not export). A submodule's weights come from
    `weights.safetensors` (`codec.save_tensors(tree.module_tensors(…), copy=True)`), so no weights are downloaded or
    unpickled."""
    import transformers  # deferred: only a repro of a transformers model needs it

    if spec.factory:
        return {"kind": "factory", "factory": spec.factory, "seed": seed, "overrides": dict(spec.overrides),
                "dtype": spec.dtype}
    cls = type(loaded.module)
    if getattr(transformers, cls.__name__, None) is cls and loaded.config is not None:
        cfg = loaded.config
        atomic_write_text(folder / "config.json", cfg.to_json_string(use_diff=False))
        return {"kind": "transformers", "model_class": cls.__name__, "config_class": type(cfg).__name__,
                "attn_implementation": getattr(cfg, "_attn_implementation", None)}
    return None

