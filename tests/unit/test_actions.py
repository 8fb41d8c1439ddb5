"""GitHub Actions helpers: outputs, step summary cap, annotation escaping and caps."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from ci_runner.errors import ExecutionError
from ci_runner.github.actions import (
    AnnotationCap,
    annotate,
    escape_data,
    escape_property,
    format_annotation,
    format_output,
    in_actions,
    set_output,
)
from ci_runner.log import STEP_SUMMARY_LIMIT, append_step_summary, truncate_utf8


def parse_github_output(text: str) -> dict[str, str]:
    """Parse GITHUB_OUTPUT the way the runner does (name=value lines and name<<DELIM blocks)."""
    out: dict[str, str] = {}
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line:
            i += 1
            continue
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            name, delim = line.split("<<", 1)
            j = lines.index(delim, i + 1)
            out[name] = "\n".join(lines[i + 1 : j])
            i = j + 1
        else:
            name, value = line.split("=", 1)
            out[name] = value
            i += 1
    return out


def test_set_output_multiline_and_tricky_values(tmp_path: Path) -> None:
    f = tmp_path / "out"
    env = {"GITHUB_OUTPUT": str(f)}
    values = {
        "matrix": '{"include": [{"cell": "a@b"}]}',
        "multi": "line one\nline two\n\nline four",
        "looks_like_kv": "other=value\nEOF",
        "empty": "",
    }
    for k, v in values.items():
        assert set_output(k, v, env=env) is True
    assert parse_github_output(f.read_text()) == values


def test_set_output_delimiter_never_occurs_in_value() -> None:
    rec = format_output("x", "ghadelimiter_fixed\nmore", delimiter="ghadelimiter_fixed")
    head, *body = rec.split("\n")
    delim = head.split("<<", 1)[1]
    assert delim != "ghadelimiter_fixed" and delim not in "ghadelimiter_fixed\nmore"


def test_set_output_without_github_output_does_nothing(tmp_path: Path) -> None:
    assert set_output("x", "1", env={}) is False


@pytest.mark.parametrize("name", ["", "a=b", "a\nb", "a<<b"])
def test_set_output_refuses_bad_names(name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        set_output(name, "v", env={"GITHUB_OUTPUT": str(tmp_path / "o")})


def test_set_output_unwritable_is_an_execution_error(tmp_path: Path) -> None:
    with pytest.raises(ExecutionError, match="cannot write GitHub output"):
        set_output("x", "1", env={"GITHUB_OUTPUT": str(tmp_path / "missing-dir" / "out")})


def test_step_summary_appends_within_the_cap(tmp_path: Path) -> None:
    f = tmp_path / "summary"
    env = {"GITHUB_STEP_SUMMARY": str(f)}
    assert append_step_summary("# one", env=env) > 0
    assert append_step_summary("two\n", env=env) > 0
    assert f.read_text() == "# one\ntwo\n"


def test_step_summary_counts_what_the_step_already_wrote(tmp_path: Path) -> None:
    f = tmp_path / "summary"
    f.write_bytes(b"x" * (STEP_SUMMARY_LIMIT - 10_000) + b"\n")
    big = "".join(f"line {i} é😀\n" for i in range(10_000))
    n = append_step_summary(big, env={"GITHUB_STEP_SUMMARY": str(f)}, pointer="see report.html")
    size = f.stat().st_size
    assert size <= STEP_SUMMARY_LIMIT
    text = f.read_bytes().decode("utf-8")  # never cut inside a UTF-8 sequence
    assert text.rstrip().endswith("see report.html.")
    assert "truncated" in text and n == size - (STEP_SUMMARY_LIMIT - 10_000 + 1)
    # full: nothing more is appended
    assert append_step_summary("more", env={"GITHUB_STEP_SUMMARY": str(f)}) == 0
    assert f.stat().st_size == size


def test_step_summary_unset_is_a_no_op() -> None:
    assert append_step_summary("x", env={}) == 0


def test_truncate_utf8_cuts_at_a_line() -> None:
    text = "aaa\nbbb\nccc\n"
    assert truncate_utf8(text, 100) == text
    assert truncate_utf8(text, 9, note="!") == "aaa\nbbb\n!"


def test_annotation_escaping() -> None:
    assert escape_data("100% done\r\nnext") == "100%25 done%0D%0Anext"
    assert escape_property("a:b,c%\n") == "a%3Ab%2Cc%25%0A"
    cmd = format_annotation("error", "bad: 50%\nsecond, line", file="src/a,b:c.py", line=12,
                            title="deepview-ci: regression, a@b")
    assert cmd == ("::error file=src/a%2Cb%3Ac.py,line=12,title=deepview-ci%3A regression%2C a@b"
                   "::bad: 50%25%0Asecond, line")
    assert format_annotation("warning", "plain") == "::warning::plain"
    # an injected workflow command inside a message stays data
    assert "\n" not in format_annotation("notice", "x\n::set-output name=a::b")
    with pytest.raises(ValueError):
        format_annotation("fatal", "x")


def test_annotate_writes_one_line() -> None:
    buf = io.StringIO()
    annotate("error", "m\nn", title="t", stream=buf)
    assert buf.getvalue() == "::error title=t::m%0An\n"


def test_in_actions() -> None:
    assert in_actions({"GITHUB_ACTIONS": "true"}) and not in_actions({}) and not in_actions({"GITHUB_ACTIONS": "false"})


def test_cap_allows_ten_errors_and_ten_warnings_per_step() -> None:
    cap = AnnotationCap()
    buf = io.StringIO()
    errs = [cap.annotate("error", f"e{i}", stream=buf) for i in range(15)]
    warns = [cap.annotate("warning", f"w{i}", stream=buf) for i in range(12)]
    assert sum(e is not None for e in errs) == 10 and sum(w is not None for w in warns) == 10
    assert cap.dropped == {"error": 5, "warning": 2}
    assert len(buf.getvalue().splitlines()) == 20
    assert cap.remaining("error") == 0 and cap.remaining("notice") == 10


def test_cap_shares_fifty_per_job_across_steps(tmp_path: Path) -> None:
    env = {"RUNNER_TEMP": str(tmp_path), "GITHUB_JOB": "diff"}
    sent = 0
    for _step in range(8):  # each step is a new process with a new cap object
        cap = AnnotationCap.from_env(env)
        for level in ("error", "warning"):
            for _ in range(10):
                sent += cap.allow(level)
    assert sent == 50
    other_job = AnnotationCap.from_env({"RUNNER_TEMP": str(tmp_path), "GITHUB_JOB": "other"})
    assert other_job.remaining("error") == 10
