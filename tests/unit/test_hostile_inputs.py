"""A corpus of hostile and broken input (issue 46): matrices, results, baselines, diffs, cell results, plans, dumps,
history records and stores, compiler messages, module and op names.

Each case asserts what a user gets: the documented exit code (2 for a matrix, 3 for any other input file; README's
table), one message naming the file with a hint and no traceback, nothing written outside `--out`, and nothing
that runs or stalls. Library loaders are called directly where they decide it; the CLI runs in-process
(`ci_runner.cli.main`) for the commands' own wrapping. The whole file runs in a few seconds.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from ci_runner import cli, errors
from ci_runner.config import load_matrix, load_matrix_text
from ci_runner.errors import ConfigError, InputError
from ci_runner.fsutil import atomic_write_json, atomic_write_text, utf8_text
from ci_runner.jsontext import parse_json
from ci_runner.quoting import comment, pyrepr
from ci_runner.results.model import (CellResult, Finding, ModeResult, Results, clean, dumps_results, fingerprint,
                                     load_cell_result, load_results, save_results)
from ci_runner.github.issues import load_diff
from ci_runner.history.records import read_record
from ci_runner.modes.numerics.dumps import load_dump
from ci_runner.modes.numerics.thresholds import load_table
from ci_runner.plan import load_plan
from ci_runner.results.baseline import load_baseline
from ci_runner.results.rootcause import error_signature, normalize_text
from tests.fixtures.results_factory import sample_results

# --------------------------------------------------------------------------------------------- matrices

_LOL = "version: 1\na: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8))
_VALID = ("version: 1\nmodels:\n  - {id: m, config: llama}\nbackends:\n  - {id: b, compile: inductor}\n")


def _with(defaults: str) -> str:
    return _VALID + "defaults:\n" + defaults


MATRICES: dict[str, str] = {
    "billion-laughs": _LOL,
    "laughs-in-overrides": ("version: 1\nmodels:\n  - id: m\n    config: llama\n    overrides:\n      k: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n"
                            + "".join(f"      k{i}: &a{i} [{', '.join(['*a' if i == 0 else f'*a{i - 1}'] * 10)}]\n"
                                      for i in range(7)) + "backends:\n  - {id: b, compile: inductor}\n"),
    "recursive-alias-list": "version: 1\nx: &a [*a]\n",
    "recursive-alias-map": "version: 1\nx: &a {k: *a}\n",
    "deep-flow-list": "version: 1\nmodels: " + "[" * 100_000 + "]" * 100_000,
    "deep-flow-map": "version: 1\nmodels: " + "{a: " * 100_000 + "1" + "}" * 100_000,
    "deep-block-list": "version: 1\nx:\n" + "".join(" " * i + "- \n" for i in range(1, 2000)),
    "deep-block-map": "".join(" " * i + "a:\n" for i in range(2000)),
    "unclosed-flow": "version: 1\nmodels: [" + "[" * 300,
    "timeout-nan": _with("  timeout: .nan\n"), "timeout-inf": _with("  timeout: .inf\n"),
    "timeout-minus-inf": _with("  timeout: -.inf\n"), "timeout-NaN": _with("  timeout: .NaN\n"),
    "timeout-string": _with("  timeout: soon\n"), "timeout-huge-int": _with("  timeout: " + "9" * 5000 + "\n"),
    "timeout-1e999": _with("  timeout: 1e999\n"), "timeout-zero": _with("  timeout: 0\n"),
    "seed-nan": _with("  inputs: {seed: .nan}\n"), "batch-inf": _with("  inputs: {batch: .inf}\n"),
    "override-nan": _VALID.replace("config: llama}", "config: llama, overrides: {hidden_size: .nan}}"),
    "empty": "", "comments-only": "# nothing\n", "null": "null\n", "list-top": "- 1\n- 2\n", "scalar-top": "42\n",
    "string-top": "'version: 1'\n", "nul-byte": "version: 1\x00\n", "tab-indent": "version: 1\nmodels:\n\t- {id: m}\n",
    "bom": "\ufeff" + _VALID, "binary-tag": "version: 1\nx: !!binary aGVsbG8=\n",
    "python-tag": "version: 1\nx: !!python/object/apply:os.system ['touch PWNED']\n",
    "python-name": "version: 1\nx: !!python/name:os.system\n", "unknown-tag": "version: 1\nx: !vendor {a: 1}\n",
    "date": "version: 1\nx: 2024-13-45\n", "timestamp-range": "version: 1\nx: 99999-01-01\n",
    "duplicate-key": "version: 1\nversion: 1\n", "merge-key": "a: &a {x: 1}\nb: {<<: *a}\n",
    "int-key": "version: 1\n1: 2\n", "null-key": "version: 1\n~: 2\n", "complex-key": "version: 1\n? [a, b]\n: 1\n",
    "surrogate-id": _VALID.replace("id: m,", 'id: "\\ud800",'),
    "newline-id": _VALID.replace("id: m,", 'id: "m\\nx",'), "quote-id": _VALID.replace("id: m,", "id: 'm\"x',"),
    "traversal-id": _VALID.replace("id: m,", "id: ../../etc,"), "slash-id": _VALID.replace("id: b,", "id: a/b,"),
    "injection-id": _VALID.replace("id: m,", "id: 'x\",getattr(__import__(\"os\"),\"system\")(\"touch PWNED\"),\"',"),
    "long-id": _VALID.replace("id: m,", f"id: {'m' * 100_000},"),
    "long-line": "version: 1\nx: '" + "y" * 500_000 + "'\n", "many-keys": "version: 1\n" + "".join(
        f"k{i}: {i}\n" for i in range(3_000)), "too-large": "version: 1\nx: '" + "y" * 5_000_000 + "'\n",
    "unknown-top-key": _VALID + "modles: []\n", "version-2": _VALID.replace("version: 1", "version: 2"),
    "version-string": _VALID.replace("version: 1", "version: '1'"), "models-map": "version: 1\nmodels: {a: 1}\nbackends: []\n",
    "backends-null": "version: 1\nmodels: []\nbackends:\n", "env-nan": _VALID.replace(
        "compile: inductor}", "compile: inductor, env: {A: .nan}}"),
    "compile-options-key": _VALID.replace("compile: inductor}", "compile: inductor, compile_options: {'a)': 1}}"),
    "import-injection": _VALID.replace("compile: inductor}", "compile: inductor, import: ['os;os.system(1)']}"),
    "factory-injection": _VALID.replace("config: llama}", "factory: 'os:system(1)'}").replace(
        "{id: m, ", "{id: m, "),
    "document-stream": _VALID + "---\n" + _VALID, "anchor-only": "version: 1\nx: &a\n",
    "undefined-alias": "version: 1\nx: *nope\n", "bad-indent": "version: 1\n models:\n- a\n",
    "control-chars": "version: 1\nx: \x07\x08\n", "u2028": "version: 1\nx: a\u2028b\n", "cr-only": "version: 1\rx: 1\r",
    "utf16-text": "version: 1\n".encode("utf-16").decode("latin-1"),
}


def _matrix_outcome(text: str) -> str:
    try:
        load_matrix_text(text)
    except ConfigError as exc:
        return f"refused:{exc.exit_code}"
    return "ok"


@pytest.mark.parametrize("name", sorted(MATRICES))
def test_hostile_matrix_is_refused_fast_with_exit_2(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    t0 = time.perf_counter()
    outcome = _matrix_outcome(MATRICES[name])  # anything but a ConfigError fails the test with its traceback
    assert time.perf_counter() - t0 < (5.0 if name in ("long-line", "many-keys") else 2.0)  # plain but big: read
    assert outcome == ("ok" if name in _ACCEPTED else "refused:2"), outcome
    assert not list(tmp_path.iterdir())  # nothing written, nothing run (no PWNED)


_ACCEPTED = {"bom"}  # a byte-order mark: valid YAML, a valid matrix


@pytest.mark.parametrize("data", [b"\xff\xfe\x00v", "version: 1\n".encode("utf-16"), b"version: 1\n\x80\x81",
                                  b"\xc3\x28"], ids=["utf16-bom", "utf16", "latin1", "truncated-utf8"])
def test_matrix_file_not_utf8_is_one_line(data: bytes, tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_bytes(data)
    with pytest.raises(ConfigError) as exc:
        load_matrix(path)
    assert exc.value.exit_code == errors.EXIT_USAGE and str(path) in str(exc.value)


# --------------------------------------------------------------------------------------------- JSON input files

def _json_cases() -> dict[str, bytes]:
    good = json.dumps(sample_results().to_dict()).encode()
    cases: dict[str, bytes] = {
        "empty": b"", "space": b"  \n", "nul": b"\x00" * 16, "not-utf8": b'{"a": "\xff\xfe"}',
        "utf16": '{"schema_version": 1}'.encode("utf-16"), "bom": b"\xef\xbb\xbf{}", "truncated-1": good[: len(good) // 2],
        "truncated-2": good[:-2], "truncated-3": good[:1], "deep-list": b"[" * 100_000 + b"]" * 100_000,
        "deep-dict": b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "NaN": b"NaN", "nan-field": b'{"schema_version": NaN}',
        "infinity": b'{"cells": [Infinity]}', "minus-infinity": b"-Infinity", "1e999": b'{"schema_version": 1e999}',
        "huge-int": b'{"schema_version": ' + b"9" * 5000 + b"}", "null": b"null", "list": b"[]", "number": b"42",
        "string": b'"results"', "object": b"{}", "cells-object": b'{"schema_version": 1, "cells": {}}',
        "cells-null-item": b'{"schema_version": 1, "cells": [null]}', "cells-int": b'{"schema_version": 1, "cells": [1]}',
        "version-99": b'{"schema_version": 99, "cells": []}', "version-string": b'{"schema_version": "1", "cells": []}',
        "lone-surrogate": good.replace(b'"message": "', b'"message": "\\udfff\\ud800'),
        "duplicate-keys": b'{"schema_version": 1, "schema_version": 2}', "trailing-garbage": good + b"\nxyz",
        "binary": bytes(range(256)), "gzip": gzip.compress(good),
    }
    return cases


JSON_CASES = _json_cases()


def _dump_dir(folder: Path, manifest: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_bytes(manifest)
    return folder


LOADERS: dict[str, Callable[[Path], Any]] = {
    "results": load_results, "cell": load_cell_result, "baseline": load_baseline, "diff": load_diff,
    "plan": load_plan, "thresholds": load_table,
    "dump": lambda p: load_dump(_dump_dir(p.parent / "dump", p.read_bytes())),
    "history-record": lambda p: read_record(_gz(p)),
}


def _gz(p: Path) -> Path:
    out = p.with_suffix(".json.gz")
    out.write_bytes(gzip.compress(p.read_bytes()))
    return out


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("case", sorted(JSON_CASES))
def test_broken_input_file_is_one_input_error(loader: str, case: str, tmp_path: Path) -> None:
    path = tmp_path / "input.json"
    path.write_bytes(JSON_CASES[case])
    t0 = time.perf_counter()
    try:
        LOADERS[loader](path)
    except InputError as exc:
        assert exc.exit_code == errors.EXIT_INPUT
        assert str(tmp_path) in exc.message, exc.message  # names the file
        assert "\n" not in exc.message and len(exc.message) < 2000
    # a loader may accept a case it can read (an empty object as a plan is refused, a results file with a
    # lone surrogate is read with U+FFFD): anything but an InputError fails with its traceback
    assert time.perf_counter() - t0 < 2.0


def test_lone_surrogates_are_read_back_replaced(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_bytes(JSON_CASES["lone-surrogate"])
    results = load_results(path)
    messages = [f.message for c in results.cells for f in c.findings]
    assert any("\ufffd\ufffd" in m for m in messages)
    save_results(results, tmp_path / "again.json")  # writes
    json.loads((tmp_path / "again.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e999", "-1e400"])
def test_non_finite_numbers_are_refused(text: str) -> None:
    with pytest.raises(InputError, match="not a JSON number|out of range"):
        parse_json(f'{{"x": [{text}]}}', source="f.json", what="results file")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_never_written(value: float, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        atomic_write_json(tmp_path / "x.json", {"x": value})
    assert not (tmp_path / "x.json").exists()
    assert json.loads(json.dumps(clean({"x": value}), allow_nan=False))  # the result model keeps them as strings


# --------------------------------------------------------------------------------------------- compiler messages

MESSAGES = {
    "surrogates": "bad bytes \udcff\udcfe \ud800 end", "nul": "a\x00b", "controls": "".join(map(chr, range(32))),
    "u2028": "a\u2028b\u2029c\x85d", "bidi": "x\u202ey", "long-token": "RuntimeError: " + "H" * 300_000,
    "long-lines": "\n" * 200_000, "mlir-types": "}> : (" * 40_000, "emoji": "🙂" * 1000, "bom": "\ufeffx",
    "injection": 'x",getattr(__import__("os"),"system")("touch PWNED"),"', "braces": "{{ 7*7 }} {x} %s",
    "empty": "", "backslashes": "\\" * 1001, "quotes": "'''\"\"\"",
}


def _finding(message: str, module: str = "model.layers.0", op: str = "aten.add.Tensor") -> Finding:
    return Finding(kind="op_error", stage="compile", op=op, module=module, message=message, error_type="RuntimeError",
                   fingerprint=fingerprint("op_error", "b", op))


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_compiler_message_is_kept_and_written(name: str, tmp_path: Path) -> None:
    """Any text a compiler prints: signatures in linear time, written with replacement, read back as valid JSON."""
    text = MESSAGES[name]
    t0 = time.perf_counter()
    normalize_text(text)
    error_signature("RuntimeError", text, text)
    assert time.perf_counter() - t0 < 3.0
    f = _finding(text, module=text[:200] or "m", op=text[:200] or "aten.add.Tensor")
    cell = CellResult(id="m@b", model="m", backend="b", status="fail",
                      modes={"ops": ModeResult(status="fail", findings=[f, _finding("plain failure")])})
    out = tmp_path / "out"
    save_results(Results(cells=[cell]), out / "results.json")
    back = load_results(out / "results.json")
    assert [g.message for g in back.cells[0].findings][1] == "plain failure"
    assert len(back.cells[0].findings) == 2
    atomic_write_text(out / "m.txt", text)
    comment(text).encode("utf-8")
    compile(f"x = {pyrepr(text)}  # {comment(text)}\n", "t", "exec")


@pytest.mark.parametrize("writer", ["append_record", "atomic_write_json", "atomic_write_text", "step_summary"])
def test_writes_of_undecodable_text_never_raise(writer: str, tmp_path: Path) -> None:
    """The writes that wiped a cell: a probe outcome line, probes.json (issue 46), and the other text writers."""
    from ci_runner.fsutil import append_record
    from ci_runner.log import append_step_summary

    bad = "lowering failed: \udcff\udcfe \ud800"
    path = tmp_path / "f"
    if writer == "append_record":
        append_record(path, {"message": bad})
    elif writer == "atomic_write_json":
        atomic_write_json(path, {"message": bad})
    elif writer == "atomic_write_text":
        atomic_write_text(path, bad)
    else:
        append_step_summary(bad, env={"GITHUB_STEP_SUMMARY": str(path)})
    text = path.read_text(encoding="utf-8")
    assert "lowering failed" in text and "\ud800" not in text


def test_utf8_text_only_touches_surrogates() -> None:
    assert utf8_text("plain é 🙂") == "plain é 🙂"
    assert utf8_text("a\ud800b") == "a\ufffdb"


# --------------------------------------------------------------------------------------------- the CLI

def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


@pytest.fixture()
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    for var in ("GITHUB_OUTPUT", "GITHUB_STEP_SUMMARY", "GITHUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    yield tmp_path


def _one_line_error(code: int, err: str, want: int, path: Path | None = None) -> None:
    assert code == want, err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert 1 <= len(lines) <= 12, err
    if path is not None:
        assert str(path) in err or path.name in err, err


@pytest.mark.parametrize("case", ["not-utf8", "deep-list", "nan-field", "1e999", "truncated-1", "empty", "binary",
                                  "lone-surrogate", "huge-int", "cells-null-item"])
@pytest.mark.parametrize("command", ["diff", "baseline-update", "history-add"])
def test_cli_on_a_broken_results_file(command: str, case: str, workdir: Path) -> None:
    results = workdir / "results.json"
    results.write_bytes(JSON_CASES[case])
    good = workdir / "good.json"
    save_results(sample_results(), good)
    base = workdir / "baseline.json"
    assert _cli("baseline", "update", str(good), "--out", str(base))[0] == 0
    before = _files(workdir)
    out = workdir / "out"
    args = {"diff": ["diff", str(results), "--baseline", str(base), "--out", str(out)],
            "baseline-update": ["baseline", "update", str(results), "--out", str(out / "b.json")],
            "history-add": ["history", "add", str(results), "--store", str(out / "hist"), "--run-id", "r1",
                            "--date", "2031-01-01"]}[command]
    code, _, err = _cli(*args)
    if case == "lone-surrogate":  # readable: U+FFFD for the bad text
        assert code in (0, 1), err
    else:
        _one_line_error(code, err, errors.EXIT_INPUT, results)
    assert {p for p in _files(workdir) - before if out not in p.parents and p != out} == set()


@pytest.mark.parametrize("case", ["not-utf8", "deep-list", "NaN", "truncated-2", "object", "version-99"])
def test_cli_diff_on_a_broken_baseline(case: str, workdir: Path) -> None:
    results = workdir / "results.json"
    save_results(sample_results(), results)
    base = workdir / "baseline.json"
    base.write_bytes(JSON_CASES[case])
    code, _, err = _cli("diff", str(results), "--baseline", str(base), "--out", str(workdir / "out"))
    _one_line_error(code, err, errors.EXIT_INPUT, base)


@pytest.mark.parametrize("name", ["billion-laughs", "deep-flow-list", "timeout-nan", "timeout-inf", "python-tag",
                                  "recursive-alias-map", "duplicate-key", "nul-byte"])
@pytest.mark.parametrize("command", ["expand", "cells"])
def test_cli_on_a_hostile_matrix(command: str, name: str, workdir: Path) -> None:
    matrix = workdir / "m.yaml"
    matrix.write_text(MATRICES[name], encoding="utf-8", errors="surrogatepass")
    before = _files(workdir)
    t0 = time.perf_counter()
    code, _, err = _cli(command, str(matrix))
    assert time.perf_counter() - t0 < 5.0
    _one_line_error(code, err, errors.EXIT_USAGE, matrix)
    assert _files(workdir) == before and not (workdir / "PWNED").exists()


@pytest.mark.parametrize("case", ["not-utf8", "deep-dict", "nan-field", "truncated-1", "cells-int"])
def test_cli_aggregate_of_a_broken_cell_result(case: str, workdir: Path) -> None:
    cell_dir = workdir / "cells" / "m@b"
    cell_dir.mkdir(parents=True)
    (cell_dir / "result.json").write_bytes(JSON_CASES[case])
    code, _, err = _cli("aggregate", str(workdir / "cells"), "--out", str(workdir / "report"))
    assert "Traceback" not in err, err
    assert code in (errors.EXIT_INPUT, 0, 1), err  # refused, or reported as an error cell


def _history_with_run(workdir: Path) -> Path:
    good = workdir / "good.json"
    save_results(sample_results(), good)
    store = workdir / "hist"
    assert _cli("history", "add", str(good), "--store", str(store), "--run-id", "r1", "--date", "2031-01-01")[0] == 0
    return store


def test_cli_history_add_of_a_duplicated_cell_is_one_line(workdir: Path) -> None:
    results = sample_results()
    results.cells.append(results.cells[0])
    path = workdir / "dup.json"
    save_results(results, path)
    store = workdir / "hist"
    code, _, err = _cli("history", "add", str(path), "--store", str(store), "--run-id", "r1", "--date", "2031-01-01")
    _one_line_error(code, err, errors.EXIT_INPUT, path)
    code, _, err = _cli("history", "show", "--store", str(store))  # the store is not wedged
    assert code == 0, err


def test_cli_history_add_twice_is_idempotent(workdir: Path) -> None:
    store = _history_with_run(workdir)
    code, out, err = _cli("history", "add", str(workdir / "good.json"), "--store", str(store), "--run-id", "r1",
                          "--date", "2031-01-01")
    assert code == 0 and "already holds" in out, err


@pytest.mark.parametrize("damage", ["zero-bytes", "garbage", "truncated", "not-sqlite-text", "wrong-tables"])
def test_cli_history_show_of_a_damaged_store(damage: str, workdir: Path) -> None:
    store = _history_with_run(workdir)
    db = next(p for p in store.rglob("*") if p.is_file() and p.suffix in (".db", ".sqlite", ".sqlite3"))
    data = db.read_bytes()
    if damage == "wrong-tables":
        db.unlink()
        sqlite3.connect(db).execute("CREATE TABLE x (a)").connection.commit()
    else:
        db.write_bytes({"zero-bytes": b"", "garbage": os.urandom(4096), "truncated": data[: len(data) // 3],
                        "not-sqlite-text": b"hello\n" * 100}[damage])
    code, _, err = _cli("history", "show", "--store", str(store))
    assert "Traceback" not in err, err
    assert code in (0, errors.EXIT_INPUT), err


@pytest.mark.parametrize("case", ["not-utf8", "deep-list", "NaN", "truncated-1", "object", "binary"])
def test_cli_compare_of_a_broken_dump(case: str, workdir: Path) -> None:
    ref = _dump_dir(workdir / "ref", JSON_CASES[case])
    target = _dump_dir(workdir / "target", JSON_CASES[case])
    code, _, err = _cli("compare", str(ref), str(target))
    _one_line_error(code, err, errors.EXIT_INPUT)


@pytest.mark.parametrize("case", ["not-utf8", "deep-list", "NaN", "truncated-1", "object"])
def test_cli_file_issues_of_a_broken_diff(case: str, workdir: Path) -> None:
    diff = workdir / "diff.json"
    diff.write_bytes(JSON_CASES[case])
    code, _, err = _cli("file-issues", str(diff), "--repo", "o/n", "--dry-run", str(workdir / "drafts"))
    _one_line_error(code, err, errors.EXIT_INPUT, diff)


def test_results_json_stays_strict_json_whatever_the_messages() -> None:
    cells = [CellResult(id="m@b", model="m", backend="b", status="fail",
                        modes={"ops": ModeResult(status="fail", findings=[_finding(m) for m in MESSAGES.values()])})]
    text = dumps_results(Results(cells=cells).to_dict())
    text.encode("utf-8")
    parse_json(text, source="r", what="results file")


def test_corpus_size() -> None:
    """At least 200 hostile cases across the kinds of input (issue 46's bar), the CLI cases not counted."""
    assert len(MATRICES) + len(JSON_CASES) * len(LOADERS) + len(MESSAGES) >= 200
