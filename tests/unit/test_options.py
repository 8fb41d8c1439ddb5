"""Mode options declared once (`ci_runner/options.py`): parsing, checks at matrix load, the tables of docs/modes.md."""

from __future__ import annotations

import re

import pytest

from ci_runner.config import load_matrix_text
from ci_runner.errors import ConfigError, OptionError
from ci_runner.options import (
    DEFAULT_TOLERANCE,
    LayersOptions,
    MemoryOptions,
    NumericsOptions,
    OpsOptions,
    ThresholdOptions,
    ToolboxOptions,
    markdown_table,
)
from ci_runner.registry import known_keys, parse_options as parse
from tests.fixtures.paths import ROOT

pytestmark = pytest.mark.oldtorch  # the old-torch subset (tests/fixtures/oldtorch.py)

MATRIX = """version: 1
defaults:
  options: {OPTIONS}
models: [{id: a, config: llama}]
backends: [{id: b, compile: inductor}]
"""


def test_parse_returns_the_typed_dataclass_with_defaults() -> None:
    assert parse("ops", {}) == OpsOptions()
    assert parse("layers", None) == LayersOptions()
    n = parse("numerics", {"margin": 4, "batch_slots": 3, "views": "isolated", "reference_dump": "/d/ref",
                           "timeout": None})
    assert isinstance(n, NumericsOptions)
    assert n.thresholds == ThresholdOptions(margin=4.0) and n.thresholds.margin == 4.0
    assert n.toolbox == ToolboxOptions(batch_slots=3, reference_dump=("/d/ref",))
    assert n.views == ("isolated",) and n.timeout is None
    o = parse("ops", {"probe_timeout": 5, "tolerance": {"torch.bfloat16": [0.1, 0.05]}, "skip_ops": "aten.view*"})
    assert o.probe_timeout == 5.0 and o.skip_ops == ("aten.view*",)
    assert o.tolerance_for("bfloat16") == (0.1, 0.05) and o.tolerance_for("float32") == DEFAULT_TOLERANCE["float32"]
    assert parse("layers", {"sample": 2, "verify": False}).sample == 2


@pytest.mark.parametrize(("mode", "mapping", "key", "text"), [
    ("numerics", {"margn": 8}, "margn", "did you mean 'margin'"),
    ("ops", {"probe_timeot": 3}, "probe_timeot", "did you mean 'probe_timeout'"),
    ("layers", {"probe_timout": 3}, "probe_timout", "did you mean 'probe_timeout'"),
    ("ops", {"ir": "llvm"}, "ir", "options.ops.ir: 'llvm' is not an IR level"),
    ("ops", {"workers": 0}, "workers", "must be >= 1"),
    ("ops", {"probe_timeout": "soon"}, "probe_timeout", "is not a number"),
    ("ops", {"tolerance": {"bfloat16": [1]}}, "tolerance", "give [rtol, atol]"),
    ("layers", {"verify": "yes"}, "verify", "not true/false"),
    ("layers", {"probe_timeout": -1}, "probe_timeout", "must be >= 0"),
    ("numerics", {"views": ["sideways"]}, "views", "not among"),
    ("numerics", {"compare_samples": 0}, "compare_samples", "must be >= 1"),
    ("numerics", {"percentile": 101}, "percentile", "must be <= 100"),
    ("numerics", {"samples": 1.5}, "samples", "not an integer"),
    ("numerics", {"batch_slots": 1}, "batch_slots", "must be >= 2"),
    ("numerics", {"bisect_method": "magic"}, "bisect_method", "'magic' is not auto, compiler or nodes"),
    ("numerics", {"reference_dump": []}, "reference_dump", "not a string or a list"),
])
def test_bad_options_name_the_key_and_the_fix(mode: str, mapping: dict, key: str, text: str) -> None:
    with pytest.raises(OptionError) as info:
        parse(mode, mapping)
    assert info.value.key == key and text in str(info.value)
    assert isinstance(info.value, ConfigError)


def test_unknown_mode() -> None:
    with pytest.raises(OptionError, match="did you mean 'numerics'"):
        parse("numeric", {})


@pytest.mark.parametrize(("options", "where", "text"), [
    ("{numerics: {margn: 8}}", ":3:24:", "did you mean 'margin'"),
    ("{numerics: {margin: 0.5}}", ":3:32:", "defaults.options.numerics.margin: must be >= 1"),
    ("{ops: {workers: 1, via: dynamo, skip_ops: [a, b], ir: nope}}", ":3:66:", "options.ops.ir"),
])
def test_the_matrix_loader_checks_every_options_block(options: str, where: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_matrix_text(MATRIX.replace("{OPTIONS}", options), path="m.yaml")
    assert str(info.value).startswith("m.yaml" + where) and text in str(info.value)


def test_model_and_backend_options_are_checked_too() -> None:
    text = ("version: 1\nmodels:\n  - id: a\n    config: llama\n    options:\n      layers: {all_cals: true}\n"
            "backends: [{id: b, compile: inductor}]\n")
    with pytest.raises(ConfigError, match=r"m.yaml:6:16: models\[0\].options.layers: unknown option 'all_cals'"):
        load_matrix_text(text, path="m.yaml")
    text = ("version: 1\nmodels: [{id: a, config: llama}]\n"
            "backends: [{id: b, compile: inductor, options: {ops: {compare: maybe}}}]\n")
    with pytest.raises(ConfigError, match=r"m.yaml:3:.*backends\[0\].options.ops.compare: 'maybe' is not true/false"):
        load_matrix_text(text, path="m.yaml")


def test_the_bundled_example_parses() -> None:
    from ci_runner.config import load_matrix
    from ci_runner.matrix import expand

    for cell in expand(load_matrix()):
        for mode, opts in cell.options.items():
            parse(mode, opts)


def _doc_tables() -> list[str]:
    text = (ROOT / "docs" / "modes.md").read_text(encoding="utf-8")
    return re.findall(r"^\| option \| default \| meaning \|\n(?:^\|.*\|\n)+", text, flags=re.M)


@pytest.mark.parametrize("cls", [OpsOptions, LayersOptions, NumericsOptions, ToolboxOptions, MemoryOptions])
def test_the_docs_tables_are_the_declarations(cls: type) -> None:
    table = markdown_table(cls) + "\n"
    assert table in _doc_tables(), f"docs/modes.md's table for {cls.__name__} differs: python -m tests.fixtures.doctables"


def test_the_docs_tables_are_generated() -> None:
    """Every table of docs/modes.md sits under its marker and is what `python -m tests.fixtures.doctables` writes."""
    from tests.fixtures import doctables

    text = doctables.PAGE.read_text(encoding="utf-8")
    assert doctables.classes_in(text) == ["OpsOptions", "LayersOptions", "NumericsOptions", "ToolboxOptions",
                                          "CompileOptions", "MemoryOptions"]
    assert doctables.render(text) == text, "run: python -m tests.fixtures.doctables"
    broken = text.replace("| `probe_timeout` | 30 |", "| `probe_timeout` | 31 |")
    assert broken != text and doctables.render(broken) == text


def test_every_declared_key_is_in_one_docs_table() -> None:
    rows = "".join(_doc_tables())
    for mode in ("ops", "layers", "numerics"):
        for key in known_keys(mode):
            assert f"| `{key}` |" in rows, (mode, key)
