"""results.json, diff.json and junit.xml are written piece by piece, and results.json is read a line at a time: the
same bytes and the same `Results` as the whole-file paths, and a broken file still one `InputError` (exit 3)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ci_runner.errors import InputError
from ci_runner.fsutil import OutputError, atomic_write_chunks, utf8_text
from ci_runner.report.junit import build_junit, junit_chunks, xml_safe
from ci_runner.report.view import build_view
from ci_runner.results import baseline as bl
from ci_runner.results.model import (Results, _load_by_line, dumps_results, load_results, read_json, results_chunks,
                                     save_results, validate)
from ci_runner.run.aggregate import layer_patterns
from tests.fixtures import results_factory as rf


def _shapes() -> list[Results]:
    out = [rf.sample_results(), rf.nasty_results(), rf.empty_results(), rf.example_results(), rf.big_results(12, 9)]
    for r in out:
        r.patterns = layer_patterns(r)
    return out


def _whole(path: Path) -> Results:
    data = read_json(path, what="results file")
    validate(data, "results.schema.json", source=str(path))
    return Results.from_dict(data)


@pytest.mark.parametrize("index", range(5))
def test_results_written_in_pieces_are_the_same_bytes_and_read_back_the_same(index: int, tmp_path: Path) -> None:
    r = _shapes()[index]
    path = save_results(r, tmp_path / "results.json")
    assert path.read_text(encoding="utf-8") == utf8_text(dumps_results(r.to_dict())) == utf8_text("".join(results_chunks(r)))
    if r.cells:  # the line reader takes what this version writes (an empty run is read whole: it is small)
        assert _load_by_line(path) is not None
    assert load_results(path) == _whole(path)


def test_results_in_another_layout_are_read_whole(tmp_path: Path) -> None:
    r = rf.sample_results()
    path = tmp_path / "results.json"
    path.write_text(json.dumps(r.to_dict(), indent=2), encoding="utf-8")  # pretty-printed by another tool
    assert _load_by_line(path) is None
    assert load_results(path) == _whole(path)


def _lines(r: Results, tmp_path: Path) -> tuple[Path, list[str]]:
    path = save_results(r, tmp_path / "results.json")
    return path, path.read_text(encoding="utf-8").splitlines(keepends=True)


@pytest.mark.parametrize("damage", ["cut_cell", "no_comma", "extra_comma", "bad_cell", "tail", "nan", "twice"])
def test_results_broken_in_the_line_layout_is_one_input_error(damage: str, tmp_path: Path) -> None:
    path, lines = _lines(rf.sample_results(), tmp_path)
    cell = next(i for i, ln in enumerate(lines) if ln.startswith('{"id": '))
    if damage == "cut_cell":
        lines[cell] = lines[cell][: len(lines[cell]) // 2] + "\n"
    elif damage == "no_comma":
        lines[cell] = lines[cell].replace("},\n", "}\n")
    elif damage == "extra_comma":
        last = next(i for i in range(cell, len(lines)) if lines[i + 1].startswith("]"))
        lines[last] = lines[last].rstrip("\n") + ",\n"
    elif damage == "bad_cell":
        lines[cell] = lines[cell].replace('"status": ', '"status": 7, "x": ', 1)
    elif damage == "tail":
        lines.append("{}\n")
    elif damage == "nan":
        lines[cell] = lines[cell].replace('"duration_s": ', '"duration_s": NaN, "d": ', 1)
    elif damage == "twice":  # a second "cells" list: the whole-file read would keep only the last
        lines.insert(-1, '], "cells": [\n')
    path.write_text("".join(lines), encoding="utf-8")
    assert _load_by_line(path) is None
    with pytest.raises(InputError) as whole:
        read = read_json(path, what="results file")
        validate(read, "results.schema.json", source=str(path))
        if damage == "twice":
            raise InputError("the whole-file read takes it; the line reader left it to that read")
    if damage != "twice":
        with pytest.raises(InputError) as streamed:
            load_results(path)
        assert str(streamed.value) == str(whole.value)


def test_diff_written_in_pieces_is_the_same_bytes(tmp_path: Path) -> None:
    before, now = rf.big_results(10, 20, run="a"), rf.big_results(10, 20, run="b")
    now.cells[0].modes["ops"].findings.append(rf.unsupported_op("backend-00", "aten.new.default", run="b"))
    base_path = bl.update_baseline(save_results(before, tmp_path / "a.json"), tmp_path / "baseline.json")
    d = bl.diff(now, bl.load_baseline(base_path), results_path="r.json", baseline_path=base_path)
    d.drifting = [{"layer": "x"}]
    json_path, _ = bl.write_diff(d, tmp_path / "out", env={})
    assert json_path.read_text(encoding="utf-8") == bl.dumps_diff(d.to_dict())
    assert json.loads(json_path.read_text(encoding="utf-8"))["counts"]["regressed"] >= 1


@pytest.mark.parametrize("index", range(5))
def test_junit_written_in_pieces_is_the_whole_tree(index: int) -> None:
    r = _shapes()[index]
    view = build_view(r, out_dir=None, run_dir=None)
    tree = build_junit(view)
    ET.indent(tree, space="  ")
    whole = "<?xml version='1.0' encoding='utf-8'?>\n" + xml_safe(ET.tostring(tree.getroot(), encoding="unicode")) + "\n"
    assert "".join(junit_chunks(view)) == whole


def test_a_failed_piece_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text("old\n", encoding="utf-8")

    def chunks():
        yield "new, half"
        raise OSError(28, "No space left on device")

    with pytest.raises(OutputError):
        atomic_write_chunks(path, chunks())
    assert path.read_text(encoding="utf-8") == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temp file left
