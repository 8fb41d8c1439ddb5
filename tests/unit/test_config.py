"""Matrix loading: every bad input is one ConfigError naming file, line:col, key path and the fix."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ci_runner.config import DEFAULT_REFERENCES, load_matrix, load_matrix_text
from ci_runner.errors import ConfigError

pytestmark = pytest.mark.oldtorch  # the old-torch subset (tests/fixtures/oldtorch.py)

GOOD = textwrap.dedent(
    """\
    version: 1
    defaults:
      modes: [ops, numerics]
      timeout: 120
      inputs: {batch: 1, seq_len: 16, samples: 2, seed: 3}
    models:
      - id: tiny-llama
        config: llama
        overrides: {hidden_size: 32}
      - {id: local, path: ./models/x}
      - {id: hubbed, hub: org/name, revision: abc123}
      - {id: custom, factory: "my_pkg.models:build"}
    backends:
      - {id: inductor, compile: inductor, device: cpu}
      - id: vendor
        compile: "my_pkg.backend:compile_fn"
        import: [my_pkg]
        env: {VENDOR_FLAG: 1, "ON": true}
        runs-on: [self-hosted, vendor-card]
    exclude:
      - {model: local, backend: vendor}
    """
)


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "matrix.yaml"
    p.write_text(text, encoding="utf-8")
    return p


def test_good_matrix_resolves_defaults_and_paths(tmp_path: Path) -> None:
    m = load_matrix(write(tmp_path, GOOD))
    assert m.modes == ("ops", "numerics")
    assert m.timeout == 120.0
    assert m.inputs.seq_len == 16 and m.inputs.seed == 3 and m.inputs.batch == 1
    assert m.references == DEFAULT_REFERENCES
    assert [x.id for x in m.models] == ["tiny-llama", "local", "hubbed", "custom"]
    assert m.model("local").path == str((tmp_path / "models" / "x").resolve())
    assert m.model("hubbed").source == "hub:org/name@abc123"
    vendor = m.backend("vendor")
    assert vendor.imports == ("my_pkg",)
    assert dict(vendor.env) == {"VENDOR_FLAG": "1", "ON": "true"}
    assert vendor.runs_on == ("self-hosted", "vendor-card")
    assert m.backend("inductor").runs_on == ("ubuntu-latest",)


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        (GOOD.replace("  timeout: 120", "  timeuot: 120"), [":4:3:", "defaults.timeuot", "unknown key 'timeuot'", "did you mean 'timeout'"]),
        (GOOD.replace("    config: llama", "    confg: llama"), ["models[0].confg", "did you mean 'config'"]),
        (GOOD.replace("version: 1", "version: 2"), [":1:10:", "version"]),
        (GOOD.replace("modes: [ops, numerics]", "modes: [ops, numerix]"), ["defaults.modes[1]", "did you mean 'numerics'"]),
        (GOOD + "  - {model: nope, backend: vendor}\n", ["exclude[1].model", "'nope' matches no model", "known:"]),
        (GOOD.replace("{id: local, path: ./models/x}", "{id: local, path: ./models/x, hub: a/b}"), ["models[1]", "exactly one source"]),
        (GOOD.replace("- {id: custom", "- {id: tiny-llama"), ["duplicate id 'tiny-llama'"]),
        ("version: 1\nmodels: [\n", ["invalid YAML", ":3:1:"]),
        (GOOD.replace('"ON": true', "ON: true"), ["key 'ON'", "not read as a string", 'quote it: "ON"']),
        ("version: 1\nversion: 1\n", ["duplicate key 'version'", ":2:1:"]),
        ("- just\n- a list\n", ["must be a mapping"]),
        ("", ["must be a mapping"]),
    ],
)
def test_bad_matrices_name_the_place_and_the_fix(tmp_path: Path, text: str, expect: list[str]) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_matrix(path)
    msg = str(info.value)
    assert str(path) in msg
    for needle in expect:
        assert needle in msg, (needle, msg)
    assert info.value.exit_code == 2


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="matrix file not found"):
        load_matrix(tmp_path / "nope.yaml")


def test_unsafe_yaml_tags_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_matrix(write(tmp_path, "version: !!python/object/apply:os.system ['true']\n"))


yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=8), st.floats(allow_nan=True))
yaml_values = st.recursive(
    yaml_scalars,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)),
    max_leaves=20,
)
keys = st.sampled_from(["version", "models", "backends", "defaults", "exclude", "include", "references", "id", "config", "compile"])
mappings = st.dictionaries(keys, yaml_values, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=200))
def test_arbitrary_text_yields_a_matrix_or_a_config_error(text: str) -> None:
    try:
        load_matrix_text(text)
    except ConfigError:
        pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mappings)
def test_arbitrary_mappings_yield_a_matrix_or_a_config_error(data: dict) -> None:
    try:
        text = yaml.safe_dump(data)
    except yaml.YAMLError:
        return
    try:
        load_matrix_text(text)
    except ConfigError:
        pass


def test_at_most_ten_problems_are_listed(tmp_path: Path) -> None:
    bad = "".join(f"  - id: m{i}\n    hub: x/y\n    bogus{i}: 1\n" for i in range(14))
    with pytest.raises(ConfigError) as exc:
        load_matrix_text("version: 1\nbackends:\n  - id: inductor\nmodels:\n" + bad)
    text = str(exc.value)
    assert "14 problems in the matrix" in text and "… and 4 more" in text
    assert text.count("unknown key 'bogus") == 10


def test_every_bad_options_block_is_named_at_once(tmp_path):  # type: ignore[no-untyped-def]
    import pytest

    from ci_runner.config import load_matrix
    from ci_runner.errors import ConfigError

    path = tmp_path / "m.yaml"
    path.write_text("version: 1\ndefaults:\n  options: {numerics: {margn: 8}}\n"
                    "models: [{id: a, config: llama, options: {ops: {wrkers: 2}}}]\n"
                    "backends: [{id: b, compile: inductor}]\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_matrix(path)
    text = str(info.value)
    assert f"{path}: 2 problems in the matrix:" in text
    assert f"{path}:3:24:" in text and "did you mean 'margin'" in text
    assert f"{path}:4:" in text and "wrkers" in text


def test_schema_option_and_phase_mistakes_come_in_one_error(tmp_path: Path) -> None:
    """The schema's mistakes do not hide the options' and phases' (nor the phases' second one): one error, all six;
    a block the schema rejected is named once, by the schema."""
    path = tmp_path / "m.yaml"
    path.write_text("version: 1\n"
                    "defaults:\n  inputs: {phases: [prefil, {decod: {}}]}\n"
                    "models:\n  - {id: a, config: llama, colour: red, options: {ops: {wrkers: 2}}}\n"
                    "  - {id: c, config: llama, options: {ops: 3}}\n"
                    "backends:\n  - {id: b, compile: inductor, inputs: {phases: [lng]}}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_matrix(path)
    text = str(info.value)
    assert f"{path}: 6 problems in the matrix:" in text, text
    for line in (f"{path}:5:28: models[0].colour: unknown key 'colour'",
                 f"{path}:6:43: models[1].options.ops: 3 is not of type 'object'",
                 f"{path}:5:57: models[0].options.ops: unknown option 'wrkers'",
                 f"{path}:3:21: defaults.inputs.phases[0]: unknown phase 'prefil'",
                 f"{path}:3:29: defaults.inputs.phases[1]: unknown phase 'decod'",
                 f"{path}:8:50: backends[0].inputs.phases[0]: unknown phase 'lng'"):
        assert f"  {line}" in text, (line, text)
    assert text.count("models[1].options.ops") == 1


def test_a_duplicate_id_is_listed_with_the_other_problems(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("version: 1\ndefaults:\n  inputs: {phases: [prefil]}\nmodels:\n  - {id: m, config: llama}\n"
                    "  - {id: m, config: llama}\nbackends:\n  - {id: b, compile: aot_eager}\n")
    with pytest.raises(ConfigError) as err:
        load_matrix(path)
    text = str(err.value)
    assert "2 problems in the matrix" in text and "models[1].id: duplicate id 'm'" in text and "'prefil'" in text
