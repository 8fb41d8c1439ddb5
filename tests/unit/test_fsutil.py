"""fsutil: atomic writes leave no partial files; the two flock helpers exclude each other."""

from __future__ import annotations

from pathlib import Path

from ci_runner.fsutil import atomic_write_json, locked, read_records, append_record, try_lock


def test_atomic_write_leaves_only_the_target(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "a.json"
    atomic_write_json(target, {"x": 1})
    atomic_write_json(target, {"x": 2})
    assert target.read_text().strip().endswith("}")
    assert [p.name for p in target.parent.iterdir()] == ["a.json"]


def test_try_lock_is_refused_while_another_holds_it_and_free_after(tmp_path: Path) -> None:
    path = tmp_path / "k.claim"
    first = try_lock(path)
    assert first is not None
    assert try_lock(path) is None  # flock is per open file: a second open conflicts even in one process
    first.close()
    again = try_lock(path)
    assert again is not None
    again.close()


def test_locked_holds_the_same_lock_try_lock_sees(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "t.lock"
    with locked(path):
        assert try_lock(path) is None
    fh = try_lock(path)
    assert fh is not None
    fh.close()


def test_records_last_line_wins_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    log = tmp_path / "r.jsonl"
    append_record(log, {"k": "a", "v": 1})
    append_record(log, {"k": "a", "v": 2})
    with open(log, "a") as fh:
        fh.write('{"k": "b", "v"')
    got = read_records(log, dict, lambda r: r["k"])
    assert got == {"a": {"k": "a", "v": 2}}


def test_unsynced_appends_and_writes_land_as_synced_ones(tmp_path: Path) -> None:
    from ci_runner.fsutil import append_line, atomic_write_text

    append_line(tmp_path / "j.log", "a", sync=False)
    append_line(tmp_path / "j.log", "b")
    atomic_write_text(tmp_path / "o.json", "{}\n", sync=False)
    assert (tmp_path / "j.log").read_text() == "a\nb\n" and (tmp_path / "o.json").read_text() == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["j.log", "o.json"]
