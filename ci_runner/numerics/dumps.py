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
`index.json`                      the numerics mode's call index (`modes.numerics.DumpReader`): for eager dumps
                                  every call's inputs too, so the numerics mode can consume a reference dump
                                  (`options.numerics.reference_dump`) instead of running the reference itself
================================  ==============================================================================

Loading uses safetensors and JSON only, never pickle. A missing or corrupt manifest or chunk is an `InputError`
(exit 3) that names the file and what is wrong.

This module also holds the numerics-mode hooks of the toolbox (`ToolboxOptions`, `before_numerics`,
`after_numerics`, `reference_dumps`): the weights check (`ci_runner.weights`), batch invariance
(`ci_runner.batch_invariance`) and the compiler-pass bisect (`ci_runner.bisect`), gated by numerics options.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
from torch import nn

from .capture import iter_tensors
from .errors import ConfigError, DeepviewError, ExecutionError, InputError, UsageError
from .fsutil import atomic_write_json
from .metrics import MetricsError, compare_tensors, flag_for, public, severity
from .modes.numerics import (
    DYNAMO_SETTINGS,
    DumpWriter,
    RecordingSink,
    _flatten_traceable,
    call_key,
    capture_layer_outputs,
)

if TYPE_CHECKING:
    from .backends import Backend
    from .config import InputSpec, Matrix, ModelSpec, Reference
    from .modes import ModeContext
    from .results import Finding
    from .thresholds import ThresholdTable

DUMP_FORMAT = "deepview-ci-dump"
MANIFEST_SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
INPUTS_NAME = "inputs.safetensors"
INDEX_NAME = "index.json"
CHUNK_PREFIX = "layers-"
SEVERITY_RANK = {"exact": 0, "close": 1, "drift": 2, "diverged": 3, "broken": 4}
FAIL_ON = ("drift", "diverged", "broken", "never")


class DumpInputsMismatch(InputError):
    """The two dumps were not made on the same input: their layers cannot be compared."""


# ============================================================================================ names and hashes

def entry_name(module: str, call_index: int, sub: str) -> str:
    """`model.layers.0.mlp`, `model.norm#1` (second call), `(root)[logits]` (a named part of the output)."""
    base = module or "(root)"
    if call_index:
        base += f"#{call_index}"
    return f"{base}[{sub}]" if sub else base


def _tensor_bytes(t: torch.Tensor) -> bytes:
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
        h.update(_tensor_bytes(t))
    h.update(json.dumps(dict(other), sort_keys=True, default=str).encode())
    return h.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ============================================================================================ writing

class _LayerWriter(DumpWriter):
    """The numerics mode's streaming writer, with this format's chunk names and a shape/dtype record per tensor."""

    def __init__(self, folder: Path, *, chunk_bytes: int, meta: Mapping[str, Any]) -> None:
        super().__init__(folder, chunk_bytes=chunk_bytes, meta=meta)
        self.tensor_meta: dict[str, tuple[list[int], str]] = {}

    def put(self, t: torch.Tensor) -> str:
        key = super().put(t)
        if key not in self.tensor_meta:
            self.tensor_meta[key] = (list(t.shape), _dtype_name(t.dtype))
        return key

    index_name = INDEX_NAME

    def chunk_name(self, i: int) -> str:
        return f"{CHUNK_PREFIX}{i:05d}.safetensors"


def _is_dump_file(p: Path) -> bool:
    n = p.name
    return p.is_file() and (n in (MANIFEST_NAME, INPUTS_NAME, INDEX_NAME) or
                            (n.startswith(CHUNK_PREFIX) and n.endswith(".safetensors")) or
                            (n.startswith(".") and n.endswith(".tmp")))


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
    per-call inputs are not observable there and are not stored.
    """
    out = Path(out)
    prepare_folder(out)
    tensors, other = split_inputs(kwargs)
    digest = input_hash(tensors, other)
    writer = _LayerWriter(out, chunk_bytes=max(1, int(chunk_mb * (1 << 20))),
                          meta={"dump": DUMP_FORMAT, "side": side.as_dict()})
    from safetensors.torch import save_file

    save_file({k: t.detach().cpu().contiguous() if not t.is_complex() else torch.view_as_real(t.detach().cpu()).contiguous()
               for k, t in tensors.items()}, str(out / INPUTS_NAME))
    t0 = time.monotonic()
    device = side.device
    compiled = backend is not None and not backend.is_eager
    if device != "cpu":
        module = backend.to_device(module) if backend is not None else module.to(device)
        kwargs = _to_device(kwargs, device)
    if not compiled:
        capture_layer_outputs(module, (), kwargs, RecordingSink(writer))
    else:
        assert backend is not None
        _dump_compiled(module, backend, kwargs, writer)
    seconds = time.monotonic() - t0
    writer.close()  # index.json: the numerics mode's view of the same files
    return _write_manifest(out, writer, side=side, digest=digest, tensors=tensors, other=other, model=model,
                           extra=extra, capture="compiled" if compiled else "eager", seconds=seconds,
                           backend=backend)


def _to_device(obj: Any, device: str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


class OutputHooks:
    """Forward hooks on every submodule that only append `(name, flat output tensors)`.

    Dynamo traces such hooks into the compiled graph without a graph break, so the tensors are the backend's own
    outputs (fusions and all). The output is flattened inside the hook (the same sub-names as
    `capture.iter_tensors`, caches skipped) because a model may mutate a returned ModelOutput afterwards.
    Use as a context manager: the hooks are always removed.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.records: list[tuple[str, tuple[tuple[str, torch.Tensor], ...]]] = []
        self.handles: list[Any] = []

    def __enter__(self) -> "OutputHooks":
        self.handles = [sub.register_forward_hook(self._hook(name)) for name, sub in self.module.named_modules()]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _hook(self, name: str) -> Callable[..., None]:
        records = self.records

        def hook(mod: nn.Module, args: Any, output: Any) -> None:
            acc: list[tuple[str, torch.Tensor]] = []
            _flatten_traceable(output, "", acc)
            records.append((name, tuple(acc)))

        return hook

    def take(self) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """The recorded calls as `(call key, {sub: tensor})`, completion order; the k-th call of a module is
        `name#k`. Empties the record (the same list object: Dynamo guards on it)."""
        out = []
        counts: dict[str, int] = {}
        for name, flat in self.records:
            k = counts.get(name, 0)
            counts[name] = k + 1
            out.append((call_key(name, k), _compared(dict(flat))))
        self.records.clear()
        return out


def _compared(flat: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The floating tensors of a flat output (all of them when none is floating), as `compared_tensors` picks."""
    fl = {k: t for k, t in flat.items() if t.is_floating_point() or t.is_complex()}
    return fl or dict(flat)


def run_compiled_with_outputs(module: nn.Module, backend: "Backend", args: Sequence[Any],
                              kwargs: Mapping[str, Any]) -> tuple[Any, list[tuple[str, dict[str, torch.Tensor]]]]:
    """The module compiled by `backend` and run under no_grad, with every submodule's output: (output, calls).

    Uses the numerics mode's compiled capture (one process-wide hook sink, hook guards on while capturing): hooks of
    a capture's own would be silently dropped by Dynamo when it reuses a graph compiled earlier without them."""
    from .modes.numerics import CaptureHooks, capture_compiled_outputs, compile_for_capture

    holder = CaptureHooks(module)
    try:
        with torch._dynamo.config.patch(**DYNAMO_SETTINGS):
            out, keyed = capture_compiled_outputs(module, compile_for_capture(backend), args, kwargs, holder)
    finally:
        holder.remove()
    return out, [(key, _compared(dict(flat))) for key, flat in keyed]


def _dump_compiled(module: nn.Module, backend: "Backend", kwargs: Mapping[str, Any], writer: _LayerWriter) -> None:
    classes = {name: type(m).__name__ for name, m in module.named_modules()}
    _out, records = run_compiled_with_outputs(module, backend, (), kwargs)
    del _out
    done = 0
    while records:
        key, tensors = records.pop(0)
        name, _, k = key.partition("#")
        writer.calls.append({
            "idx": done, "key": key, "name": name, "module_class": classes.get(name, "?"),
            "call_index": int(k) if k else 0, "parent": None, "depth": 0 if not name else name.count(".") + 1,
            "inputs": None, "inputs_error": "compiled target: per-call inputs are not observable",
            "output": {"opaque": "compiled"}, "compare": {sub: writer.put(t) for sub, t in tensors.items()},
            "done": done,
        })
        done += 1
        del tensors


def _write_manifest(out: Path, writer: _LayerWriter, *, side: DumpSide, digest: str,
                    tensors: Mapping[str, torch.Tensor], other: Mapping[str, Any], model: Mapping[str, Any] | None,
                    extra: Mapping[str, Any] | None, capture: str, seconds: float, backend: "Backend | None") -> Path:
    from .envinfo import cell_stamp

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
        "side": {**side.as_dict(), "capture": capture},
        "input": {"hash": digest, "file": INPUTS_NAME,
                  "tensors": [{"name": k, "shape": list(t.shape), "dtype": _dtype_name(t.dtype)} for k, t in tensors.items()],
                  "kwargs": dict(other)},
        "env": env,
        "files": [writer.chunk_name(i) for i in range(writer._files)],
        "bytes": writer.bytes_written,
        "seconds": round(seconds, 3),
        "calls": len(writer.calls),
        "entries": entries,
        **dict(extra or {}),
    }
    return atomic_write_json(out / MANIFEST_NAME, manifest)


# ============================================================================================ dumping a matrix entry

def _cell_for(matrix: "Matrix", model_id: str, backend_id: str | None) -> tuple["ModelSpec", "InputSpec"]:
    from .config import raw_entry

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
    from .config import _choices_hint

    raise ConfigError(f"{matrix.path}: no reference with id {ref_id!r}", hint=_choices_hint(ref_id, [r.id for r in refs]))


def dump_entry(matrix: "Matrix", model_id: str, out: Path, *, backend_id: str | None = None,
               reference_id: str | None = None, sample: int = 0, chunk_mb: float = 64.0) -> Path:
    """Dump one model of `matrix` on one side: a reference (`reference_id`, default the primary) or a backend.

    A backend dump runs the model in the dtype of `reference_id` (default: the primary reference's), like the
    numerics mode's target. Returns the manifest path.
    """
    from .models import build_inputs, load_model, model_fingerprint

    spec, inputs = _cell_for(matrix, model_id, backend_id)
    ref = _reference(matrix, reference_id)
    if sample < 0:
        raise UsageError(f"--sample {sample}: must be ≥ 0", hint="samples are numbered from 0")
    backend = None
    if backend_id is not None:
        from .backends import resolve_backend

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
        self._handles: dict[str, Any] = {}

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

    def _open(self, file: str) -> Any:
        from safetensors import safe_open

        h = self._handles.get(file)
        if h is not None:
            self._handles[file] = self._handles.pop(file)  # most recently used last
        else:
            while len(self._handles) >= self.max_open:  # drop the least recently used chunk (and its mapping)
                self._handles.pop(next(iter(self._handles)))
            path = self.folder / file
            try:
                h = safe_open(str(path), framework="pt", device="cpu")
            except FileNotFoundError:
                raise InputError(f"{path}: missing (listed in {self.folder / MANIFEST_NAME})",
                                 hint="copy the whole dump folder; every layers-*.safetensors file belongs to it") from None
            except Exception as exc:  # safetensors' SafetensorError, a truncated header, …
                raise InputError(f"{path}: not a readable safetensors file: {exc}",
                                 hint="the dump is corrupt or was cut short; dump it again") from None
            self._handles[file] = h
        return h

    def tensor(self, entry: Entry) -> torch.Tensor:
        h = self._open(entry.file)
        try:
            t = h.get_tensor(entry.tensor)
        except Exception as exc:
            raise InputError(f"{self.folder / entry.file}: no tensor {entry.tensor!r} for entry {entry.name!r} ({exc})",
                             hint="the manifest and the chunk files disagree; dump it again") from None
        if entry.tensor.endswith("c"):
            t = torch.view_as_complex(t)
        if tuple(t.shape) != entry.shape:
            raise InputError(f"{self.folder / entry.file}: tensor {entry.tensor!r} ({entry.name}) has shape "
                             f"{list(t.shape)}, the manifest says {list(entry.shape)}",
                             hint="the manifest and the chunk files disagree; dump it again")
        return t

    def inputs(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

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
        self._handles.clear()


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
        text = manifest_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{manifest_path}: missing: {folder} is not a deepview-ci dump, or the dump did not finish "
                         f"(the manifest is written last)", hint="run `deepview-ci dump … --out DIR` again") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{manifest_path}: cannot read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{manifest_path}:{exc.lineno}:{exc.colno}: corrupt manifest ({exc.msg})",
                         hint="the dump is corrupt or truncated; dump it again") from None
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


# ============================================================================================ comparing

def inputs_check(ref: Dump, tgt: Dump) -> dict[str, Any]:
    """`{"status": "identical"|"equivalent", …}` when both dumps ran the same input; `DumpInputsMismatch` else."""
    if ref.input_hash and ref.input_hash == tgt.input_hash:
        return {"status": "identical", "hash": ref.input_hash}
    a, b = ref.inputs(), tgt.inputs()
    where = (f"reference {ref.folder} (sample {ref.manifest.get('sample', '?')}, inputs "
             f"{_short_inputs_spec(ref)}) vs target {tgt.folder} (sample {tgt.manifest.get('sample', '?')}, inputs "
             f"{_short_inputs_spec(tgt)})")
    hint = ("dump both sides with the same --sample and the same matrix inputs (seed, seq_len, batch, text); "
            "layers of different inputs cannot be compared")
    if set(a) != set(b):
        raise DumpInputsMismatch(f"inputs differ: different input tensors: only in reference {sorted(set(a) - set(b))}, "
                                 f"only in target {sorted(set(b) - set(a))}; {where}", hint=hint)
    if ref.input_kwargs() != tgt.input_kwargs():
        raise DumpInputsMismatch(f"inputs differ: non-tensor arguments {ref.input_kwargs()} vs {tgt.input_kwargs()}; "
                                 f"{where}", hint=hint)
    casts = []
    for name in sorted(a):
        x, y = a[name], b[name]
        if tuple(x.shape) != tuple(y.shape):
            raise DumpInputsMismatch(f"inputs differ: {name} has shape {list(x.shape)} in the reference and "
                                     f"{list(y.shape)} in the target; {where}", hint=hint)
        if x.dtype == y.dtype:
            if _tensor_bytes(x) == _tensor_bytes(y):
                continue
            raise DumpInputsMismatch(f"inputs differ: {name}: {_first_difference(x, y)}; {where}", hint=hint)
        if x.is_floating_point() and y.is_floating_point():
            lo = x.dtype if torch.finfo(x.dtype).bits < torch.finfo(y.dtype).bits else y.dtype
            if _tensor_bytes(x.to(lo)) == _tensor_bytes(y.to(lo)):
                casts.append(f"{name}: {_dtype_name(x.dtype)} vs {_dtype_name(y.dtype)}")
                continue
        raise DumpInputsMismatch(f"inputs differ: {name}: {_dtype_name(x.dtype)} vs {_dtype_name(y.dtype)}, "
                                 f"{_first_difference(x, y)}; {where}", hint=hint)
    if casts:
        return {"status": "equivalent", "note": "the same input at different precisions (equal after casting to the "
                                                "lower one): " + "; ".join(casts)}
    return {"status": "identical", "note": "hashes differ but every input tensor is byte-equal"}


def _short_inputs_spec(d: Dump) -> str:
    spec = d.manifest.get("inputs_spec") or {}
    return ", ".join(f"{k}={spec[k]}" for k in ("seed", "seq_len", "batch") if k in spec) or "?"


def _first_difference(x: torch.Tensor, y: torch.Tensor) -> str:
    xf = x.detach().reshape(-1)
    yf = y.detach().reshape(-1)
    if xf.dtype != yf.dtype:
        xf, yf = xf.to(torch.float64), yf.to(torch.float64)
    ne = (xf != yf) & ~(torch.isnan(xf) & torch.isnan(yf)) if xf.is_floating_point() else xf != yf
    idx = int(torch.nonzero(ne)[0]) if bool(ne.any()) else 0
    pos = list(torch.unravel_index(torch.tensor(idx), tuple(x.shape))) if x.dim() else []
    at = "[" + ", ".join(str(int(p)) for p in pos) + "]"
    return f"first difference at {at}: {xf[idx].item()} (reference) vs {yf[idx].item()} (target), " \
           f"{int(ne.sum())} of {xf.numel()} values differ"


@dataclass
class SchemaDiff:
    """Names, shapes and dtypes of two dumps' entries, before any number."""

    common: list[str] = field(default_factory=list)
    only_ref: list[str] = field(default_factory=list)
    only_target: list[str] = field(default_factory=list)
    shape_mismatch: list[dict[str, Any]] = field(default_factory=list)
    dtype_mismatch: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when names and shapes agree (dtype differences alone are compared numerically)."""
        return not (self.only_ref or self.only_target or self.shape_mismatch) and not \
            any(not d.get("comparable") for d in self.dtype_mismatch)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "common": len(self.common), "only_in_reference": self.only_ref,
                "only_in_target": self.only_target, "shape_mismatch": self.shape_mismatch,
                "dtype_mismatch": self.dtype_mismatch}


def _floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


def schema_diff(ref: Dump, tgt: Dump) -> SchemaDiff:
    d = SchemaDiff()
    for e in ref.entries:
        t = tgt.by_name.get(e.name)
        if t is None:
            d.only_ref.append(e.name)
            continue
        if e.shape != t.shape:
            d.shape_mismatch.append({"name": e.name, "reference": list(e.shape), "target": list(t.shape)})
            continue
        if e.dtype != t.dtype:
            d.dtype_mismatch.append({"name": e.name, "reference": e.dtype, "target": t.dtype,
                                     "comparable": _floating(e.dtype) and _floating(t.dtype)})
        d.common.append(e.name)
    d.only_target = [e.name for e in tgt.entries if e.name not in ref.by_name]
    return d


@dataclass
class Comparison:
    """The result of `compare_dumps`: inputs, schema diff, the per-layer rows and the verdict."""

    reference: dict[str, Any]
    target: dict[str, Any]
    inputs: dict[str, Any]
    schema: SchemaDiff
    rows: list[dict[str, Any]]
    first_divergent: str | None
    fail_on: str
    thresholds: str | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def flagged(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("flagged")]

    @property
    def ok(self) -> bool:
        return self.schema.ok and not self.flagged

    def to_json(self) -> dict[str, Any]:
        from .results import _clean

        return _clean({
            "reference": self.reference, "target": self.target, "inputs": self.inputs,
            "schema": self.schema.to_json(), "fail_on": self.fail_on, "thresholds": self.thresholds,
            "first_divergent": self.first_divergent, "ok": self.ok, "flagged": len(self.flagged),
            "warnings": self.warnings, "layers": self.rows,
        })


def compare_dumps(ref: Dump, tgt: Dump, *, thresholds: "ThresholdTable | None" = None,
                  fail_on: str = "diverged") -> Comparison:
    """Inputs first (`DumpInputsMismatch` when they differ), then the schema diff, then every common entry.

    An entry is flagged when its severity reaches `fail_on` (`drift`, `diverged`, `broken`; `never` flags
    nothing) or, with `thresholds`, when it exceeds its layer's threshold (cumulative view). Tensors are read one
    pair at a time.
    """
    if fail_on not in FAIL_ON:
        raise UsageError(f"fail-on {fail_on!r} is not one of {', '.join(FAIL_ON)}", hint="e.g. diverged")
    from .thresholds import exceeded

    inputs = inputs_check(ref, tgt)
    schema = schema_diff(ref, tgt)
    warnings = []
    fa = (ref.manifest.get("model") or {}).get("fingerprint")
    fb = (tgt.manifest.get("model") or {}).get("fingerprint")
    if fa != fb:
        diff_keys = sorted(k for k in set(fa or {}) | set(fb or {}) if (fa or {}).get(k) != (fb or {}).get(k))
        warnings.append(f"the model fingerprints differ ({', '.join(diff_keys) or 'model'}): the two sides may not "
                        f"run the same weights")
    rows = []
    first = None
    limit = SEVERITY_RANK.get(fail_on, 99)
    dtype_diff = {d["name"]: d for d in schema.dtype_mismatch}
    for name in schema.common:
        e, t = ref.by_name[name], tgt.by_name[name]
        row: dict[str, Any] = {"name": name, "module": e.module, "module_class": e.module_class, "order": e.order,
                               "shape": list(e.shape), "dtype": e.dtype}
        if name in dtype_diff:
            row["dtype_target"] = t.dtype
            if not dtype_diff[name]["comparable"]:
                row["error"] = f"dtype {e.dtype} vs {t.dtype}: not comparable"
                rows.append(row)
                continue
        try:
            m = compare_tensors(ref.tensor(e), tgt.tensor(t), where=name)
        except MetricsError as exc:
            row["error"] = exc.message
            rows.append(row)
            continue
        row["metrics"] = public(m)
        row["severity"] = severity(m)
        row["flag"] = flag_for(m)
        flagged = SEVERITY_RANK[row["severity"]] >= limit
        if thresholds is not None:
            thr, source = thresholds.get(e.key, "cumulative")
            over = exceeded(m, thr)
            row["threshold"] = thr
            row["threshold_source"] = source
            row["exceeded"] = over
            flagged = bool(over) or (fail_on != "never" and row["severity"] == "broken")
        row["flagged"] = flagged
        if flagged and first is None:
            first = name
        rows.append(row)
    ref.close()
    tgt.close()
    return Comparison(reference={"folder": str(ref.folder), "label": ref.label(), "side": ref.side,
                                 "env": ref.manifest.get("env"), "sample": ref.manifest.get("sample")},
                      target={"folder": str(tgt.folder), "label": tgt.label(), "side": tgt.side,
                              "env": tgt.manifest.get("env"), "sample": tgt.manifest.get("sample")},
                      inputs=inputs, schema=schema, rows=rows, first_divergent=first, fail_on=fail_on,
                      thresholds=str(thresholds.path) if thresholds is not None and thresholds.path else None,
                      warnings=warnings)


def _num(v: Any, fmt: str) -> str:
    width = "".join(c for c in fmt.split(".")[0] if c.isdigit())
    try:
        x = float(v)
    except (TypeError, ValueError):
        text = "n/a"
    else:
        text = str(x) if math.isnan(x) or math.isinf(x) else format(x, fmt)
    return text.rjust(int(width)) if width else text


def format_comparison(cmp: Comparison, *, max_list: int = 20) -> str:
    """The comparison as text: inputs, schema diff, the per-layer table, the verdict."""
    lines = [f"reference: {cmp.reference['folder']} ({cmp.reference['label']})",
             f"target:    {cmp.target['folder']} ({cmp.target['label']})"]
    note = f" ({cmp.inputs['note']})" if cmp.inputs.get("note") else ""
    lines.append(f"inputs: {cmp.inputs['status']}{note}")
    for w in cmp.warnings:
        lines.append(f"warning: {w}")
    s = cmp.schema
    lines.append(f"schema: {'ok' if s.ok else 'DIFFERS'}: {len(s.common)} common, {len(s.only_ref)} only in reference, "
                 f"{len(s.only_target)} only in target, {len(s.shape_mismatch)} shape mismatch(es), "
                 f"{len(s.dtype_mismatch)} dtype difference(s)")

    def listing(title: str, items: Sequence[Any]) -> None:
        if not items:
            return
        lines.append(f"  {title}:")
        for it in items[:max_list]:
            lines.append(f"    {it}")
        if len(items) > max_list:
            lines.append(f"    … {len(items) - max_list} more")

    listing("only in reference", s.only_ref)
    listing("only in target", s.only_target)
    listing("shape mismatch", [f"{d['name']}: {d['reference']} vs {d['target']}" for d in s.shape_mismatch])
    dtypes = sorted({(d["reference"], d["target"]) for d in s.dtype_mismatch})
    if dtypes:
        lines.append("  dtype differences (compared in float64): " +
                     ", ".join(f"{a} vs {b} on {sum(1 for d in s.dtype_mismatch if (d['reference'], d['target']) == (a, b))}"
                               for a, b in dtypes))
    width = max([len(r["name"]) for r in cmp.rows] + [5])
    width = min(width, 72)
    head = f"{'layer':<{width}}  {'shape':<16} {'rel':>9} {'cos':>10} {'max_abs':>9} {'sqnr_db':>8}  flag"
    if cmp.thresholds:
        head += "  over threshold"
    lines.append(head)
    for r in cmp.rows:
        name = r["name"] if len(r["name"]) <= width else "…" + r["name"][-(width - 1):]
        shape = "x".join(str(x) for x in r["shape"]) or "scalar"
        if "error" in r:
            lines.append(f"{name:<{width}}  {shape:<16} {r['error']}")
            continue
        m = r["metrics"]
        line = (f"{name:<{width}}  {shape:<16} {_num(m['rel'], '9.2e')} {_num(m['cos'], '10.6f')} "
                f"{_num(m['max_abs'], '9.2e')} {_num(m['sqnr_db'], '8.1f')}  {r['flag']:<4}")
        if cmp.thresholds:
            line += "  " + (",".join(r.get("exceeded") or []) or "-")
        lines.append(line)
    if cmp.first_divergent:
        r = next(x for x in cmp.rows if x["name"] == cmp.first_divergent)
        m = r["metrics"]
        lines.append(f"first divergent layer: {r['name']} ({r['module_class']}): rel {_num(m['rel'], '.2e')}, "
                     f"cos {_num(m['cos'], '.6f')} ({r['severity']}); {len(cmp.flagged)} entr"
                     f"{'y' if len(cmp.flagged) == 1 else 'ies'} flagged")
    else:
        lines.append(f"no layer flagged (fail-on {cmp.fail_on}{', with thresholds' if cmp.thresholds else ''})")
    return "\n".join(lines)


# ============================================================================================ CLI handlers

def dump_command(args: Any) -> int:
    """`deepview-ci dump --matrix M --model ID [--backend ID] [--reference ID] [--sample N] --out DIR [--chunk-mb X]`."""
    from .config import load_matrix

    matrix = load_matrix(getattr(args, "matrix", None))
    out = Path(args.out)
    try:
        path = dump_entry(matrix, args.model, out, backend_id=getattr(args, "backend", None),
                          reference_id=getattr(args, "reference", None), sample=int(getattr(args, "sample", 0) or 0),
                          chunk_mb=float(getattr(args, "chunk_mb", None) or 64.0))
    except DeepviewError:
        raise
    except Exception as exc:  # the model or backend failed while running: say where, keep the exit code meaningful
        raise ExecutionError(f"dump of {args.model!r} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                             hint="run the `layers` mode on this cell to find the failing module") from exc
    m = json.loads(path.read_text(encoding="utf-8"))
    print(f"dumped {len(m['entries'])} tensors of {m['calls']} module calls ({m['bytes'] / 1e6:.1f} MB, "
          f"{m['seconds']:.1f} s) → {out}")
    print(f"  side: {m['side']['role']} {m['side']['id']} on {m['side']['device']} {m['side']['dtype']} "
          f"({m['side']['capture']}); input sha256 {m['input']['hash'][:16]}…")
    return 0


def compare_command(args: Any) -> int:
    """`deepview-ci compare REF TARGET [--json PATH] [--thresholds FILE] [--fail-on drift|diverged|broken|never]`.

    Exit 0 when inputs, schema and every layer agree; 1 when the schema differs or a layer is flagged; 3 when a
    dump is unreadable or the inputs differ (no layer is compared then)."""
    from . import errors

    table = None
    if getattr(args, "thresholds", None):
        from .thresholds import load_table

        table = load_table(Path(args.thresholds))
    ref = load_dump(args.ref_dump)
    tgt = load_dump(args.target_dump)
    cmp = compare_dumps(ref, tgt, thresholds=table, fail_on=getattr(args, "fail_on", None) or "diverged")
    print(format_comparison(cmp))
    if getattr(args, "json", None):
        path = atomic_write_json(Path(args.json), cmp.to_json())
        print(f"comparison written: {path}")
    return errors.EXIT_OK if cmp.ok else errors.EXIT_FINDINGS


# ============================================================================================ numerics-mode hooks

@dataclass(frozen=True, kw_only=True)
class ToolboxOptions:
    """The numerics options of the toolbox (`options: {numerics: {...}}`); the rest go to `NumericsOptions`.

    ====================  =======  ==========================================================================
    option                default  meaning
    ====================  =======  ==========================================================================
    weights_check         true     every parameter and buffer after the round trip to the target, before numerics
    batch_invariance      false    the same input in every slot of a batch on the target, slot 0 vs slot N
    batch_slots           4        batch size of that experiment
    batch_position        false    also the position experiment (the input in one slot among different others)
    bisect                false    compiler-pass bisect of the divergent layer (inductor: CompilerBisector;
                                   other backends: bisect over the layer's graph nodes)
    bisect_method         auto     auto | compiler | nodes
    bisect_timeout        600      seconds for one bisect
    reference_dump        (none)   dump folder(s) of the primary reference (`deepview-ci dump --reference …`):
                                   compared against instead of running the reference pass
    ====================  =======  ==========================================================================
    """

    weights_check: bool = True
    batch_invariance: bool = False
    batch_slots: int = 4
    batch_position: bool = False
    bisect: bool = False
    bisect_method: str = "auto"
    bisect_timeout: float = 600.0
    reference_dump: tuple[str, ...] = ()

    KEYS = ("weights_check", "batch_invariance", "batch_slots", "batch_position", "bisect", "bisect_method",
            "bisect_timeout", "reference_dump")

    @classmethod
    def from_mapping(cls, opts: Mapping[str, Any], *, where: str = "options.numerics") -> "ToolboxOptions":
        kw: dict[str, Any] = {}
        for key in ("weights_check", "batch_invariance", "batch_position", "bisect"):
            if key in opts:
                if not isinstance(opts[key], bool):
                    raise ConfigError(f"{where}.{key}: {opts[key]!r} is not true/false", hint="use true or false")
                kw[key] = opts[key]
        if "batch_slots" in opts:
            v = opts["batch_slots"]
            if not isinstance(v, int) or isinstance(v, bool) or v < 2:
                raise ConfigError(f"{where}.batch_slots: {v!r} is not an integer ≥ 2", hint="e.g. 4")
            kw["batch_slots"] = v
        if "bisect_method" in opts:
            if opts["bisect_method"] not in ("auto", "compiler", "nodes"):
                raise ConfigError(f"{where}.bisect_method: {opts['bisect_method']!r} is not auto, compiler or nodes",
                                  hint="auto picks the compiler bisector for inductor, the node bisect otherwise")
            kw["bisect_method"] = opts["bisect_method"]
        if "bisect_timeout" in opts:
            try:
                kw["bisect_timeout"] = float(opts["bisect_timeout"])
            except (TypeError, ValueError):
                raise ConfigError(f"{where}.bisect_timeout: {opts['bisect_timeout']!r} is not a number",
                                  hint="seconds, e.g. 600") from None
        if opts.get("reference_dump") is not None:
            v = opts["reference_dump"]
            paths = [v] if isinstance(v, str) else v
            if not isinstance(paths, (list, tuple)) or not paths or not all(isinstance(x, str) and x for x in paths):
                raise ConfigError(f"{where}.reference_dump: {v!r} is not a folder or a list of folders",
                                  hint="the --out folder(s) of `deepview-ci dump --reference …`")
            kw["reference_dump"] = tuple(paths)
        return cls(**kw)


def split_numerics_options(opts: Mapping[str, Any], *, where: str = "options.numerics") -> tuple[ToolboxOptions, dict[str, Any]]:
    """(the toolbox's options, the remaining numerics options) of `options.numerics`."""
    tb = ToolboxOptions.from_mapping(opts, where=where)
    return tb, {k: v for k, v in opts.items() if k not in ToolboxOptions.KEYS}


def reference_dumps(ctx: "ModeContext", tb: ToolboxOptions) -> tuple[list[Path], list[int]]:
    """The reference dump folders the numerics mode compares against (`reference_dump`), checked against the cell.

    Each must be an eager reference dump (with per-call inputs), of this model (same fingerprint), made on exactly
    the input this cell builds for its sample (same input hash); otherwise `ConfigError`/`InputError` says which.
    Paths are absolute or relative to the working directory. A dump of another reference than the primary (say
    float64) is still compared (metrics are float64) against the primary's thresholds. Returns (folders, samples).
    """
    from .models import model_fingerprint

    primary = ctx.cell.references[0]
    folders: list[Path] = []
    samples: list[int] = []
    for raw in tb.reference_dump:
        folder = Path(raw).expanduser()
        dump = load_dump(folder)
        side = dump.side
        if side.get("role") != "reference" or side.get("capture") != "eager":
            raise ConfigError(f"options.numerics.reference_dump: {folder} is a {side.get('role')} dump "
                              f"({side.get('capture')}), not an eager reference dump",
                              hint="dump the reference with `deepview-ci dump --reference ID` (no --backend)")
        if not (folder / INDEX_NAME).is_file():
            raise InputError(f"{folder / INDEX_NAME}: missing: the dump has no per-call index",
                             hint="dump it again with this version of deepview-ci")
        fp = (dump.manifest.get("model") or {}).get("fingerprint")
        mine = model_fingerprint(ctx.cell.model)
        if json.loads(json.dumps(fp, default=str)) != json.loads(json.dumps(mine, default=str)):
            raise ConfigError(f"options.numerics.reference_dump: {folder} is a dump of another model "
                              f"({(dump.manifest.get('model') or {}).get('id')!r}, fingerprint differs)",
                              hint=f"dump model {ctx.cell.model.id!r} of this matrix")
        sample = int(dump.manifest.get("sample", 0))
        loaded = ctx.model(dtype=side.get("dtype") or primary.dtype, device="cpu")
        tensors, other = split_inputs(ctx.inputs(loaded, sample=sample, device="cpu"))
        if input_hash(tensors, other) != dump.input_hash:
            raise DumpInputsMismatch(f"options.numerics.reference_dump: {folder} was made on another input than "
                                     f"this cell's sample {sample}",
                                     hint="dump with the same matrix inputs (seed, seq_len, batch) and --sample")
        dump.close()
        folders.append(folder)
        samples.append(sample)
    return folders, samples


@dataclass
class ToolboxRun:
    """What the toolbox adds to the numerics mode's result."""

    findings: list["Finding"] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def before_numerics(ctx: "ModeContext", tb: ToolboxOptions, *, isolate: bool = True) -> ToolboxRun:
    """The weights check (when `weights_check`), run before any forward comparison."""
    out = ToolboxRun()
    if not tb.weights_check:
        return out
    from .weights import check_cell

    t0 = time.monotonic()
    findings, data = check_cell(ctx, isolate=isolate)
    data["seconds"] = round(time.monotonic() - t0, 3)
    out.findings.extend(findings)
    out.data["weights"] = data
    if findings:
        out.notes.append(f"weights check: {len(findings)} tensor(s) differ after the round trip to the target; "
                         f"divergence below may come from them, not from the forward")
    return out


def after_numerics(ctx: "ModeContext", tb: ToolboxOptions, *, table: "ThresholdTable", layers: Sequence[Any],
                   verdict: Mapping[str, Any], findings: list["Finding"], isolate: bool = True) -> ToolboxRun:
    """Batch invariance (when `batch_invariance`) and the compiler-pass bisect of the divergent layer (`bisect`).

    The bisect result is also attached to the divergence finding of the bisected layer (`details["bisect"]` and
    its message)."""
    out = ToolboxRun()
    if tb.batch_invariance:
        from .batch_invariance import check_cell as batch_check

        t0 = time.monotonic()
        bf, bdata = batch_check(ctx, table=table, slots=tb.batch_slots, position=tb.batch_position, isolate=isolate)
        bdata["seconds"] = round(time.monotonic() - t0, 3)
        out.findings.extend(bf)
        out.data["batch_invariance"] = bdata
    if tb.bisect:
        from .bisect import bisect_cell

        t0 = time.monotonic()
        bres = bisect_cell(ctx, layers=layers, verdict=verdict, table=table, method=tb.bisect_method,
                           timeout=tb.bisect_timeout, isolate=isolate)
        if bres is not None:
            bres["seconds"] = round(time.monotonic() - t0, 3)
            out.data["bisect"] = bres
            for f in findings:
                if f.kind == "divergence" and f.module == bres.get("layer"):
                    f.details["bisect"] = bres
                    if bres.get("summary"):
                        f.message += f"; bisect: {bres['summary']}"
    return out


__all__ = [
    "DUMP_FORMAT", "Comparison", "Dump", "DumpInputsMismatch", "DumpSide", "Entry", "MANIFEST_SCHEMA_VERSION",
    "OutputHooks", "SchemaDiff", "ToolboxOptions", "ToolboxRun", "after_numerics", "before_numerics", "compare_command",
    "compare_dumps", "dump_command", "dump_entry", "dump_model", "entry_name", "format_comparison", "input_hash",
    "inputs_check", "load_dump", "prepare_folder", "reference_dumps", "run_compiled_with_outputs", "schema_diff", "split_inputs",
    "split_numerics_options",
]
