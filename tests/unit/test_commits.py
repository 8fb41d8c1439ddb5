"""Issue 22, the fast parts: the bisection walk and the issue's bisection text (the scratch clone, the environment
stamp's source commit and `run_command`, which start processes: `tests/integration/test_commits_git.py`)."""

from __future__ import annotations

import pytest

from ci_runner.commits.walk import Budget, next_probe, walk


def history(first_bad: int, skips: frozenset[int] = frozenset()):
    asked: list[int] = []

    def classify(i: int) -> str:
        asked.append(i)
        return "skip" if i in skips else ("bad" if i >= first_bad else "good")
    return classify, asked


@pytest.mark.parametrize("first_bad", [0, 1, 12, 20, 38])
def test_walk_names_the_first_bad_commit_in_log2_steps(first_bad: int) -> None:
    classify, asked = history(first_bad)
    r = walk(39, classify, Budget())
    assert r.first_bad == first_bad and r.stopped == ""
    assert len(asked) <= 6 and len(set(asked)) == len(asked)  # ⌈log2 39⌉, never the same commit twice


def test_a_skipped_commit_is_stepped_around() -> None:
    classify, asked = history(12, skips=frozenset({18}))
    r = walk(39, classify, Budget())
    assert r.first_bad == 12 and asked[0] == 18 and asked[1] in (17, 19)


def test_skips_around_the_answer_give_the_smallest_range() -> None:
    classify, _ = history(12, skips=frozenset({10, 11, 12}))
    r = walk(39, classify, Budget())
    assert r.first_bad is None and r.range == (10, 13) and "skipped" in r.stopped  # 12 or 13 after 9 good, 13 bad
    assert next_probe(9, 13, {10, 11, 12}) is None


def test_the_step_budget_stops_the_walk_with_the_open_range() -> None:
    classify, asked = history(30)
    r = walk(39, classify, Budget(max_steps=2))
    assert len(asked) == 2 and r.first_bad is None and "step budget" in r.stopped
    assert r.range[0] <= 30 <= r.range[1]


def test_the_issue_quotes_the_bisection_of_its_finding_with_untrusted_text_neutralised() -> None:
    from ci_runner.commits.pipeline import bisections_by_finding
    from ci_runner.github.options import FilingOptions
    from ci_runner.github.render import RenderContext, group_entries, render_issue
    from tests.fixtures.fake_github import entry, op_finding

    f = op_finding("aten.softplus.default", "tinyc", message="TinycLoweringError: no lowering for 'aten::softplus'")
    e = entry("regressed", "tiny", "tinyc", f)
    [g] = group_entries({"entries": [e]}, layers=False)
    step = {"commit": "c" * 40, "verdict": "skip", "seconds": 0.4, "log": "setup failed ``` <img src=x> @octocat", "repro_ran": False}
    exact = {"signature": "d02d14ec498c", "good": "a" * 40, "bad": "b" * 40, "stopped": "", "repro_runs": 5,
             "first_bad": {"commit": "f" * 40, "subject": "softplus: drop it @octocat", "author": "Dev <d@x>", "date": "2026-01-01"},
             "range": [], "steps": [step], "findings": [f"{e['cell']} {e['fingerprint']}"]}
    ctx = RenderContext(options=FilingOptions(), run_key="gh-1", run_url=None, artifacts_url=None, run_dir=None,
                        bisections=bisections_by_finding({"bisections": [exact]}))
    body = render_issue(g, ctx)
    assert f"First failing at `{'f' * 40}` softplus: drop it" in body and "Step log: 1 step(s), 5 repro run(s)" in body
    import re

    fence = re.search(r"\n(`{4,})\n(setup failed.*?)\n\1\n", body, re.S)  # the log: in a fence longer than its backticks
    assert fence and "<img src=x>" in fence.group(2)
    outside = body.replace(fence.group(0), "")
    assert "<img" not in outside and "@octocat" not in outside  # the subject's mention is broken
    ranged = {**exact, "first_bad": None, "stopped": "every commit left in the range was skipped",
              "range": [{"commit": "1" * 40, "subject": "one"}, {"commit": "2" * 40, "subject": "two"}]}
    body = render_issue(g, RenderContext(options=FilingOptions(), run_key="gh-1", run_url=None, artifacts_url=None,
                                         run_dir=None, bisections=bisections_by_finding({"bisections": [ranged]})))
    assert "The first failing commit is one of 2 (every commit left in the range was skipped)" in body and "two" in body
    assert "First failing at" not in render_issue(g, RenderContext(options=FilingOptions(), run_key="gh-1", run_url=None,
                                                                    artifacts_url=None, run_dir=None))
