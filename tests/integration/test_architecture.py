"""The package's edges: the import-linter layers contract (pyproject.toml), no import cycles, no private names used
across modules, in-function imports only to defer a heavy import (and saying so), no overlong modules."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests.fixtures.paths import ROOT

PKG = ROOT / "ci_runner"
MAX_LINES = 850  # "about 800"; a longer module says in its docstring why it is one piece
ONE_PIECE = "one piece"


# --------------------------------------------------------------------------- the import graph, from the source

@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module of this package
    name: str | None  # `from target import name`; None for `import target`
    line: int
    in_function: bool
    text: str  # the source line


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def imports_of(module: str, path: Path, modules: set[str]) -> Iterator[Import]:
    """Every import of this package's modules in `module` (not those under `if TYPE_CHECKING:`)."""
    text = path.read_text(encoding="utf-8")
    source = text.splitlines()
    tree = ast.parse(text)
    skip = _type_checking_lines(tree)
    is_pkg = path.name == "__init__.py"

    def visit(node: ast.AST, in_function: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and child.lineno not in skip:
                line = source[child.lineno - 1]
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        if alias.name in modules:
                            yield Import(module, alias.name, None, child.lineno, in_function, line)
                else:
                    base = _resolve(module, is_pkg, child)
                    for alias in child.names:
                        sub = f"{base}.{alias.name}"
                        if sub in modules:
                            yield Import(module, sub, None, child.lineno, in_function, line)
                        elif base in modules:
                            yield Import(module, base, alias.name, child.lineno, in_function, line)
            yield from visit(child, inner)

    yield from visit(tree, False)


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def all_imports() -> list[Import]:
    mods = _modules()
    names = set(mods)
    return [imp for m, p in mods.items() for imp in imports_of(m, p, names)]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def _package_edges(imports: list[Import]) -> dict[str, set[str]]:
    """module -> modules it imports; a package's `__init__` is not counted as imported by its own submodules
    (Python runs it first anyway), and importing `pkg.sub` does not count as importing `pkg`."""
    edges: dict[str, set[str]] = {}
    for imp in imports:
        if imp.target != imp.module and not imp.module.startswith(imp.target + "."):
            edges.setdefault(imp.module, set()).add(imp.target)
    return edges


# --------------------------------------------------------------------------- the checks

def _lint_imports() -> str:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed: `pip install -e .[test]` (import-linter is in the test extra)")
    return exe


def test_the_layers_contract_holds() -> None:
    proc = subprocess.run([_lint_imports(), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "BROKEN" not in proc.stdout and " KEPT" in proc.stdout


def test_every_module_sits_in_a_layer_and_the_page_draws_the_contract() -> None:
    """lint-imports checks only the modules its layers name: a module in none is unchecked. Every module that
    imports anything is in a layer, and docs/architecture.md's diagram is the contract (`python -m
    tests.fixtures.archdoc` redraws it)."""
    from tests.fixtures import archdoc

    assert not archdoc.outside_layers(), f"modules in no layer of pyproject's contract: {archdoc.outside_layers()}"
    text = archdoc.PAGE.read_text(encoding="utf-8")
    assert archdoc.MARKER in text and archdoc.render(text) == text, \
        "docs/architecture.md's layers diagram differs from the contract: python -m tests.fixtures.archdoc"


def test_the_contract_catches_a_lower_layer_importing_a_higher_one(tmp_path: Path) -> None:
    """The check can fail: the same contract on a copy of the package where `errors` imports `cli`."""
    shutil.copytree(PKG, tmp_path / "ci_runner", ignore=shutil.ignore_patterns("__pycache__"))
    errors = tmp_path / "ci_runner" / "errors.py"
    errors.write_text(errors.read_text(encoding="utf-8") + "\nfrom . import cli  # noqa\n", encoding="utf-8")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    proc = subprocess.run([_lint_imports(), "--config", str(tmp_path / "pyproject.toml"), "--no-cache"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(tmp_path)})
    assert proc.returncode != 0 and "BROKEN" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "ci_runner.errors -> ci_runner.cli" in proc.stdout


def test_the_registry_imports_no_torch() -> None:
    """Matrix loading, the mode registry and every mode's report and issue hooks stay light: no torch (a fresh
    interpreter tells; the reports and the filer load the hooks on a CPU runner)."""
    code = ("import sys, ci_runner.registry as r, ci_runner.config, ci_runner.modes; r.mode_hooks(); "
            "[r.load_ref(g.key) for m in r.modes() for g in m.issue_groups if g.key]; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_import_cycles() -> None:
    found = cycles(_package_edges(all_imports()))
    assert not found, f"import cycles: {found}"


def test_the_cycle_finder_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_names_across_modules() -> None:
    """`from ci_runner.x import _name` outside `x` (a private name is used only in its own module)."""
    bad = [f"{i.module}:{i.line}: {i.text.strip()}" for i in all_imports()
           if i.name is not None and i.name.startswith("_") and not i.name.startswith("__") and i.target != i.module]
    bad += _private_attribute_reads()
    assert not bad, "private names used across modules (make them public or move them):\n" + "\n".join(bad)


def _private_attribute_reads() -> list[str]:
    """`mod._name` where `mod` is bound to one of this package's modules by an import."""
    mods = _modules()
    out: list[str] = []
    for m, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bound: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods and a.asname:
                        bound[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(m, path.name == "__init__.py", node)
                for a in node.names:
                    if f"{base}.{a.name}" in mods:
                        bound[a.asname or a.name] = f"{base}.{a.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__") and bound[node.value.id] != m):
                out.append(f"{m}:{node.lineno}: {node.value.id}.{node.attr}")
    return out


def test_in_function_imports_defer_a_heavy_import_and_say_so() -> None:
    """An import of this package inside a function is allowed only to defer a heavy import (torch, transformers),
    with a `# deferred: why` comment on its line."""
    bad = [f"{i.module}:{i.line}: {i.text.strip()}" for i in all_imports()
           if i.in_function and "# deferred:" not in i.text]
    assert not bad, "in-function imports without a `# deferred: …` reason:\n" + "\n".join(bad)


def test_modules_are_short_or_say_why_they_are_one_piece() -> None:
    long = []
    for m, path in _modules().items():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") + 1 > MAX_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if ONE_PIECE not in doc:
                long.append(f"{m}: {text.count(chr(10)) + 1} lines")
    assert not long, f"modules over {MAX_LINES} lines whose docstring does not say why they are {ONE_PIECE}: {long}"


MAX_FUNCTION_LINES = 80  # one screen; a longer function says in its docstring why it is one piece


def long_functions(path: Path, module: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`module.qualname(lines)` of each function in `path` over `limit` lines whose docstring does not say why it is
    one piece."""
    out: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = (child.end_lineno or child.lineno) - child.lineno + 1
                    if lines > limit and ONE_PIECE not in (ast.get_docstring(child) or ""):
                        out.append(f"{name}({lines})")
                visit(child, name)

    visit(ast.parse(path.read_text(encoding="utf-8")), module)
    return out


def test_functions_fit_one_screen_or_say_why() -> None:
    long = [f for module, path in _modules().items() for f in long_functions(path, module)]
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines whose docstring does not say why they are "
                      f"{ONE_PIECE}: {long}; split them along their steps")


def test_the_function_length_check_finds_a_long_one(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    path = tmp_path / "m.py"
    path.write_text(f"class C:\n    def f(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n\n"
                    f"def g():\n    \"\"\"Kept {ONE_PIECE}: a table.\"\"\"\n{body}\n", encoding="utf-8")
    assert long_functions(path, "m") == [f"m.C.f({MAX_FUNCTION_LINES + 1})"]


def test_docstrings_cite_only_files_in_the_repository() -> None:
    """No "DESIGN §3" or "phase N": a reader of the repository cannot find them."""
    import re

    bad = []
    for m, path in _modules().items():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"DESIGN(\.md)? ?§|\bphase \d", line):
                bad.append(f"{m}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------------- the tests' own layout

SPAWNS = ("subprocess.run", "subprocess.Popen", "subprocess.check_output", "run_cli", "cli", "run_isolated", "supervise",
          "isolate.run_isolated", "isolate.supervise")


def _marks(decorators: list[ast.expr]) -> set[str]:
    text = " ".join(ast.unparse(d) for d in decorators)
    return {m for m in ("slow", "subprocess") if f"mark.{m}" in text}


def unmarked_spawning_tests(path: Path, exempt: tuple[str, ...] = ("slow", "subprocess")) -> list[str]:
    """Tests in `path` that start a child process (directly, or through a helper or fixture of the same file) without
    one of the `exempt` marks (on the test or on the module's `pytestmark`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module_marks: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            module_marks |= _marks([node.value])
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}

    def spawns(fn: ast.FunctionDef, seen: set[str]) -> bool:
        calls = {ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
        if any(c in SPAWNS or c.startswith("multiprocessing.") or c.endswith(".Process") for c in calls) \
                or any(a.arg == "cli" for a in fn.args.args):
            return True
        called = {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        called |= {a.arg for a in fn.args.args}  # a fixture of the same file runs before the test
        return any(spawns(funcs[c], seen | {c}) for c in called if c in funcs and c not in seen)

    return [f"{path.name}::{name}" for name, fn in funcs.items()
            if name.startswith("test_") and not (module_marks | _marks(fn.decorator_list)) & set(exempt)
            and spawns(fn, {name})]


def test_unit_tests_start_no_process() -> None:
    """`tests/unit` is for tests in this process; a test that starts a child (git, the command line, the child
    engine, a second process) is in `tests/integration`, marked `subprocess`. The one exception is a `slow` end-to-end
    run of a script a unit generates (the ops and layers repros), kept beside that unit's rendering tests."""
    unit = sorted((ROOT / "tests" / "unit").glob("test_*.py"))
    bad = [t for p in unit for t in unmarked_spawning_tests(p, exempt=("slow",))]
    assert not bad, f"unit tests that start child processes (move them to tests/integration): {bad}"
    marked = [p.name for p in unit if "mark.subprocess" in p.read_text(encoding="utf-8")]
    assert not marked, f"subprocess-marked tests in tests/unit (they belong in tests/integration): {marked}"


def test_the_spawn_check_sees_a_helper(tmp_path: Path) -> None:
    path = tmp_path / "test_x.py"
    path.write_text("import subprocess\nimport pytest\n\ndef _go():\n    subprocess.run(['true'])\n\n"
                    "def test_a():\n    _go()\n\n@pytest.mark.subprocess\ndef test_b():\n    _go()\n\n"
                    "def test_c():\n    pass\n\n@pytest.fixture\ndef repo():\n    _go()\n\n"
                    "def test_d(repo):\n    pass\n", encoding="utf-8")
    assert unmarked_spawning_tests(path) == ["test_x.py::test_a", "test_x.py::test_d"]
    assert unmarked_spawning_tests(path, exempt=("slow",)) == ["test_x.py::test_a", "test_x.py::test_b",
                                                                 "test_x.py::test_d"]


# --------------------------------------------------------------------------- the layout tree (docs/architecture.md)

def readme_tree() -> set[str]:
    """The paths the layout tree of docs/architecture.md names (its first code block after `## Layout`; two spaces
    per level)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## Layout", 1)[1].split("```\n", 2)[1]
    paths: set[str] = set()
    stack: list[str] = []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        name = line.strip().split(" ", 1)[0]
        if indent % 2 or indent > 8 or not name or not (name.endswith("/") or "." in name):
            continue  # a continuation of the role text
        stack = stack[: indent // 2] + [name.rstrip("/")]
        paths.add("/".join(stack))
    return paths


def test_the_readme_tree_matches_the_repository() -> None:
    tree = readme_tree()
    missing = sorted(p for p in tree if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md's layout names what does not exist: {missing}"
    skip = {"__pycache__", "vendor_repo", "golden", "junit"}
    ignored = {"build", "dist", "out", "venv", "node_modules", "site"}  # .gitignore's folders: build outputs, not the layout
    wanted = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name not in skip
              and p.name not in ignored and not p.name.endswith(".egg-info")}
    wanted |= {f"ci_runner/{p.relative_to(PKG).as_posix()}" for p in PKG.rglob("*")
               if p.is_dir() and p.name not in skip}
    wanted |= {f"ci_runner/{p.name}" for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    wanted |= {"tests/unit", "tests/integration", "tests/fixtures", "tests/conftest.py"}
    absent = sorted(wanted - tree)
    assert not absent, f"docs/architecture.md's layout tree lacks: {absent}"


def test_no_test_imports_the_conftest_or_defines_the_root_again() -> None:
    """Shared helpers live in `tests/fixtures/` (the repository root: `tests/fixtures/paths.py`); conftest.py only
    declares fixtures, and pytest loads it."""
    import re

    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if re.search(r"^\s*(from tests(\.\w+)* import conftest|from tests\.conftest import|import tests\.conftest)", text, re.M):
            bad.append(f"{path.relative_to(ROOT)} imports the conftest")
        if path.name != "paths.py" and re.search(r"^(ROOT|REPO) = Path\(__file__\)", text, re.M):
            bad.append(f"{path.relative_to(ROOT)} defines ROOT/REPO again")
    assert not bad, bad
