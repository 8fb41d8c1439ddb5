"""The documentation: the README is a front door whose command blocks run, and the docs/ pages build with
`mkdocs build --strict` (so a link or an anchor that no longer resolves fails here, README links included).

A README command block (a fenced ``bash`` block) runs in a fresh folder with this checkout's `deepview-ci`; one
preceded by an HTML comment starting ``<!-- slow`` (installs, whole runs) is not run here.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.paths import ROOT

pytestmark = pytest.mark.subprocess

README = ROOT / "README.md"
BLOCK = re.compile(r"(?:^(<!--[^\n]*-->)\n)?^```bash\n(.*?)^```$", flags=re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def command_blocks(text: str) -> list[tuple[bool, str]]:
    """Each ``bash`` block of `text` as (slow, script): slow when the line before it is a ``<!-- slow …-->`` comment."""
    return [(bool(m.group(1)) and m.group(1).startswith("<!-- slow"), m.group(2)) for m in BLOCK.finditer(text)]


def _clean_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GITHUB_")}  # no writes into a real CI step
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env["HOME"] = env.get("HOME", str(tmp))
    return env


def test_the_readme_is_a_front_door() -> None:
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 250, len(lines)
    long = [(i + 1, len(line)) for i, line in enumerate(lines) if len(line) > 200]
    assert not long, long
    blocks = command_blocks(text)
    quick = [script.strip() for slow, script in blocks if slow and script.startswith("python3 -m venv")]
    assert len(quick) == 2, "the two Quick start commands"
    assert quick[1] in (ROOT / ".ci" / "run").read_text(encoding="utf-8"), ".ci/run runs the second one verbatim"
    assert any(not slow for slow, _ in blocks), "some README command block must run in the test"
    for heading in ("## Quick start", "## A matrix", "## Commands", "### Exit codes", "## On GitHub", "## Documentation"):
        assert f"\n{heading}\n" in text, heading


def test_every_docs_page_is_linked_from_the_index_and_the_readme() -> None:
    """Issue 48: a page nobody links is a page nobody finds. docs/index.md links every other page of docs/; the
    README links docs/index.md and every page too (its Documentation list, or where it speaks of the topic)."""
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md")
    index = {t.partition("#")[0] for t in LINK.findall((ROOT / "docs" / "index.md").read_text(encoding="utf-8"))}
    assert [p for p in pages if p not in index] == [], "docs/index.md does not link these pages"
    readme = {t.partition("#")[0] for t in LINK.findall(README.read_text(encoding="utf-8"))}
    assert "docs/index.md" in readme
    assert [p for p in pages if f"docs/{p}" not in readme] == [], "the README does not link these pages"


@pytest.mark.timeout(300)
def test_every_readme_command_block_not_marked_slow_runs(tmp_path: Path) -> None:
    ran = 0
    for i, (slow, script) in enumerate(command_blocks(README.read_text(encoding="utf-8"))):
        if slow:
            continue
        where = tmp_path / f"block-{i}"
        where.mkdir()
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=where, env=_clean_env(tmp_path),
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, f"README block {i} exited {proc.returncode}:\n{script}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        ran += 1
    assert ran >= 2


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The docs built with `mkdocs build --strict` (every warning, a missing page or anchor included, fails it)."""
    try:
        import material  # noqa: F401  (mkdocs-material, the theme)
        import mkdocs  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("mkdocs and mkdocs-material are in the `test` extra: they must be installed in CI")
        pytest.skip("mkdocs / mkdocs-material not installed (pip install '.[test]')")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def test_mkdocs_build_strict_passes(site: Path) -> None:
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    for page in pages:
        built = site / "index.html" if page == "index" else site / page / "index.html"
        assert built.is_file(), page


def test_every_readme_link_resolves(site: Path) -> None:
    """A relative link of the README names a file of the repository; a link to a docs page's anchor names a heading
    that page has (as the built site spells its ids)."""
    bad = []
    for target in LINK.findall(README.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        if not (ROOT / path).exists():
            bad.append(target)
            continue
        if anchor and path.startswith("docs/") and path.endswith(".md"):
            stem = Path(path).stem
            page = (site / "index.html" if stem == "index" else site / stem / "index.html").read_text(encoding="utf-8")
            if f'id="{html.escape(anchor)}"' not in page:
                bad.append(target)
    assert not bad, f"README links that do not resolve: {bad}"
