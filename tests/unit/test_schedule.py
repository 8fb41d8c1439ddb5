"""The heaviest-first file order (`tests/fixtures/schedule.py`, applied by `tests/conftest.py`)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass

from tests.fixtures.paths import ROOT
from tests.fixtures.schedule import HEAVY, file_of, file_seconds, heaviest_first, makespan


@dataclass(frozen=True)
class _Item:
    nodeid: str


def test_every_listed_file_is_a_test_file_of_this_checkout() -> None:
    missing = [p for p in HEAVY if not (ROOT / p).is_file()]
    assert not missing, f"tests/fixtures/schedule.py names files that are gone (rename or drop them): {missing}"
    assert all(p.startswith("tests/") and p.rsplit("/", 1)[1].startswith("test_") for p in HEAVY)
    assert all(s > 0 for s in HEAVY.values())


def test_listed_files_come_first_longest_first_and_the_rest_keep_collection_order() -> None:
    ids = ["tests/unit/test_a.py::t1", "tests/unit/test_a.py::t2", "tests/integration/test_big.py::t1[x]",
           "tests/unit/test_b.py::t1", "tests/integration/test_mid.py::t1", "tests/integration/test_big.py::t1[y]",
           "tests/integration/test_big.py::t0"]
    heavy = {"tests/integration/test_mid.py": 10.0, "tests/integration/test_big.py": 99.0, "tests/unit/gone.py": 5.0}
    order = [i.nodeid for i in heaviest_first([_Item(n) for n in ids], heavy)]
    assert order == ["tests/integration/test_big.py::t1[x]", "tests/integration/test_big.py::t1[y]",
                     "tests/integration/test_big.py::t0", "tests/integration/test_mid.py::t1",
                     "tests/unit/test_a.py::t1", "tests/unit/test_a.py::t2", "tests/unit/test_b.py::t1"]
    assert file_of("tests/unit/test_a.py::Cls::t[a::b]") == "tests/unit/test_a.py"


def test_the_order_reaches_xdist_because_its_own_reordering_is_off() -> None:
    """xdist's default `--loadscope-reorder` re-sorts files by test count and would undo the order."""
    pytest_ini = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    addopts = pytest_ini["addopts"]
    assert "--dist loadfile" in addopts and "--no-loadscope-reorder" in addopts


def test_a_durations_log_gives_seconds_per_file() -> None:
    log = ("============================= slowest durations ==============================\n"
           "12.50s call     tests/integration/test_x.py::test_a[p-1]\n"
           "0.50s setup    tests/integration/test_x.py::test_a[p-1]\n"
           "3.00s call     tests/unit/test_y.py::TestC::test_b\n"
           "(12 durations < 0.005s hidden.)\n")
    assert file_seconds(log) == {"tests/integration/test_x.py": [13.0], "tests/unit/test_y.py": [3.0]}


def test_the_longest_file_last_leaves_one_worker_alone_and_first_does_not() -> None:
    """xdist's rules on 2 workers: 10 one-second files then a 10-second one end at 15 s; longest first at 11 (a
    worker whose file holds at most 2 tests is handed a second one at once: one small file waits behind it)."""
    small = [(f"f{i}", [1.0]) for i in range(10)]
    assert makespan([*small, ("big", [10.0])]) == 15.0
    assert makespan([("big", [10.0]), *small]) == 11.0
