"""The mode registry (`ci_runner/registry.py`) is the one list of modes and finding kinds: the schema files, the
options, the report and the issue grouping all derive from it."""

from __future__ import annotations

import importlib.util

import pytest

from ci_runner.log import STATUS_MARK
from ci_runner.registry import (
    SECTION_DIVERGENT,
    SECTION_LAYERS,
    SECTION_OPS,
    SECTION_OTHER,
    FindingKind,
    KindSpec,
    ModeSpec,
    apply_to_schema,
    default_mode_names,
    group_order,
    kind_names,
    kinds_filed_as,
    kinds_in,
    mode_names,
    mode_of_group,
    modes,
    options_class,
    register_mode,
)
from ci_runner.results.model import CELL_STATUSES, schema, schema_file


@pytest.mark.parametrize("name", ["matrix.schema.json", "results.schema.json", "baseline.schema.json"])
def test_the_schema_files_hold_the_registrys_lists(name: str) -> None:
    """The files' `$defs` lists are what the registry generates (edit `registry.py`, then regenerate the file)."""
    text = schema_file(name)
    assert apply_to_schema(text) == text, f"ci_runner/schemas/{name}: $defs mode_name/mode_options/finding_kind differ from ci_runner/registry.py"


def test_every_mode_list_in_the_schemas_is_a_ref_to_the_one_definition() -> None:
    """No mode name or kind is written outside `$defs`: 6 places in the matrix schema, 2 in the results schema."""
    def refs(node: object, target: str) -> int:
        if isinstance(node, dict):
            return (node.get("$ref") == target) + sum(refs(v, target) for v in node.values())
        return sum(refs(v, target) for v in node) if isinstance(node, list) else 0

    matrix, results = schema_file("matrix.schema.json"), schema_file("results.schema.json")
    assert refs(matrix, "#/$defs/mode_name") == 3 and refs(matrix, "#/$defs/mode_options") == 3
    assert refs(results, "#/$defs/mode_name") == 1 and refs(results, "#/$defs/finding_kind") == 1
    for name, doc in (("matrix", matrix), ("results", results)):
        body = {k: v for k, v in doc.items() if k != "$defs"}
        defs = {k: v for k, v in doc.get("$defs", {}).items() if k not in ("mode_name", "mode_options", "finding_kind")}
        assert '"numerics"' not in repr(body).replace("'", '"') + repr(defs).replace("'", '"'), name


def test_built_in_modes_kinds_and_derived_tables() -> None:
    assert mode_names() == ("ops", "layers", "numerics", "compile", "memory")
    assert default_mode_names() == ("ops", "layers", "numerics")  # compile and memory run where a matrix names them
    assert set(kind_names()) == {k.value for k in FindingKind}
    assert kinds_in(SECTION_OPS) == {"unsupported_op", "op_error", "op_mismatch"}
    assert kinds_in(SECTION_LAYERS) == {"layer_failure"} and kinds_in(SECTION_DIVERGENT) == {"divergence"}
    assert kinds_in(SECTION_OTHER) == {"weights_mismatch", "batch_variance", "output_overwritten", "graph_break",
                                       "eager_fallback", "compile_after_warmup", "length_sweep_graphs",
                                       "recompile_limit", "graph_count", "memory_oom", "memory_regression",
                                       "memory_over_budget"}
    assert kinds_filed_as("op") == kinds_in(SECTION_OPS)
    assert mode_of_group() == {"op": "ops", "culprit": "layers", "layer": "layers", "divergence": "numerics",
                               "graph_break": "compile", "memory": "memory"}
    assert list(group_order()) == ["op", "culprit", "layer", "divergence", "graph_break", "memory"]
    for spec in modes():
        module, _, fn = spec.run.partition(":")
        assert importlib.util.find_spec(module) is not None and fn, spec.run
        assert options_class(spec.name) is spec.options


def test_a_kind_is_a_plain_string_where_it_is_read() -> None:
    assert "divergence" in {FindingKind.DIVERGENCE} and FindingKind.OP_ERROR == "op_error"
    assert f"{FindingKind.OP_ERROR}" == "op_error" and str(FindingKind.OP_ERROR) == "op_error"
    assert schema("results.schema.json")["$defs"]["finding_kind"]["enum"] == list(kind_names())


def test_a_kind_belongs_to_one_mode() -> None:
    with pytest.raises(ValueError, match="already belong to mode 'numerics'"):
        register_mode(ModeSpec(name="twin", run="x:run", options=object, order=50,
                               kinds=(KindSpec(kind=FindingKind.DIVERGENCE, key="module"),)))
    assert "twin" not in mode_names()


def test_every_status_has_a_log_mark() -> None:
    assert set(STATUS_MARK) == set(CELL_STATUSES)


def test_issue_groups_are_declared_with_their_template_title_and_key() -> None:
    from ci_runner.registry import IssueGroup, issue_group

    assert issue_group("op") is not None and issue_group("op").always and issue_group("op").fields == {"op": 2}
    assert issue_group("memory").template == "issue_memory.md.j2"
    assert issue_group("layer").title_of(("layer", "b", "m", "model.x")) == "[deepview-ci] model.x of m fails on b"
    culprit = {"details": {"culprit": {"found": True, "kind": "single", "ops": ["aten.sin.default"]}}}
    assert issue_group("layer").key_of("b", "m", culprit, "model.x") == ("culprit", "b", "aten.sin.default")
    assert issue_group("layer").key_of("b", "m", {}, "model.x") == ("layer", "b", "m", "model.x")
    assert issue_group("nobody") is None
    bare = ModeSpec(name="bare", run="x:run", options=object, order=99, kinds=(), issue_groups=("bare",))
    assert bare.issue_groups == (IssueGroup(name="bare"),) and bare.group_names == ("bare",)  # a name: the defaults
    assert bare.issue_groups[0].template == "issue_generic.md.j2" and bare.issue_groups[0].key_of("b", "m", {}, "") is None


def test_report_hooks_are_named_by_reference_and_loaded_in_mode_order() -> None:
    from ci_runner.registry import ModeHooks, layer_table_modes, load_ref, mode_hooks

    names = [n for n, _ in mode_hooks()]
    assert names == [m.name for m in modes() if m.report] and {"numerics", "compile", "memory"} <= set(names)
    for _, hooks in mode_hooks():
        assert isinstance(hooks, ModeHooks)
    assert layer_table_modes() == ("numerics",)
    assert load_ref("ci_runner.registry:ModeHooks") is ModeHooks
    with pytest.raises(ValueError, match="module:attribute"):
        load_ref("ci_runner.registry")
