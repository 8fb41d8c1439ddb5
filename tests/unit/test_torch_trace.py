"""Dynamo's structured trace kept as `TORCH_TRACE` writes it (`watch/dynamotrace.py`: `trace_line`, `KeptTrace`,
`write_trace`): the line format is torch's own formatter's, the cap leaves whole records out and counts them, and a
watched compile gives a file of valid structured-trace records (tlparse itself reads the compile mode's file in
tests/integration/test_compile_mode.py)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from ci_runner.watch.dynamotrace import KeptTrace, TraceWatch, trace_line, write_trace
from tests.fixtures.torchtrace import records

def test_a_line_is_what_torchs_own_trace_formatter_writes() -> None:
    internal = pytest.importorskip("torch._logging._internal")
    formatter_class = getattr(internal, "TorchLogsFormatter", None)
    if formatter_class is None:
        pytest.skip("this torch has no TorchLogsFormatter to compare with")
    path = str(Path(torch.__file__).parent / "_dynamo" / "convert_frame.py")
    meta = {"dynamo_start": {"stack": [{"line": 3, "name": "f", "filename": 1}]}, "frame_id": 0, "attempt": 0}
    for payload in (None, "def forward(self, x):\n    return x.sin()"):
        rec = logging.LogRecord("torch.__trace", logging.DEBUG, path, 303, "", None, None)
        rec.metadata, rec.payload = meta, payload  # what trace_structured passes as `extra`
        theirs = formatter_class(trace=True).format(rec) + "\n"  # the handler's terminator
        ours = trace_line(meta, payload, created=rec.created, pid=rec.process or 0, pathname=path, lineno=303,
                          msecs=rec.msecs)
        assert ours == theirs


def _line(i: int, size: int = 100) -> str:
    return trace_line({"artifact": {"name": f"a{i}", "encoding": "string"}}, "x" * size, created=0.0, pid=1,
                      pathname="/x/torch/_dynamo/utils.py", lineno=1)


def test_the_cap_leaves_whole_records_out_counts_them_and_keeps_interned_strings(tmp_path: Path) -> None:
    kept = KeptTrace(cap=3 * len(_line(0)))
    for i in range(5):
        kept.add(_line(i))
    kept.add(trace_line({"str": ["/a/model.py", 7]}, None, created=0.0, pid=1, pathname="/x/y.py", lineno=1),
             always=True)
    assert len(kept.lines) == 4 and kept.left_out == 2 and kept.left_out_bytes == 2 * len(_line(0))
    out = write_trace(tmp_path / "dedicated_log_torch_trace_forward.log", kept, cap=len(_line(0)))
    assert out["records"] == 2 and out["left_out"] == 4  # one record, the interned string; 2 + 2 left out
    text = (tmp_path / out["file"]).read_text(encoding="utf-8")
    assert [m for m, _ in records(text)] == [{"artifact": {"name": "a0", "encoding": "string"}},
                                             {"str": ["/a/model.py", 7]}]
    assert out["bytes"] == len(text.encode())


def _f(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    torch._dynamo.graph_break()
    return y.cos()


def test_a_watched_compile_keeps_valid_records_with_the_strings_interned_before_it(fresh_dynamo: Any,
                                                                                    tmp_path: Path) -> None:
    torch.compile(_f, backend="eager")(torch.ones(2))  # interns this file's name before the watch starts
    torch._dynamo.reset()
    with TraceWatch() as watch:
        watch.mark("forward")
        torch.compile(_f, backend="eager")(torch.ones(3))
    assert watch.kept is not None and watch.kept.left_out == 0
    assert {e.kind for e in watch.events} >= {"graph_break", "compile"}
    out = write_trace(tmp_path / "dedicated_log_torch_trace_forward.log", watch.kept)
    recs = records((tmp_path / out["file"]).read_text(encoding="utf-8"))
    assert len(recs) == out["records"]
    interned = {m["str"][1]: m["str"][0] for m, _ in recs if "str" in m}
    assert __file__ in interned.values()  # replayed at the head: interned before the watch
    starts = [m["dynamo_start"] for m, _ in recs if "dynamo_start" in m]
    assert starts and all(frame["filename"] in interned for s in starts for frame in s["stack"])
    assert any(m.get("artifact", {}).get("name") == "dynamo_graph_break_reason" for m, _ in recs)
    assert any("compilation_metrics" in m for m, _ in recs)
    for meta, payload in recs:  # tlparse checks each payload against its md5
        if "has_payload" in meta:
            assert payload is not None
            assert hashlib.md5(payload.encode()).hexdigest() == meta["has_payload"], meta
