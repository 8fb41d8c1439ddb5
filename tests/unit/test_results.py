"""The result model: round trips, schema validation, strict JSON for non-finite numbers, stable fingerprints."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ci_runner.errors import InputError
from ci_runner.results.model import (
    CellError, CellResult, Finding, ModeResult, Repro, Results, fingerprint, load_cell_result, load_results,
    number, save_cell_result, save_results, validate,
)


def make_cell() -> CellResult:
    f = Finding(kind="divergence", stage="compare", message="rel 0.3 > 0.01", fingerprint=fingerprint("divergence", "b", "m", "x.norm"),
                module="x.norm", module_class="RMSNorm", metrics={"rel": 0.3, "cos": float("nan"), "max_abs": float("inf")},
                threshold={"rel": 0.01}, repro=Repro(path="numerics/x.py", verified=True))
    return CellResult(id="m@b", model="m", backend="b", status="fail", duration_s=1.5, env={"torch": "2.13"},
                      modes={"numerics": ModeResult(status="fail", findings=[f], data={"layers": [{"rel": float("-inf")}]}),
                             "ops": ModeResult(status="skipped", reason="not asked")},
                      error=CellError(type="crashed", message="boom", signal="SIGSEGV"))


def test_round_trip_and_strict_json(tmp_path: Path) -> None:
    cell = make_cell()
    path = save_cell_result(cell, tmp_path / "c" / "result.json")
    text = path.read_text(encoding="utf-8")
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    back = load_cell_result(path)
    f = back.modes["numerics"].findings[0]
    assert math.isnan(number(f.metrics["cos"])) and number(f.metrics["max_abs"]) == math.inf
    assert f.repro == Repro(path="numerics/x.py", verified=True)
    assert back.error.signal == "SIGSEGV"
    assert back.to_dict() == cell.to_dict()


def test_results_file_validates_and_counts(tmp_path: Path) -> None:
    r = Results(cells=[make_cell()], tool_version="0.1")
    path = save_results(r, tmp_path / "results.json")
    back = load_results(path)
    assert back.counts()["fail"] == 1 and back.counts()["findings"] == 1
    validate(json.loads(path.read_text()), "results.schema.json", source="x")


def test_fold_status_takes_the_worst_mode() -> None:
    c = make_cell()
    assert c.fold_status() == "fail"
    c.modes["layers"] = ModeResult(status="crashed")
    assert c.fold_status() == "crashed"
    assert CellResult(id="a@b", model="a", backend="b", status="x").fold_status() == "skipped"


def test_fingerprint_is_stable_and_separates_fields() -> None:
    assert fingerprint("unsupported_op", "sim", "aten.exp.default") == fingerprint("unsupported_op", "sim", "aten.exp.default")
    assert fingerprint("a", "bc") != fingerprint("ab", "c")
    assert len(fingerprint("k", "b")) == 20


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("", "not valid JSON"),
        ('{"schema_version": 1, "cells": [', "not valid JSON"),
        ('{"schema_version": 2, "cells": []}', "schema_version 2"),
        ('{"schema_version": 1, "cells": [{"id": "nope"}]}', "cells/0"),
    ],
)
def test_corrupt_results_are_input_errors(tmp_path: Path, content: str, needle: str) -> None:
    p = tmp_path / "results.json"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(InputError) as info:
        load_results(p)
    assert str(p) in str(info.value) and needle in str(info.value)
    assert info.value.exit_code == 3


def test_missing_results_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not found"):
        load_results(tmp_path / "nope.json")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["cells"][0].update(status="exploded"),
        lambda d: d["cells"][0]["modes"]["numerics"]["findings"][0].update(kind="weird"),
        lambda d: d["cells"][0]["modes"]["numerics"]["findings"][0].update(fingerprint="XYZ"),
        lambda d: d["cells"][0]["modes"]["numerics"]["findings"][0].update(metrics=[1.0]),
        lambda d: d["cells"][0]["modes"].update(extra={"status": "pass", "findings": []}),
        lambda d: d["cells"][0].update(surprise=1),
        lambda d: d["cells"][0].update(id="no-at-sign"),
        lambda d: d["cells"][0]["error"].update(exit_code="7"),
    ],
)
def test_the_fast_validator_rejects_what_the_schema_rejects(mutate) -> None:
    import jsonschema

    from ci_runner.results.model import _fast_validator, schema

    d = Results(cells=[make_cell()]).to_dict()
    validate(d, "results.schema.json", source="ok")
    mutate(d)
    assert not jsonschema.Draft202012Validator(schema("results.schema.json")).is_valid(d)
    with pytest.raises(Exception):
        _fast_validator("results.schema.json")(d)
    with pytest.raises(InputError):
        validate(d, "results.schema.json", source="bad")
