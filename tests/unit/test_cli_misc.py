"""`env`, progress output styles, usage errors: small CLI behaviours."""

from __future__ import annotations

import io
import json

import pytest

from ci_runner.cli import main
from ci_runner.log import OutputStyle, Progress


def test_env_lists_versions_devices_and_the_sim_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch"] and report["transformers"] and report["python"]
    names = {b["name"] for b in report["backends"]}
    assert {"inductor", "aot_eager", "sim-subset", "sim-drift", "sim-crash", "sim-abort", "sim-segv", "sim-hang", "simdev"} <= names
    assert "cpu" in report["devices"]
    assert main(["env"]) == 0
    assert "sim-subset (sim)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("env", "tty", "expect", "absent"),
    [
        ({}, True, ["[0/2] a@b: running", "[1/2] a@b: FAIL in 1.0s", "    boom"], ["::group::"]),
        ({"CI": "true"}, False, ["[1/2] a@b: FAIL in 1.0s"], ["::group::"]),
        ({"CI": "true", "GITHUB_ACTIONS": "true"}, False, ["::group::[1/2] a@b: FAIL in 1.0s", "boom", "::endgroup::"], ["running"]),
    ],
)
def test_progress_styles(env: dict, tty: bool, expect: list[str], absent: list[str]) -> None:
    buf = io.StringIO()
    style = OutputStyle.detect(env, buf)
    style = OutputStyle(github=style.github, ci=style.ci, tty=tty)
    p = Progress(2, style=style, stream=buf)
    p.cell_started("a@b")
    p.cell_finished("a@b", "fail", 1.0, "boom")
    p.cell_reused("c@d", "pass")
    out = buf.getvalue()
    for needle in expect:
        assert needle in out
    for needle in absent:
        assert needle not in out
    assert "[2/2] c@d: ok (finished earlier; --force reruns it)" in out


def test_usage_errors_exit_2_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--modes", "ops,bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown mode(s) bogus" in err and "Traceback" not in err
    assert main([]) == 2
    assert main(["baseline"]) == 2
    assert "baseline update" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("deepview-ci ")
