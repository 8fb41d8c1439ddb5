"""Issues 44/45: a repro verifies a finding only when it ran and fails the same way (the same error type and the
same cause line, past a backend's boilerplate line); a hang repro must stay stuck past the limit. Plain scripts,
no torch: each check is one short child process."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ci_runner.engine.repro import START_MARKER, expected_cause, key_text, verify_script, write_script

TEMPLATES = Path(__file__).resolve().parents[2] / "ci_runner" / "templates"
# IREE's every compile error: the boilerplate line first, the cause on a later line
FOUND = "JIT compilation failed. See diagnostics.\nerror: failed to legalize operation 'torch.aten.histc'"


def _script(tmp_path: Path, body: str, name: str = "repro.py") -> Path:
    text = f"print({START_MARKER!r}, flush=True)\n" + textwrap.dedent(body)
    return write_script(tmp_path / name, text)


def _verify(script: Path, message: str = FOUND, **kw: object) -> object:
    return verify_script(script, expect_text=key_text(message), expect_error_type="RuntimeError",
                         expect_message=message, timeout=60, **kw)  # type: ignore[arg-type]


def test_the_key_is_the_cause_line_past_boilerplate() -> None:
    assert key_text(FOUND) == ["error: failed to legalize operation 'torch.aten.histc'"]
    assert expected_cause("RuntimeError: " + FOUND, "RuntimeError") == \
        "error: failed to legalize operation 'torch.aten.histc'"


def test_the_same_failure_verifies(tmp_path: Path) -> None:
    s = _script(tmp_path, f"raise RuntimeError({FOUND!r})\n")
    v = _verify(s)
    assert v.verified, v  # type: ignore[attr-defined]


def test_a_repro_that_passes_is_unverified_and_says_so(tmp_path: Path) -> None:
    s = _script(tmp_path, "print('REPRO PASSED')\n")
    v = _verify(s)
    assert not v.verified and v.exit_code == 0 and "passed" in v.note  # type: ignore[attr-defined]


def test_a_repro_that_fails_differently_is_unverified(tmp_path: Path) -> None:
    s = _script(tmp_path, "raise ValueError('cannot load module.pt2: no such file')\n")
    v = _verify(s)
    assert not v.verified and "failed differently" in v.note and "cannot load" in v.note  # type: ignore[attr-defined]


def test_a_repro_sharing_only_the_boilerplate_line_is_unverified(tmp_path: Path) -> None:
    other = "JIT compilation failed. See diagnostics.\nerror: 'torch.aten.topk' op result type mismatch"
    s = _script(tmp_path, f"raise RuntimeError({other!r})\n")
    v = _verify(s)  # same error type, same first line: another cause
    assert not v.verified and "histc" in v.note, v  # type: ignore[attr-defined]
    # and an expectation that is only the boilerplate line is no evidence either
    v2 = verify_script(s, expect_text=["JIT compilation failed. See diagnostics."], expect_error_type="RuntimeError",
                       timeout=60)
    assert not v2.verified and "boilerplate" in v2.note


def test_a_script_that_does_not_compile_is_unverified(tmp_path: Path) -> None:
    # the SyntaxError echoes the offending line, which carries the expected text: it must not verify
    bad = f"# Found: RuntimeError: {FOUND.splitlines()[1]}\nx = = 1  # RuntimeError: {FOUND.splitlines()[1]}\n"
    s = _script(tmp_path, bad)
    v = _verify(s)
    assert not v.verified and "does not compile" in v.note, v  # type: ignore[attr-defined]


def test_a_script_that_never_reached_its_start_marker_is_unverified(tmp_path: Path) -> None:
    # the marker statement is there but never runs (an import at the top fails first)
    text = (f"import no_such_module_deepview  # RuntimeError: {FOUND.splitlines()[1]}\n"
            f"print({START_MARKER!r}, flush=True)\nraise RuntimeError({FOUND!r})\n")
    s = write_script(tmp_path / "repro.py", text)
    v = _verify(s)
    assert not v.verified and "before its first line" in v.note, v  # type: ignore[attr-defined]


def test_a_hang_repro_must_stay_stuck_past_the_limit(tmp_path: Path) -> None:
    stuck = _script(tmp_path, "import time\ntime.sleep(60)\n", "stuck.py")
    v = verify_script(stuck, expect_text=[], timeout=3, expect_hang=True)
    assert v.verified and "hang reproduced" in v.note
    quick = _script(tmp_path, "raise OSError('cannot load the saved model')\n", "quick.py")
    v2 = verify_script(quick, expect_text=[], timeout=30, expect_hang=True)
    assert not v2.verified and "instead of a hang" in v2.note and "cannot load" in v2.note
    # a crash finding (death by signal) is not reproduced by a hang, nor by an ordinary error
    v3 = verify_script(stuck, expect_text=[], timeout=3, expect_signal=True, expect_hang=False)
    assert not v3.verified and "hung instead" in v3.note


@pytest.mark.parametrize("name", sorted(p.name for p in TEMPLATES.glob("repro_*.py.j2")))
def test_every_repro_template_prints_the_start_marker(name: str) -> None:
    text = (TEMPLATES / name).read_text()
    if "common.setup()" in text:  # the layer repros: the shared setup macro prints it first
        text = (TEMPLATES / "_repro_layer_common.py.j2").read_text()
    assert f'print("{START_MARKER}", flush=True)' in text


def test_the_error_type_counts_as_a_word_qualified_or_not(tmp_path: Path) -> None:
    (tmp_path / "vendor_exc.py").write_text("class BackendCompilerFailed(Exception):\n    pass\n")
    s = _script(tmp_path, f"import vendor_exc\nraise vendor_exc.BackendCompilerFailed({FOUND!r})\n")
    v = verify_script(s, expect_text=key_text(FOUND), expect_error_type="BackendCompilerFailed", expect_message=FOUND,
                      timeout=60)
    assert v.verified, v  # printed as vendor_exc.BackendCompilerFailed
    other = _script(tmp_path, f"class MyRuntimeError(Exception):\n    pass\nraise MyRuntimeError({FOUND!r})\n", "o.py")
    v2 = _verify(other)
    assert not v2.verified and "RuntimeError" in v2.note  # type: ignore[attr-defined]
