"""What a child process imports before it does its work (each child pays its imports again, ~6.5 CPU s here).

The cell worker's entry (`python -m ci_runner.run.execute`) imports the cell runner, not the CLI with every
command's modules; the entry modules of the isolated children import torch but neither transformers nor the report
stack; building a factory model (your code) does not import transformers. Each check runs in a fresh interpreter,
where `sys.modules` holds only what that start-up imported.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ci_runner.run.execute import WORKER_MODULE
from tests.fixtures.paths import ROOT

CLI_STACK = ("ci_runner.cli", "ci_runner.report", "ci_runner.github", "ci_runner.history", "ci_runner.zoo.commands")
CHILD_ENTRIES = ("ci_runner.modes.ops.grouptest", "ci_runner.modes.layers.search", "ci_runner.modes.layers.culprit",
                 "ci_runner.modes.numerics.target", "ci_runner.modes.numerics.bisect", "ci_runner.modes.numerics.weights",
                 "ci_runner.modes.numerics.batch_invariance")


def _loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def _under(mods: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in mods if m.startswith(prefixes))


@pytest.mark.subprocess
def test_the_cell_worker_entry_imports_the_cell_runner_not_the_cli() -> None:
    mods = _loaded_after(f"import {WORKER_MODULE}")
    assert "ci_runner.run.cellrun" in mods
    assert not _under(mods, CLI_STACK)


@pytest.mark.subprocess
def test_the_isolated_childrens_entries_import_no_transformers_and_no_report_stack() -> None:
    mods = _loaded_after("\n".join(f"import {m}" for m in CHILD_ENTRIES))
    assert "torch" in mods
    assert not _under(mods, ("transformers",) + CLI_STACK)


@pytest.mark.subprocess
def test_a_factory_model_is_built_without_importing_transformers() -> None:
    mods = _loaded_after("from ci_runner.config import ModelSpec\nfrom ci_runner.models.load import load_model\n"
                         "m = load_model(ModelSpec(id='g', factory='tests.fixtures.plugin_layers_models:gated'))\n"
                         "assert sum(p.numel() for p in m.module.parameters()) > 0")
    assert "tests.fixtures.plugin_layers_models" in mods
    assert not _under(mods, ("transformers",))
