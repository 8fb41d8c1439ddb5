"""A bad matrix through the command line (`deepview-ci expand` in a child process): exit code 2 and one message
naming the file, the place and the fix, never a traceback (the loader's checks themselves, in this process:
`tests/unit/test_config.py`, `tests/unit/test_options.py`)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.fixtures.cli import run_cli

pytestmark = [pytest.mark.subprocess, pytest.mark.oldtorch]  # the old-torch subset (tests/fixtures/oldtorch.py)


def _expand_error(tmp_path: Path, text: str) -> str:
    path = tmp_path / "matrix.yaml"
    path.write_text(textwrap.dedent(text))
    proc = run_cli("expand", str(path), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr


def test_a_misspelt_required_key_is_named_with_its_suggestion(tmp_path: Path) -> None:
    err = _expand_error(tmp_path, """\
        version: 1
        models:
          - id: tiny
            hub: sshleifer/tiny-gpt2
        backendz:
          - id: inductor
        """)
    assert "matrix.yaml:5:1: backendz: unknown key 'backendz'" in err
    assert "did you mean 'backends'?" in err
    assert "required property" not in err  # the unknown key explains it; no second, misleading error


def test_every_schema_error_is_listed_at_once_unknown_required_key_first(tmp_path: Path) -> None:
    err = _expand_error(tmp_path, """\
        version: 1
        models:
          - id: tiny
            hub: sshleifer/tiny-gpt2
            timout: 3
          - id: other
            hub: x/y
            dtype: float99
        backendz:
          - id: inductor
        """)
    lines = [ln.strip() for ln in err.splitlines() if "matrix.yaml:" in ln and ": " in ln.strip()[1:]]
    assert "3 problems in the matrix" in err
    placed = [ln for ln in lines if ln.split(": ")[0].count(":") == 2]
    assert len(placed) == 3, err
    assert placed[0].endswith("backendz: unknown key 'backendz'")
    assert ":5:5: models[0].timout: unknown key 'timout'" in placed[1] and "did you mean 'timeout'" in err
    assert ":8:" in placed[2] and "models[1].dtype" in placed[2]


def test_expand_exits_2_naming_file_line_and_the_fix(tmp_path: Path) -> None:
    matrix = tmp_path / "m.yaml"
    matrix.write_text("version: 1\ndefaults:\n  options: {numerics: {margn: 8}}\nmodels: [{id: a, config: llama}]\n"
                      "backends: [{id: b, compile: inductor}]\n", encoding="utf-8")  # the place: line 3, column 24
    proc = run_cli("expand", str(matrix), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"{matrix}:3:24:" in proc.stderr and "did you mean 'margin'" in proc.stderr
    assert "Traceback" not in proc.stderr
