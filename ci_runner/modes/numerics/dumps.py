"""Per-layer dumps of one model on one device/backend, and their offline comparison.

In real CI the reference (a CPU or GPU runner) and the target (the accelerator runner) are different machines, so
each side dumps its per-layer outputs and `compare` reads both dumps later, anywhere:

    deepview-ci dump --matrix M --model tiny-llama --reference cpu-fp64 --out ref/      # on the reference runner
    deepview-ci dump --matrix M --model tiny-llama --backend vendor --out tgt/          # on the accelerator runner
    deepview-ci compare ref/ tgt/ [--json cmp.json] [--thresholds T.json]               # anywhere

The comparison follows the dump-bisect discipline, in this order, each step a gate for the next:

1. **Inputs**: the two dumps must have run the same input (sha256 of the input tensors' names, dtypes, shapes and
   bytes). Different inputs stop the comparison (`DumpInputsMismatch`, exit 3) with the first differing value:
   comparing layers of different inputs is the most common false trail. Floating inputs that differ only by a
   dtype cast (a float64 reference fed the float32 input upcast) count as equivalent and say so.
2. **Schema diff**: entry names, shapes and dtypes: only in the reference, only in the target, shape mismatches.
   A renamed or reshaped tensor shows here, before any number (a loader bug masquerades as a forward bug).
   A dtype difference is listed but still compared (in float64) when both sides are floating point.
3. **Per-layer table**: `metrics.compare_tensors` (float64: rel, cos, mad, max_abs, sqnr) per entry in the
   reference's completion order, with `metrics.severity`; with `--thresholds` (a numerics thresholds file) each
   entry is also held to its layer's data-derived threshold. The first flagged entry is the first divergent layer.

Dump layout (one folder; every file written atomically or before the manifest, which is written last, so a dump
cut short has no manifest and is refused):

================================  ==============================================================================
`manifest.json`                   `format`, `schema_version`, model id + fingerprint, the input (hash, tensor
                                  specs, non-tensor kwargs), env stamp (torch, backend versions, device, host),
                                  the side (reference or backend id, device, dtype, capture), and `entries`: one
                                  per compared output tensor of each module call: `name` (semantic:
                                  `model.layers.0.mlp`, `…#1` for a module's second call, `…[0]` for a tuple
                                  element), `module`, `module_class`, `call_index`, `shape`, `dtype`, `file`,
                                  `tensor` (its key in that file), `order` (completion order)
`inputs.safetensors`              the model's input tensors, so `compare` proves the inputs identical
`layers-00000.safetensors`, …     the outputs, streamed in chunks of at most `chunk_mb` (never every layer in
                                  memory; a compiled target holds one compiled graph's outputs, as the numerics
                                  mode's cumulative view does)
`index.json`                      the numerics mode's call index (`store.DumpReader`): for eager dumps
                                  every call's inputs too, so the numerics mode can consume a reference dump
                                  (`options.numerics.reference_dump`) instead of running the reference itself
================================  ==============================================================================

Loading uses safetensors and JSON only, never pickle. A missing or corrupt manifest or chunk is an `InputError`
(exit 3) that names the file and what is wrong. The comparison lives in `compare.py`; the `dump` and `compare`
commands in `ci_runner/cli.py`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

from ...watch.capture import iter_tensors
from ...engine.codec import dtype_name, save_tensors
from ...config import choices_hint, raw_entry
from ...engine.envinfo import cell_stamp
from ...backends import resolve_backend
from ...errors import ConfigError, InputError, UsageError
from ...jsontext import parse_json
from ...fsutil import atomic_write_json
from ...models.load import build_inputs, load_model, model_fingerprint
from ...models.tree import map_tensors
from .capture import RecordingSink, capture_layer_outputs
from .store import ChunkFiles, DumpWriter
from .watched import watched_outputs

if TYPE_CHECKING:
    from ...backends import Backend
    from ...config import InputSpec, Matrix, ModelSpec, Reference

DUMP_FORMAT = "deepview-ci-dump"
MANIFEST_SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
INPUTS_NAME = "inputs.safetensors"
INDEX_NAME = "index.json"
CHUNK_PREFIX = "layers-"


class DumpInputsMismatch(InputError):
    """The two dumps were not made on the same input: their layers cannot be compared."""


# ============================================================================================ names and hashes

def entry_name(module: str, call_index: int, sub: str) -> str:
    """`model.layers.0.mlp`, `model.norm#1` (second call), `(root)[logits]` (a named part of the output)."""
    base = module or "(root)"
    if call_index:
        base += f"#{call_index}"
    return f"{base}[{sub}]" if sub else base


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of `t` (on CPU; complex as (real, imag) pairs)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _plain(value: Any) -> Any:
    """A JSON-able stand-in for a non-tensor input value (what the hash and the manifest record)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return f"<{type(value).__name__}>"


def split_inputs(kwargs: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors by flat name, non-tensor kwargs as plain data) of a model's keyword inputs."""
    tensors: dict[str, torch.Tensor] = {}
    other: dict[str, Any] = {}
    for key, value in kwargs.items():
        found = list(iter_tensors(value, key))
        if found:
            tensors.update(found)
        else:
            other[key] = _plain(value)
    return tensors, other


def input_hash(tensors: Mapping[str, torch.Tensor], other: Mapping[str, Any]) -> str:
    """sha256 over each input tensor's name, dtype, shape and bytes (sorted by name), then the other kwargs."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}\x1f{str(t.dtype).removeprefix('torch.')}\x1f{list(t.shape)}\x1e".encode())
        h.update(tensor_bytes(t))
    h.update(json.dumps(dict(other), sort_keys=True, default=str).encode())
    return h.hexdigest()


# ============================================================================================ writing

class _LayerWriter(DumpWriter):
    """The numerics mode's streaming writer, with this format's chunk names and a shape/dtype record per tensor."""

    def __init__(self, folder: Path, *, chunk_bytes: int, meta: Mapping[str, Any]) -> None:
        super().__init__(folder, chunk_bytes=chunk_bytes, meta=meta)
        self.tensor_meta: dict[str, tuple[list[int], str]] = {}

    def put(self, t: torch.Tensor) -> str:
        key = super().put(t)
        if key not in self.tensor_meta:
            self.tensor_meta[key] = (list(t.shape), dtype_name(t.dtype))
        return key

    index_name = INDEX_NAME

    def chunk_name(self, i: int) -> str:
        return f"{CHUNK_PREFIX}{i:05d}.safetensors"

    def is_own_file(self, name: str) -> bool:
        return _is_dump_name(name)


def _is_dump_name(n: str) -> bool:
    return n in (MANIFEST_NAME, INPUTS_NAME, INDEX_NAME) or (n.startswith(CHUNK_PREFIX) and n.endswith(".safetensors")) \
        or (n.startswith(".") and n.endswith(".tmp"))


def _is_dump_file(p: Path) -> bool:
    return p.is_file() and _is_dump_name(p.name)


def prepare_folder(out: Path) -> None:
    """Make `out` ready for a dump: absent, empty or a previous dump (replaced); anything else is refused."""
    if out.exists():
        if not out.is_dir():
            raise UsageError(f"{out}: exists and is not a folder", hint="give a new or empty folder for the dump")
        strangers = [p.name for p in out.iterdir() if not _is_dump_file(p)]
        if strangers:
            raise UsageError(f"{out}: not empty and not a dump (holds {', '.join(sorted(strangers)[:3])}"
                             f"{' …' if len(strangers) > 3 else ''})",
                             hint="give a new or empty folder; a previous dump folder is replaced")


@dataclass(frozen=True, kw_only=True)
class DumpSide:
    """Which side a dump is: a reference (eager) or a backend, on which device and dtype."""

    role: str  # reference | target
    id: str
    device: str
    dtype: str
    compile: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"role": self.role, "id": self.id, "device": self.device, "dtype": self.dtype, "compile": self.compile}


def dump_model(module: nn.Module, kwargs: Mapping[str, Any], out: Path, *, side: DumpSide,
               backend: "Backend | None" = None, model: Mapping[str, Any] | None = None,
               extra: Mapping[str, Any] | None = None, chunk_mb: float = 64.0) -> Path:
    """Run `module(**kwargs)` once and dump every module call's output tensors into `out`; returns the manifest.

    Without `backend` (or with an eager one) the module runs eagerly on `side.device` (hooks on every submodule,
    each call's inputs and outputs streamed). With a compiling backend the whole model goes through
    `backend.compile`, with forward hooks that Dynamo traces into the graph (the outputs are the backend's own);
    per-call inputs are not observable there and are not stored. That run is watched (`watched.watched_outputs`):
    the manifest's `side.ran` says how the backend ran it, and `not_ran` when it did not (its layers are then
    PyTorch's: `compare` says the comparison tests nothing of the backend).
    """
    out = Path(out)
    prepare_folder(out)
    tensors, other = split_inputs(kwargs)
    digest = input_hash(tensors, other)
    writer = _LayerWriter(out, chunk_bytes=max(1, int(chunk_mb * (1 << 20))),
                          meta={"dump": DUMP_FORMAT, "side": side.as_dict()})
    save_tensors({k: t.detach().cpu().contiguous() if not t.is_complex() else torch.view_as_real(t.detach().cpu()).contiguous()
                  for k, t in tensors.items()}, out / INPUTS_NAME)
    t0 = time.monotonic()
    device = side.device
    compiled = backend is not None and not backend.is_eager
    ran: dict[str, Any] | None = None
    if device != "cpu":
        module = backend.to_device(module) if backend is not None else module.to(device)
        kwargs = map_tensors(lambda t: t.to(device), kwargs)
    if not compiled:
        sink = RecordingSink(writer)
        capture_layer_outputs(module, (), kwargs, sink)
        sink.finish()
    else:
        assert backend is not None
        ran = _dump_compiled(module, backend, kwargs, writer)
    seconds = time.monotonic() - t0
    writer.close()  # index.json: the numerics mode's view of the same files
    return _write_manifest(out, writer, side=side, digest=digest, tensors=tensors, other=other, model=model,
                           extra=extra, capture="compiled" if compiled else "eager", seconds=seconds,
                           backend=backend, ran=ran)



def _dump_compiled(module: nn.Module, backend: "Backend", kwargs: Mapping[str, Any],
                   writer: _LayerWriter) -> dict[str, Any]:
    """The compiled target's outputs into `writer`; how the backend ran it (`watched.CaptureRun.status`: the
    manifest's `side.ran`; `not_ran` when it did not run the model, `no-hooks` when only without hooks)."""
    classes = {name: type(m).__name__ for name, m in module.named_modules()}
    run = watched_outputs(module, backend, (), kwargs)
    records = run.compared()
    run.records = []
    done = 0
    while records:
        key, tensors = records.pop(0)
        name, _, k = key.partition("#")
        writer.calls.append({
            "idx": done, "key": key, "name": name, "module_class": classes.get(name, "?"),
            "call_index": int(k) if k else 0, "parent": None, "depth": 0 if not name else name.count(".") + 1,
            "inputs": None, "inputs_error": "compiled target: per-call inputs are not observable",
            "output": {"__opaque__": "compiled"}, "compare": {sub: writer.put(t) for sub, t in tensors.items()},
            "done": done,
        })
        done += 1
        del tensors
    return run.status()


def _write_manifest(out: Path, writer: _LayerWriter, *, side: DumpSide, digest: str,
                    tensors: Mapping[str, torch.Tensor], other: Mapping[str, Any], model: Mapping[str, Any] | None,
                    extra: Mapping[str, Any] | None, capture: str, seconds: float, backend: "Backend | None",
                    ran: Mapping[str, Any] | None = None) -> Path:
    entries = []
    for call in sorted(writer.calls, key=lambda c: c.get("done", c["idx"])):
        for sub, tkey in (call.get("compare") or {}).items():
            shape, dtype = writer.tensor_meta[tkey]
            entries.append({
                "name": entry_name(call["name"], call["call_index"], sub), "module": call["name"],
                "module_class": call["module_class"], "call_index": call["call_index"], "key": call["key"],
                "sub": sub, "shape": shape, "dtype": dtype,
                "file": writer.chunk_name(writer.tensor_file[tkey]), "tensor": tkey, "order": call.get("done", call["idx"]),
            })
    env = cell_stamp(side.device, backend.versions() if backend is not None else {"torch": torch.__version__})
    env["host"] = platform.node()
    manifest = {
        "format": DUMP_FORMAT,
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": dict(model or {}),
        "side": {**side.as_dict(), "capture": capture, **({"ran": dict(ran)} if ran is not None else {})},
        "input": {"hash": digest, "file": INPUTS_NAME,
                  "tensors": [{"name": k, "shape": list(t.shape), "dtype": dtype_name(t.dtype)} for k, t in tensors.items()],
                  "kwargs": dict(other)},
        "env": env,
        "files": writer.files,
        "bytes": writer.bytes_written,
        "seconds": round(seconds, 3),
        "calls": len(writer.calls),
        "entries": entries,
        **dict(extra or {}),
    }
    return atomic_write_json(out / MANIFEST_NAME, manifest)



# ============================================================================================ dumping a matrix entry

def _cell_for(matrix: "Matrix", model_id: str, backend_id: str | None) -> tuple["ModelSpec", "InputSpec"]:
    spec = matrix.model(model_id)
    inputs = matrix.inputs.merged(raw_entry(matrix, "models", model_id).get("inputs"))
    if backend_id is not None:
        matrix.backend(backend_id)  # ConfigError with "did you mean" when unknown
    return spec, inputs


def _reference(matrix: "Matrix", ref_id: str | None) -> "Reference":
    refs = list(matrix.references)
    if ref_id is None:
        return refs[0]
    for r in refs:
        if r.id == ref_id:
            return r
    raise ConfigError(f"{matrix.path}: no reference with id {ref_id!r}", hint=choices_hint(ref_id, [r.id for r in refs]))


def dump_entry(matrix: "Matrix", model_id: str, out: Path, *, backend_id: str | None = None,
               reference_id: str | None = None, sample: int = 0, chunk_mb: float = 64.0) -> Path:
    """Dump one model of `matrix` on one side: a reference (`reference_id`, default the primary) or a backend.

    A backend dump runs the model in the dtype of `reference_id` (default: the primary reference's), like the
    numerics mode's target. Returns the manifest path.
    """
    spec, inputs = _cell_for(matrix, model_id, backend_id)
    ref = _reference(matrix, reference_id)
    if sample < 0:
        raise UsageError(f"--sample {sample}: must be ≥ 0", hint="samples are numbered from 0")
    backend = None
    if backend_id is not None:
        backend = resolve_backend(matrix.backend(backend_id))
        side = DumpSide(role="target", id=backend_id, device=backend.device, dtype=ref.dtype,
                        compile=backend.spec.compile)
    else:
        side = DumpSide(role="reference", id=ref.id, device=ref.device, dtype=ref.dtype)
    loaded = load_model(spec, seed=inputs.seed, dtype=ref.dtype, device="cpu")
    kwargs = build_inputs(loaded, inputs, sample=sample, device="cpu")
    model = {"id": spec.id, "fingerprint": model_fingerprint(spec)}
    extra = {"sample": sample, "inputs_spec": inputs.key(), "matrix": Path(matrix.path).name}
    return dump_model(loaded.module, kwargs, out, side=side, backend=backend, model=model, extra=extra,
                      chunk_mb=chunk_mb)


# ============================================================================================ reading

@dataclass(frozen=True)
class Entry:
    name: str
    module: str
    module_class: str
    call_index: int
    key: str
    sub: str
    shape: tuple[int, ...]
    dtype: str
    file: str
    tensor: str
    order: int


class Dump:
    """A dump folder, read lazily: the manifest at once, one tensor at a time (`load_dump` to open one)."""

    max_open = 2  # chunk files kept open (memory-mapped): entries are read in order, so memory stays bounded

    def __init__(self, folder: Path, manifest: Mapping[str, Any], entries: list[Entry]) -> None:
        self.folder = folder
        self.manifest = dict(manifest)
        self.entries = entries
        self.by_name = {e.name: e for e in entries}
        self._chunks = ChunkFiles(folder, listed_in=MANIFEST_NAME, max_open=self.max_open)

    @property
    def side(self) -> dict[str, Any]:
        return dict(self.manifest.get("side") or {})

    @property
    def input_hash(self) -> str:
        return str((self.manifest.get("input") or {}).get("hash", ""))

    def label(self) -> str:
        s = self.side
        who = f"{s.get('role', '?')} {s.get('id', '?')}"
        env = self.manifest.get("env") or {}
        return (f"{self.manifest.get('model', {}).get('id', '?')}, {who} on {s.get('device', '?')} "
                f"{s.get('dtype', '?')} ({s.get('capture', '?')}), host {env.get('host', '?')}, "
                f"torch {env.get('torch', '?')}")

    def tensor(self, entry: Entry) -> torch.Tensor:
        t = self._chunks.tensor(entry.file, entry.tensor, what=f"entry {entry.name!r}")
        if tuple(t.shape) != entry.shape:
            raise InputError(f"{self.folder / entry.file}: tensor {entry.tensor!r} ({entry.name}) has shape "
                             f"{list(t.shape)}, the manifest says {list(entry.shape)}",
                             hint="the manifest and the chunk files disagree; dump it again")
        return t

    def inputs(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file  # deferred: loads safetensors only when a dump is read

        path = self.folder / str((self.manifest.get("input") or {}).get("file") or INPUTS_NAME)
        try:
            raw = load_file(str(path))
        except FileNotFoundError:
            raise InputError(f"{path}: missing: the dump's inputs are needed to prove both sides ran the same input",
                             hint="copy the whole dump folder") from None
        except Exception as exc:
            raise InputError(f"{path}: not a readable safetensors file: {exc}", hint="dump it again") from None
        specs = {s["name"]: s for s in (self.manifest.get("input") or {}).get("tensors", [])}
        out = {}
        for k, t in raw.items():
            if specs.get(k, {}).get("dtype", "").startswith("complex"):
                t = torch.view_as_complex(t)
            out[k] = t
        return out

    def input_kwargs(self) -> dict[str, Any]:
        return dict((self.manifest.get("input") or {}).get("kwargs") or {})

    def close(self) -> None:
        self._chunks.close()


_ENTRY_KEYS = ("name", "module", "module_class", "call_index", "key", "sub", "shape", "dtype", "file", "tensor", "order")


def load_dump(path: str | Path) -> Dump:
    """Open a dump folder (or its manifest.json). `InputError` (exit 3) naming the file for anything wrong."""
    p = Path(path)
    folder = p.parent if p.name == MANIFEST_NAME else p
    manifest_path = folder / MANIFEST_NAME
    if not folder.exists():
        raise InputError(f"{folder}: no such dump folder", hint="give the folder `deepview-ci dump --out` wrote")
    if not folder.is_dir():
        raise InputError(f"{folder}: not a folder", hint="give the folder `deepview-ci dump --out` wrote")
    try:
        raw = manifest_path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{manifest_path}: missing: {folder} is not a deepview-ci dump, or the dump did not finish "
                         f"(the manifest is written last)", hint="run `deepview-ci dump … --out DIR` again") from None
    except OSError as exc:
        raise InputError(f"{manifest_path}: cannot read: {exc.strerror or exc}") from None
    data = parse_json(raw, source=str(manifest_path), what="dump manifest")
    if not isinstance(data, dict) or data.get("format") != DUMP_FORMAT:
        raise InputError(f"{manifest_path}: not a deepview-ci dump manifest (format "
                         f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r})",
                         hint="give a folder written by `deepview-ci dump`")
    if data.get("schema_version") != MANIFEST_SCHEMA_VERSION:
        raise InputError(f"{manifest_path}: dump schema_version {data.get('schema_version')!r} is not "
                         f"{MANIFEST_SCHEMA_VERSION}", hint="dump it again with this version of deepview-ci")
    raw_entries = data.get("entries")
    if not isinstance(raw_entries, list):
        raise InputError(f"{manifest_path}: `entries` is missing or not a list", hint="dump it again")
    if not isinstance((data.get("input") or {}).get("hash"), str):
        raise InputError(f"{manifest_path}: `input.hash` is missing", hint="dump it again")
    entries = []
    for i, e in enumerate(raw_entries):
        missing = [k for k in _ENTRY_KEYS if not isinstance(e, dict) or k not in e]
        if missing:
            raise InputError(f"{manifest_path}: entries[{i}] lacks {', '.join(missing)}", hint="dump it again")
        try:
            entries.append(Entry(name=str(e["name"]), module=str(e["module"]), module_class=str(e["module_class"]),
                                 call_index=int(e["call_index"]), key=str(e["key"]), sub=str(e["sub"]),
                                 shape=tuple(int(x) for x in e["shape"]), dtype=str(e["dtype"]), file=str(e["file"]),
                                 tensor=str(e["tensor"]), order=int(e["order"])))
        except (TypeError, ValueError) as exc:
            raise InputError(f"{manifest_path}: entries[{i}] ({e.get('name')!r}) is malformed: {exc}",
                             hint="dump it again") from None
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise InputError(f"{manifest_path}: entry name {dup!r} appears twice", hint="dump it again")
    for f in sorted({e.file for e in entries}):
        if not (folder / f).is_file():
            raise InputError(f"{folder / f}: missing (listed in {manifest_path})",
                             hint="copy the whole dump folder; every layers-*.safetensors file belongs to it")
    return Dump(folder, data, entries)




__all__ = [
    "DUMP_FORMAT", "Dump", "DumpInputsMismatch", "DumpSide", "Entry", "MANIFEST_SCHEMA_VERSION", "dtype_name",
    "dump_entry", "dump_model", "entry_name", "input_hash", "load_dump", "prepare_folder", "split_inputs",
    "tensor_bytes",
]
