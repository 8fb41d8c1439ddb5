"""Dumps and their offline comparison, in-process: layout, inputs gate, schema diff, numbers, errors, options."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from ci_runner import errors
from ci_runner.config import load_matrix_text
from ci_runner.cli import cmd_compare as compare_command
from ci_runner.modes.numerics.compare import compare_dumps, format_comparison
from ci_runner.modes.numerics.dumps import (
    DumpInputsMismatch,
    DumpSide,
    dump_entry,
    dump_model,
    entry_name,
    input_hash,
    load_dump,
    prepare_folder,
    split_inputs,
)
from ci_runner.errors import ConfigError, InputError, UsageError
from ci_runner.options import ToolboxOptions
from ci_runner.registry import parse_options as parse
from tests.fixtures.matrices import matrix_text
from tests.fixtures.plugin_toolbox_models import TinyNet, base

MATRIX = matrix_text(
    inputs={"samples": 2},
    models=[{"id": "net", "factory": "tests.fixtures.plugin_toolbox_models:base"},
            {"id": "net-renamed", "factory": "tests.fixtures.plugin_toolbox_models:renamed"},
            {"id": "net-reshaped", "factory": "tests.fixtures.plugin_toolbox_models:reshaped"}],
    backends=[{"id": "eager", "device": "cpu"},
              {"id": "gelu-off", "compile": "tests.fixtures.plugin_toolbox_perturb:make",
               "backend_options": {"op": "aten.gelu.default", "scale": 0.05}}],
)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("m")
    (d / "m.yaml").write_text(MATRIX)
    return load_matrix_text(MATRIX, path=str(d / "m.yaml"))


@pytest.fixture(scope="module")
def ref_dump(matrix, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("ref") / "dump"
    dump_entry(matrix, "net", out, reference_id="cpu-fp64")
    return out


def _side(role: str = "reference", dtype: str = "float32") -> DumpSide:
    return DumpSide(role=role, id="x", device="cpu", dtype=dtype)


def _dump(tmp_path: Path, name: str, module: torch.nn.Module, x: torch.Tensor) -> Path:
    out = tmp_path / name
    dump_model(module, {"x": x}, out, side=_side(), model={"id": "net"})
    return out


# --------------------------------------------------------------------------------------------- names, hashes

def test_entry_names_are_semantic() -> None:
    assert entry_name("model.layers.0.mlp", 0, "") == "model.layers.0.mlp"
    assert entry_name("model.norm", 1, "") == "model.norm#1"
    assert entry_name("", 0, "logits") == "(root)[logits]"
    assert entry_name("model.layers.0.self_attn", 0, "0") == "model.layers.0.self_attn[0]"


def test_input_hash_sees_values_dtype_shape_and_other_arguments() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    h = input_hash({"x": x}, {"use_cache": False})
    assert h == input_hash({"x": x.clone()}, {"use_cache": False})
    y = x.clone()
    y[1, 2] = 5.000001
    assert h != input_hash({"x": y}, {"use_cache": False})
    assert h != input_hash({"x": x.double()}, {"use_cache": False})
    assert h != input_hash({"x": x.reshape(3, 2)}, {"use_cache": False})
    assert h != input_hash({"x": x}, {"use_cache": True})
    tensors, other = split_inputs({"x": x, "pair": (x, x), "flag": None})
    assert sorted(tensors) == ["pair.0", "pair.1", "x"] and other == {"flag": None}


# --------------------------------------------------------------------------------------------- writing

def test_dump_layout_streams_chunks_and_records_every_call(tmp_path: Path) -> None:
    model, inputs = base(seed=0)
    x = inputs(0)["x"]
    out = tmp_path / "d"
    dump_model(model, {"x": x}, out, side=_side(), model={"id": "net"}, chunk_mb=0.0001)  # ~100 bytes per chunk
    files = sorted(p.name for p in out.iterdir())
    assert "manifest.json" in files and "inputs.safetensors" in files and "index.json" in files
    chunks = [f for f in files if f.startswith("layers-")]
    assert len(chunks) > 3, "tensors are streamed into several chunks, not held until the end"
    dump = load_dump(out)
    names = [e.name for e in dump.entries]
    assert names == ["embed", "block.fc1", "block.act", "block.fc2", "block", "norm", "head", "(root)"]
    assert [e.order for e in dump.entries] == sorted(e.order for e in dump.entries)
    with torch.no_grad():
        expected = model.block.fc1(model.embed(x))
    assert torch.equal(dump.tensor(dump.by_name["block.fc1"]), expected)
    m = dump.manifest
    assert m["input"]["hash"] == input_hash({"x": x}, {})
    assert m["side"]["capture"] == "eager" and m["env"]["host"]
    assert torch.equal(dump.inputs()["x"], x)


def test_compiled_dump_observes_the_backends_own_outputs(tmp_path: Path) -> None:
    from ci_runner.backends import resolve_backend
    from ci_runner.config import BackendSpec
    from types import MappingProxyType

    model, inputs = base(seed=0)
    x = inputs(0)["x"]
    backend = resolve_backend(BackendSpec(id="off", compile="tests.fixtures.plugin_toolbox_perturb:make",
                                          backend_options=MappingProxyType({"op": "aten.gelu.default", "scale": 0.05})))
    out = tmp_path / "t"
    dump_model(model, {"x": x}, out, side=DumpSide(role="target", id="off", device="cpu", dtype="float32"),
               backend=backend, model={"id": "net"})
    dump = load_dump(out)
    assert dump.side["capture"] == "compiled"
    with torch.no_grad():
        h = model.block.fc1(model.embed(x))
        act = torch.nn.functional.gelu(h)
    got = dump.tensor(dump.by_name["block.act"])
    assert torch.allclose(got, act * 1.05, rtol=1e-5), "the dump holds the backend's (perturbed) activation"
    assert torch.allclose(dump.tensor(dump.by_name["block.fc1"]), h, rtol=1e-6)


def test_prepare_folder_refuses_a_folder_that_is_not_a_dump(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not empty and not a dump"):
        prepare_folder(tmp_path)
    assert (tmp_path / "notes.txt").exists()
    model, inputs = base()
    again = _dump(tmp_path, "d", model, inputs(0)["x"])
    _dump(tmp_path, "d", model, inputs(1)["x"])  # a previous dump is replaced
    assert load_dump(again).manifest["input"]["hash"] == input_hash({"x": inputs(1)["x"]}, {})


# --------------------------------------------------------------------------------------------- reading errors

def test_missing_or_corrupt_manifest_is_an_input_error_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such dump folder"):
        load_dump(tmp_path / "nope")
    (tmp_path / "half").mkdir()
    with pytest.raises(InputError, match=r"half/manifest.json: missing") as exc:
        load_dump(tmp_path / "half")
    assert exc.value.exit_code == errors.EXIT_INPUT
    model, inputs = base()
    d = _dump(tmp_path, "d", model, inputs(0)["x"])
    text = (d / "manifest.json").read_text()
    (d / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(InputError, match=r"manifest.json:\d+:\d+: dump manifest is not valid JSON"):
        load_dump(d)
    data = json.loads(text)
    del data["entries"][2]["shape"]
    (d / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match=r"entries\[2\] lacks shape"):
        load_dump(d)
    data = json.loads(text)
    data["schema_version"] = 99
    (d / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match="schema_version 99"):
        load_dump(d)


def test_a_missing_or_truncated_chunk_is_an_input_error(tmp_path: Path) -> None:
    model, inputs = base()
    d = _dump(tmp_path, "d", model, inputs(0)["x"])
    chunk = d / "layers-00000.safetensors"
    data = chunk.read_bytes()
    chunk.unlink()
    with pytest.raises(InputError, match="layers-00000.safetensors: missing"):
        load_dump(d)
    chunk.write_bytes(data[:20])
    dump = load_dump(d)
    with pytest.raises(InputError, match="not a readable safetensors file"):
        dump.tensor(dump.entries[0])


# --------------------------------------------------------------------------------------------- comparing

def test_compare_inputs_first_then_schema_then_numbers(tmp_path: Path) -> None:
    model, inputs = base()
    x = inputs(0)["x"]
    a = _dump(tmp_path, "a", model, x)
    with torch.no_grad():
        model.block.fc2.weight[0, 0] += 0.5  # a wrong weight in the block's second projection
    b = _dump(tmp_path, "b", model, x)
    cmp = compare_dumps(load_dump(a), load_dump(b))
    assert cmp.inputs["status"] == "identical"
    assert cmp.schema.ok
    assert cmp.first_divergent == "block.fc2"
    by = {r["name"]: r for r in cmp.rows}
    assert by["embed"]["severity"] == "exact" and by["block.act"]["severity"] == "exact"
    assert by["block.fc2"]["flagged"] and by["block.fc2"]["severity"] in ("diverged", "broken")
    assert not cmp.ok
    text = format_comparison(cmp)
    assert text.index("inputs: identical") < text.index("schema: ok") < text.index("block.fc2")
    assert "first divergent layer: block.fc2 (Linear)" in text
    doc = cmp.to_json()
    json.dumps(doc, allow_nan=False)
    assert doc["first_divergent"] == "block.fc2" and doc["layers"][0]["name"] == "embed"
    moved = shutil.copytree(b, tmp_path / "elsewhere" / "b")  # as if fetched from another machine's artifact
    shutil.rmtree(b)
    assert compare_dumps(load_dump(a), load_dump(moved)).first_divergent == "block.fc2"


def test_mismatched_inputs_stop_the_comparison(tmp_path: Path) -> None:
    model, inputs = base()
    a = _dump(tmp_path, "a", model, inputs(0)["x"])
    b = _dump(tmp_path, "b", model, inputs(1)["x"])
    with pytest.raises(DumpInputsMismatch, match=r"inputs differ: x: first difference at \[0, 0, 0\]") as exc:
        compare_dumps(load_dump(a), load_dump(b))
    assert exc.value.exit_code == errors.EXIT_INPUT
    assert "same --sample" in (exc.value.hint or "")
    c = _dump(tmp_path, "c", model, inputs(0)["x"][:1])
    with pytest.raises(DumpInputsMismatch, match=r"x has shape \[2, 5, 8\] in the reference and \[1, 5, 8\]"):
        compare_dumps(load_dump(a), load_dump(c))


def test_inputs_that_differ_only_by_a_cast_are_equivalent(tmp_path: Path) -> None:
    model, inputs = base()
    x = inputs(0)["x"]
    a = tmp_path / "a"
    dump_model(model.double(), {"x": x.double()}, a, side=_side(dtype="float64"))
    b = _dump(tmp_path, "b", model.float(), x)
    cmp = compare_dumps(load_dump(a), load_dump(b), fail_on="drift")
    assert cmp.inputs["status"] == "equivalent" and "float64 vs float32" in cmp.inputs["note"]
    assert cmp.schema.ok and len(cmp.schema.dtype_mismatch) == 8
    assert all(r["severity"] in ("exact", "close") for r in cmp.rows), "float32 vs float64 is rounding noise"
    assert cmp.ok


def test_schema_diff_names_renamed_and_reshaped_tensors(matrix, tmp_path: Path, ref_dump: Path) -> None:  # type: ignore[no-untyped-def]
    ren = tmp_path / "ren"
    dump_entry(matrix, "net-renamed", ren)
    cmp = compare_dumps(load_dump(ref_dump), load_dump(ren))
    assert cmp.schema.only_ref == ["block.fc2"] and cmp.schema.only_target == ["block.proj"]
    assert not cmp.schema.ok and not cmp.ok
    text = format_comparison(cmp)
    assert text.index("only in reference") < text.index("block.proj") < text.index("layer ")
    res = tmp_path / "res"
    dump_entry(matrix, "net-reshaped", res)
    cmp = compare_dumps(load_dump(ref_dump), load_dump(res))
    assert [d["name"] for d in cmp.schema.shape_mismatch] == ["block.fc1", "block.act"]
    assert cmp.schema.shape_mismatch[0] == {"name": "block.fc1", "reference": [2, 5, 16], "target": [2, 5, 12]}
    assert "block.fc1" not in {r["name"] for r in cmp.rows}, "no numbers for tensors of different shapes"
    assert any("fingerprints differ" in w for w in cmp.warnings)


def test_thresholds_table_flags_what_exceeds_each_layers_threshold(tmp_path: Path) -> None:
    from ci_runner.modes.numerics.thresholds import LayerStats, ThresholdOptions, ThresholdTable

    model, inputs = base()
    x = inputs(0)["x"]
    a = _dump(tmp_path, "a", model, x)
    with torch.no_grad():
        model.norm.bias[0] += 1e-4  # drift that the fixed severities call close, a tight threshold does not
    b = _dump(tmp_path, "b", model, x)
    stats = {"norm": LayerStats(module_class="LayerNorm", name="norm")}
    stats["norm"].add("cumulative", {"rel": 1e-9, "cos": 1.0, "mad": 1e-10, "ref_absmean": 1.0})
    table = ThresholdTable(layers=stats, options=ThresholdOptions(), primary_dtype="float32", key={})
    loose = compare_dumps(load_dump(a), load_dump(b))
    assert loose.first_divergent is None
    tight = compare_dumps(load_dump(a), load_dump(b), thresholds=table)
    assert tight.first_divergent == "norm"
    assert "rel" in next(r for r in tight.rows if r["name"] == "norm")["exceeded"]


def test_compare_command_exit_codes_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, inputs = base()
    x = inputs(0)["x"]
    a = _dump(tmp_path, "a", model, x)
    b = _dump(tmp_path, "b", model, x)
    ns = argparse.Namespace(ref_dump=str(a), target_dump=str(b), json=str(tmp_path / "c.json"))
    assert compare_command(ns) == errors.EXIT_OK
    assert json.loads((tmp_path / "c.json").read_text())["ok"] is True
    with torch.no_grad():
        model.head.weight.mul_(2.0)
    c = _dump(tmp_path, "c", model, x)
    assert compare_command(argparse.Namespace(ref_dump=str(a), target_dump=str(c), json=None)) == errors.EXIT_FINDINGS
    assert "first divergent layer: head (Linear)" in capsys.readouterr().out
    with pytest.raises(UsageError):
        compare_dumps(load_dump(a), load_dump(c), fail_on="sometimes")


# --------------------------------------------------------------------------------------------- options

def test_toolbox_options_are_split_from_the_numerics_options() -> None:
    opts = parse("numerics", {"margin": 4, "batch_invariance": True, "batch_slots": 3,
                              "reference_dump": "/d/ref", "bisect": True, "bisect_method": "nodes"})
    tb = opts.toolbox
    assert opts.thresholds.margin == 4
    assert tb == ToolboxOptions(batch_invariance=True, batch_slots=3, reference_dump=("/d/ref",), bisect=True,
                                bisect_method="nodes")
    assert parse("numerics", {}).toolbox.weights_check is True
    for bad in ({"weights_check": "yes"}, {"batch_slots": 1}, {"bisect_method": "magic"}, {"reference_dump": []},
                {"bisect_timeout": "soon"}):
        with pytest.raises(ConfigError):
            parse("numerics", bad)


def test_tiny_net_fixture_is_deterministic() -> None:
    a, ia = base(seed=3)
    b, ib = base(seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert torch.equal(ia(1)["x"], ib(1)["x"]) and isinstance(a, TinyNet)


def test_one_chunk_reader_keeps_at_most_two_files_open_and_names_a_missing_tensor(tmp_path: Path) -> None:
    """`store.ChunkFiles` is the chunk reader of both dump formats (`DumpReader`, `dumps.Dump`): least recently
    used files are dropped, complex tensors come back complex, a chunk without the tensor is an InputError."""
    from safetensors.torch import save_file

    from ci_runner.modes.numerics.store import ChunkFiles

    for i in range(3):
        save_file({f"t{i}": torch.full((2,), float(i)), f"z{i}c": torch.ones(2, 2)}, str(tmp_path / f"c{i}.safetensors"))
    chunks = ChunkFiles(tmp_path, listed_in="index.json", max_open=2)
    for i in (0, 1, 2, 0):
        assert torch.equal(chunks.tensor(f"c{i}.safetensors", f"t{i}"), torch.full((2,), float(i)))
        assert chunks.open_count <= 2
    assert chunks.tensor("c1.safetensors", "z1c").dtype == torch.complex64
    with pytest.raises(InputError, match=r"c2.safetensors: no tensor 't0' for entry 'x'"):
        chunks.tensor("c2.safetensors", "t0", what="entry 'x'")
    with pytest.raises(InputError, match=r"c9.safetensors: missing \(listed in .*index.json\)"):
        chunks.tensor("c9.safetensors", "t0")


def test_compare_without_thresholds_explains_them_and_derive_holds_each_layer(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A small drift passes the fixed bands: the text says so, with a legend and both ways to get thresholds;
    `--derive` from a float64 reference of the same input holds every layer to its own threshold and flags it."""
    from ci_runner.cli import main

    model, inputs = base()
    x = inputs(0)["x"]
    a = _dump(tmp_path, "a", model, x)
    second = tmp_path / "a64"
    dump_model(copy_module(model).double(), {"x": x.double()}, second, side=_side(dtype="float64"), model={"id": "net"})
    with torch.no_grad():
        model.block.fc2.weight.mul_(1.0005)  # drift: far past float32 noise, far below the fixed `diverged` band
    b = _dump(tmp_path, "b", model, x)
    assert main(["compare", str(a), str(b)]) == errors.EXIT_OK
    out = capsys.readouterr().out
    assert "flags: = bit-identical · ✓ noise (cos ≥ 0.99999, rel ≤ 0.0001) · ? drift" in out and "✗✗ broken" in out
    assert "note: no thresholds" in out
    assert "--thresholds OUT/thresholds/net-<key>.json" in out and "--select 'net@*' --modes numerics" in out
    assert f"--derive SECOND_REF_DUMP" in out and "dump --model net --reference cpu-fp64" in out
    assert main(["compare", str(a), str(b), "--derive", str(second)]) == errors.EXIT_FINDINGS
    out = capsys.readouterr().out
    assert "first divergent layer: block.fc2 (Linear)" in out and "over threshold" in out
    assert f"derived from {a} and {second}" in out and "note: no thresholds" not in out


def copy_module(module: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(module)
