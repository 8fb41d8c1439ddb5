"""The baseline file: stable, reviewable, validated; `baseline update` keeps flaky marks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from ci_runner.results.baseline import (
    Baseline,
    diff,
    dumps_baseline,
    load_baseline,
    make_baseline,
    update_baseline,
)
from ci_runner.errors import EXIT_INPUT, InputError
from ci_runner.results.model import Results, save_results
from tests.fixtures import results_factory as rf


def test_two_runs_on_two_machines_give_the_same_bytes() -> None:
    a, b = rf.example_results(run="a"), rf.example_results(run="b")
    assert a.cells[0].env["hostname"] != b.cells[0].env["hostname"]
    shuffled = list(b.cells)
    random.Random(1).shuffle(shuffled)
    b = Results(cells=shuffled, generated_at="2099-01-01T00:00:00Z")
    assert dumps_baseline(make_baseline(a)) == dumps_baseline(make_baseline(b))


def test_reviewable_one_entry_per_line_no_timestamps_paths_or_hosts() -> None:
    results = rf.sample_results()
    text = dumps_baseline(make_baseline(results))
    data = json.loads(text)
    lines = text.splitlines()
    n_cells, n_findings = len(data["cells"]), len(data["findings"])
    assert n_cells == 5 and n_findings == 10
    assert len(lines) == 3 + 2 + n_cells + 2 + n_findings + 1  # header, "cells": [ ], "findings": [ ], }
    for entry in data["findings"]:
        assert sum(1 for ln in lines if entry["fingerprint"] in ln and entry["cell"] in ln) == 1
    for banned in ("2031-", "runner-a", "/home/", "0x7f", "repro/", "duration"):
        assert banned not in text
    fps = [(f["cell"], f["fingerprint"]) for f in data["findings"]]
    assert fps == sorted(fps) and [c["id"] for c in data["cells"]] == sorted(c["id"] for c in data["cells"])


def test_update_then_load_round_trips(tmp_path: Path) -> None:
    res = tmp_path / "results.json"
    save_results(rf.sample_results(), res)
    out = update_baseline(res, tmp_path / "ci" / "baseline.json")
    b = load_baseline(out)
    assert isinstance(b, Baseline) and len(b.cells) == 5 and len(b.findings) == 10
    assert b.to_dict() == make_baseline(rf.sample_results())
    # updating again from the same results changes nothing
    before = out.read_bytes()
    update_baseline(res, out)
    assert out.read_bytes() == before


def test_update_keeps_flaky_marks_and_flaky_entries_that_did_not_show(tmp_path: Path) -> None:
    res = tmp_path / "results.json"
    results = rf.sample_results()
    save_results(results, res)
    out = update_baseline(res, tmp_path / "baseline.json")
    data = json.loads(out.read_text())
    gone_fp = next(f for f in data["findings"] if f["key"] == "aten.cumsum.default" and f["cell"] == "tiny-llama@sim-subset")
    gone_fp["flaky"] = True
    kept_fp = next(f for f in data["findings"] if f["cell"] == "tiny-llama@sim-drift")
    kept_fp["flaky"] = True
    stale = {"cell": "tiny-llama@sim-subset", "fingerprint": "0" * 20, "kind": "op_error", "mode": "ops", "key": "old"}
    data["findings"].append(stale)  # not flaky, not in the results: dropped
    next(c for c in data["cells"] if c["id"] == "tiny-llama@inductor")["flaky"] = True
    out.write_text(dumps_baseline(data))
    # the next run no longer shows the flaky cumsum finding
    ops = results.cell("tiny-llama@sim-subset").modes["ops"]
    ops.findings = [f for f in ops.findings if f.op != "aten.cumsum.default"]
    save_results(results, res)
    update_baseline(res, out)
    new = json.loads(out.read_text())
    by_fp = {(f["cell"], f["fingerprint"]): f for f in new["findings"]}
    assert by_fp[(gone_fp["cell"], gone_fp["fingerprint"])].get("flaky") is True
    assert by_fp[(kept_fp["cell"], kept_fp["fingerprint"])].get("flaky") is True
    assert (stale["cell"], stale["fingerprint"]) not in by_fp
    assert next(c for c in new["cells"] if c["id"] == "tiny-llama@inductor").get("flaky") is True


def test_make_baseline_marks_flaky_from_recorded_attempts() -> None:
    cell = rf.cell("m", "b", {"ops": rf.ops_mode("b")}, attempts=["fail", "pass", "fail"])
    f0, f1 = cell.findings[0].fingerprint, cell.findings[1].fingerprint
    cell2 = rf.cell("m", "c", {"ops": rf.ops_mode("c")}, attempts=[
        {"status": "fail", "fingerprints": [f.fingerprint for f in rf.ops_mode("c").findings]},
        {"status": "fail", "fingerprints": [rf.ops_mode("c").findings[0].fingerprint]},
    ])
    data = make_baseline(Results(cells=[cell, cell2]))
    cells = {c["id"]: c for c in data["cells"]}
    assert cells["m@b"].get("flaky") is True and "flaky" not in cells["m@c"]
    flaky = {(f["cell"], f["key"]) for f in data["findings"] if f.get("flaky")}
    assert flaky == {("m@c", "aten._scaled_dot_product_flash_attention.default"), ("m@c", "aten.cumsum.default")}
    assert f0 != f1


@pytest.mark.parametrize("content, match", [
    (None, "not found"),
    ("{not json", "not valid JSON"),
    ('{"schema_version": 1, "cells": []}', "not a deepview-ci baseline"),
    ('{"schema_version": 7, "kind": "deepview-ci-baseline", "cells": [], "findings": []}', "schema_version 7"),
    ('{"schema_version": 1, "kind": "deepview-ci-baseline", "cells": [], "findings": [{"cell": "a@b", "fingerprint": "XYZ", "kind": "op_error", "mode": "ops"}]}',
     "does not match baseline.schema.json at findings/0/fingerprint"),
    ('{"schema_version": 1, "kind": "deepview-ci-baseline", "cells": [{"id": "a@b", "model": "a", "backend": "b", "status": "pass", "modes": {}},'
     ' {"id": "a@b", "model": "a", "backend": "b", "status": "fail", "modes": {}}], "findings": []}', "listed twice"),
    ("[]", "not a deepview-ci baseline"),
])
def test_load_refuses_bad_files_with_exit_3(tmp_path: Path, content: str | None, match: str) -> None:
    p = tmp_path / "baseline.json"
    if content is not None:
        p.write_text(content)
    with pytest.raises(InputError, match=match) as exc:
        load_baseline(p)
    assert exc.value.exit_code == EXIT_INPUT and exc.value.hint
    assert str(p) in exc.value.message


def test_results_json_given_as_baseline_is_named(tmp_path: Path) -> None:
    p = save_results(rf.sample_results(), tmp_path / "results.json")
    with pytest.raises(InputError, match="did you pass results.json"):
        load_baseline(p)


def test_update_refuses_to_overwrite_a_corrupt_baseline(tmp_path: Path) -> None:
    res = save_results(rf.sample_results(), tmp_path / "results.json")
    bad = tmp_path / "baseline.json"
    bad.write_text("{")
    with pytest.raises(InputError):
        update_baseline(res, bad)
    assert bad.read_text() == "{"


def test_hand_edited_baseline_still_diffs(tmp_path: Path) -> None:
    """Reviewers edit the file by hand: reordered keys and whitespace are fine."""
    data = make_baseline(rf.sample_results())
    p = tmp_path / "b.json"
    p.write_text(json.dumps(data, indent=4, sort_keys=True))
    d = diff(rf.sample_results(run="b"), load_baseline(p))
    assert d.counts()["persisting"] == 10 and d.exit_code("change") == 0


def test_fast_check_never_accepts_what_the_schema_rejects() -> None:
    """`load_baseline` skips jsonschema when its fast check passes: the check must be at least as strict."""
    import copy

    import jsonschema

    from ci_runner.results.baseline import _surely_valid
    from ci_runner.results.model import schema

    validator = jsonschema.Draft202012Validator(schema("baseline.schema.json"))
    good = make_baseline(rf.sample_results())
    good["cells"][0]["flaky"] = True
    good["findings"][0]["flaky"] = False
    assert _surely_valid(good) and validator.is_valid(good)

    def mutations():  # type: ignore[no-untyped-def]
        for key in ("schema_version", "kind", "cells", "findings"):
            for value in (None, 2, "x", [], {}, True, 1.0):
                yield ("top", key, value)
        for key in ("id", "model", "backend", "status", "modes", "flaky", "extra"):
            for value in (None, "", "a b@c", "nope", 3, {}, {"ops": "weird"}, {"ops": "fail"}, True, "a@b"):
                yield ("cell", key, value)
        for key in ("cell", "fingerprint", "kind", "mode", "key", "flaky", "extra"):
            for value in (None, "", "ABC", "abc", "0" * 65, "deadbeef", "divergence", "a@b", 0, False):
                yield ("finding", key, value)
        for where in ("cell", "finding"):
            for key in ("id", "status", "cell", "fingerprint"):
                yield (where, "-" + key, None)

    checked = 0
    for where, key, value in mutations():
        doc = copy.deepcopy(good)
        target = doc if where == "top" else doc["cells"][0] if where == "cell" else doc["findings"][0]
        if key.startswith("-"):
            target.pop(key[1:], None)
        else:
            target[key] = value
        if _surely_valid(doc):
            assert validator.is_valid(doc), (where, key, value)
            checked += 1
    assert checked > 5  # some mutations are valid, and those the fast path accepts are valid
