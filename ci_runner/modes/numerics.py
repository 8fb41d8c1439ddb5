"""Mode `numerics`: per-layer divergence of the target against trusted references, with data-derived thresholds.

The failure this mode exists for is silent: the model compiles, runs and answers plausibly while one layer is
quietly wrong. Every module call is compared against the primary reference, in two views, and each comparison is
held to that layer's own threshold (`ci_runner.thresholds`).

Method
------
1. **Thresholds** (once per model, shared by every backend's cell and across runs when the key matches): the
   primary reference (the first of `references`, by default cpu/float32) and every other reference (by default
   cpu/float64) run the same `samples` inputs; per module call and view, the reference-vs-reference spread, times
   a margin, with floors, is the threshold. Stored in `<run>/thresholds/<model>-<key-hash>.json`.
2. **Reference pass** (primary, eager, hooks on every submodule via `capture.ModuleCapture`): each call's inputs,
   output and place in the call tree are streamed to disk (`numerics/ref/sample-<k>/`: safetensors chunks of at
   most `chunk_mb` plus `index.json`); only the current chunk is in memory.
3. **Target, cumulative view** ("the target's own forward"): the whole model goes through `backend.compile` the
   way a user would compile it, with forward hooks on the ORIGINAL submodules. Dynamo inlines those hooks, so each
   submodule's output is an output of the backend's own compiled graph: the values compared are the ones the
   backend computed, fusions and all. (The alternative, compiling each submodule separately and letting Dynamo
   break the graph at every module boundary, was measured first and rejected: Dynamo silently falls back to eager
   for frames whose graph breaks sit in loops or nested calls, e.g. the decoder-layer loop and the attention,
   so some ops never reached the backend.) The price: the outputs of one compiled graph live until that graph
   returns; they are then compared one by one against the streamed reference and dropped. Eager device backends
   (`simdev`) compare on the fly, one module at a time.
4. **Target, isolated view** ("the target layer fed the reference's inputs"): every called module, compiled alone
   with `backend.compile(module)`, runs on the reference's captured inputs while each of its direct sub-calls is
   stubbed to return the reference's output for that sub-call. So a module's isolated metrics measure its OWN
   ops only (for `model.layers.0.self_attn`: the rotary embedding, attention and reshapes, not q/k/v/o_proj), and
   a module flagged in this view is where the error is made, not where it arrives. The granularity is every
   called module (containers included; ModuleList/ModuleDict are never called and do not appear), because an op
   can be owned by a container (attention in `*.self_attn`, residual adds in a decoder layer). What a module
   passes to its stubbed sub-calls is compared too (an own op whose result only feeds a sub-call). Cost: each op
   runs once, i.e. about one extra forward; so by default (`isolated: auto`) this view runs only when the
   cumulative view flags a layer, fails or misses one: it is what attributes a divergence, and a clean target
   then costs about a reference pass plus a target pass. `isolated: all` always runs it (it also catches an own-op
   error too small to exceed the cumulative view's looser, accumulated thresholds).
5. **Verdict**: the first divergent layer (the first layer, in completion order, flagged in the isolated view:
   wrong on its own; else the first flagged in the cumulative view), and `algorithmic` (a layer flagged in the
   isolated view: a sudden jump, not carried-in drift), `layer_class` (two or more layers flagged in the isolated
   view share a module class or a relative path such as `model.layers.*.post_attention_layernorm`) or `drift`
   (the cumulative view grows past thresholds with no layer wrong on its own). Findings (`divergence`): one per
   module flagged in the isolated view; for pure drift, one for the first divergent layer.

The target runs in a child process (`isolate.run_isolated`) so that a backend that aborts, segfaults or hangs
loses only the module it was running (journalled in `numerics/journal.log`); a fresh child goes on with the rest.

Options (`options: {numerics: {...}}` in the matrix)
----------------------------------------------------
| option | default | meaning |
|---|---|---|
| `percentile` | 99 | percentile of the reference-vs-reference spread over samples (`thresholds.py`) |
| `margin` | 8 | factor on that spread |
| `rel_floor` | 64·eps | lowest rel threshold (eps of the primary dtype: 7.6e-6 for float32) |
| `mad_floor` | rel_floor | lowest mad threshold, relative to the layer's mean abs reference value |
| `cos_floor` | rel_floor² | lowest 1 − cos threshold |
| `samples` | max(2, inputs.samples) | input samples the thresholds are derived over |
| `thresholds_dir` | `<run>/thresholds` | where threshold files live (point several runs at one folder to share) |
| `compare_samples` | 1 | input samples the target is compared on (the worst sample counts) |
| `views` | [cumulative, isolated] | which views run at all |
| `isolated` | auto | auto: the isolated view runs when the cumulative view flags or fails something; all: always |
| `isolate` | true | run the target in a child process (false: in this process; faster, not crash-safe) |
| `timeout` | the cell's | seconds for one target child |
| `max_restarts` | 8 | children started again after crashes before giving up |
| `keep_dumps` | false | keep the reference dumps (`numerics/ref/`) after the mode |
| `chunk_mb` | 64 | size of one safetensors chunk of the reference dump |
| `max_layers` | 2000 | layers listed in `data["layers"]` (the rest is counted, not listed) |
| `max_findings` | 200 | findings emitted (the most severe first) |

Status: `fail` with findings; `pass` when nothing exceeds its threshold (`reason` says "partial: …" when some
layers or a view could not be compared, e.g. the backend crashed in them: the layers mode reports those);
`error` when nothing at all could be compared, or fewer than two references are configured.
"""

from __future__ import annotations

import difflib
import importlib
import json
import math
import os
import re
import shutil
import time
import weakref
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..capture import CallInfo, ModuleCapture, iter_tensors
from ..config import spec_from_json, spec_to_json
from ..errors import ConfigError, DeepviewError, InputError
from ..fsutil import append_line, atomic_write_json
from ..metrics import MetricsError, compare_tensors, public, severity, worst
from ..results import Finding, ModeResult, fingerprint
from ..thresholds import (
    LayerStats,
    ThresholdOptions,
    ThresholdTable,
    exceeded,
    load_or_derive,
    threshold_key,
    threshold_path,
)

if TYPE_CHECKING:
    from ..modes import ModeContext

DUMP_SCHEMA_VERSION = 1
VIEWS: tuple[str, ...] = ("cumulative", "isolated")
DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16,
}
# Dynamo settings while the target runs: many module instances share one code object (Linear.forward, …), and
# hitting the recompile limit must fail loudly rather than fall back to eager (which would hide the backend).
DYNAMO_SETTINGS: Mapping[str, Any] = {
    "recompile_limit": 1024,
    "accumulated_recompile_limit": 1 << 16,
    "fail_on_recompile_limit_hit": True,
}


# ============================================================================================ options

@dataclass(frozen=True, kw_only=True)
class NumericsOptions:
    thresholds: ThresholdOptions
    compare_samples: int = 1
    views: tuple[str, ...] = VIEWS
    isolated: str = "auto"  # "auto": when the cumulative view flags or fails anything; "all": always
    isolate: bool = True
    timeout: float | None = None
    max_restarts: int = 8
    keep_dumps: bool = False
    chunk_mb: float = 64.0
    max_layers: int = 2000
    max_findings: int = 200

    @classmethod
    def from_mapping(cls, opts: Mapping[str, Any], *, where: str = "options.numerics") -> "NumericsOptions":
        own = {f.name for f in fields(cls)} - {"thresholds"}
        known = sorted(own | set(ThresholdOptions.KEYS))
        for key in opts:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                raise ConfigError(f"{where}: unknown option {key!r}",
                                  hint=(f"did you mean {close[0]!r}? " if close else "") + f"known: {', '.join(known)}")
        kw: dict[str, Any] = {}
        for key in ("compare_samples", "max_restarts", "max_layers", "max_findings"):
            if key in opts:
                v = opts[key]
                if not isinstance(v, int) or isinstance(v, bool) or v < (1 if key != "max_restarts" else 0):
                    raise ConfigError(f"{where}.{key}: {v!r} is not a positive integer", hint="give an integer ≥ 1")
                kw[key] = v
        for key in ("isolate", "keep_dumps"):
            if key in opts:
                if not isinstance(opts[key], bool):
                    raise ConfigError(f"{where}.{key}: {opts[key]!r} is not true/false", hint="use true or false")
                kw[key] = opts[key]
        for key in ("timeout", "chunk_mb"):
            if key in opts and opts[key] is not None:
                try:
                    kw[key] = float(opts[key])
                except (TypeError, ValueError):
                    raise ConfigError(f"{where}.{key}: {opts[key]!r} is not a number", hint="give seconds / MiB") from None
                if kw[key] <= 0:
                    raise ConfigError(f"{where}.{key}: must be positive", hint="give a positive number")
        if "isolated" in opts:
            if opts["isolated"] not in ("auto", "all"):
                raise ConfigError(f"{where}.isolated: {opts['isolated']!r} is not auto or all",
                                  hint="auto: the isolated view runs when the cumulative view flags or fails something")
            kw["isolated"] = opts["isolated"]
        if "views" in opts:
            views = opts["views"]
            if isinstance(views, str):
                views = [views]
            bad = [v for v in views if v not in VIEWS]
            if bad or not views:
                raise ConfigError(f"{where}.views: {bad or views!r} not among {list(VIEWS)}", hint="e.g. [cumulative, isolated]")
            kw["views"] = tuple(v for v in VIEWS if v in views)
        return cls(thresholds=ThresholdOptions.from_mapping(opts, where=where), **kw)


# ============================================================================================ call structures

class Unserializable(Exception):
    """A call argument or output that cannot be stored (an object that is neither tensor nor plain data)."""


_CACHE_TYPES = ("Cache", "DynamicCache", "StaticCache", "HybridCache", "HybridMambaAttentionDynamicCache")


def _is_model_output(obj: Any) -> bool:
    return hasattr(obj, "to_tuple") and hasattr(obj, "keys") and hasattr(obj, "__getitem__")


def encode_value(obj: Any, put: Callable[[torch.Tensor], str], *, strict: bool) -> Any:
    """A JSON spec of `obj` with tensors replaced by `{"t": key}` (`put` stores them).

    Plain data, tuples/lists/dicts, namedtuples, ModelOutput, dtypes and devices are kept; a cache object becomes
    None; anything else raises `Unserializable` when `strict` (inputs must be rebuilt exactly) or becomes
    `{"opaque": type}` (outputs are only compared through their tensors).
    """
    if isinstance(obj, torch.Tensor):
        return {"t": put(obj)}
    if obj is None or isinstance(obj, (bool, int, str)):
        return {"v": obj}
    if isinstance(obj, float):
        return {"f": repr(obj)}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"device": str(obj)}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return {"tuple": [encode_value(v, put, strict=strict) for v in obj]}
    if isinstance(obj, tuple):
        return {"tuple": [encode_value(v, put, strict=strict) for v in obj]}
    if isinstance(obj, list):
        return {"list": [encode_value(v, put, strict=strict) for v in obj]}
    if type(obj).__name__ in _CACHE_TYPES or "Cache" in type(obj).__name__:
        return {"v": None, "cache": type(obj).__name__}
    if _is_model_output(obj):
        cls = type(obj)
        return {"mo": f"{cls.__module__}:{cls.__qualname__}",
                "items": [[str(k), encode_value(obj[k], put, strict=strict)] for k in obj.keys()]}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            if strict:
                raise Unserializable(f"dict with {type(next(iter(obj))).__name__} keys")
            return {"opaque": "dict"}
        return {"dict": [[k, encode_value(v, put, strict=strict)] for k, v in obj.items()]}
    if isinstance(obj, slice):
        return {"slice": [obj.start, obj.stop, obj.step]}
    if strict:
        raise Unserializable(f"{type(obj).__module__}.{type(obj).__qualname__}")
    return {"opaque": type(obj).__qualname__}


def decode_value(spec: Any, get: Callable[[str], torch.Tensor]) -> Any:
    """Rebuild what `encode_value` stored (ModelOutput classes are re-imported from transformers only)."""
    if "t" in spec:
        return get(spec["t"])
    if "v" in spec:
        return spec["v"]
    if "f" in spec:
        return float(spec["f"])
    if "dtype" in spec:
        return getattr(torch, spec["dtype"])
    if "device" in spec:
        return torch.device(spec["device"])
    if "tuple" in spec:
        return tuple(decode_value(s, get) for s in spec["tuple"])
    if "list" in spec:
        return [decode_value(s, get) for s in spec["list"]]
    if "dict" in spec:
        return {k: decode_value(s, get) for k, s in spec["dict"]}
    if "mo" in spec:
        items = {k: decode_value(s, get) for k, s in spec["items"]}
        cls = _model_output_class(spec["mo"])
        return cls(**items) if cls is not None else items
    if "slice" in spec:
        return slice(*spec["slice"])
    return None  # opaque


def _model_output_class(path: str) -> Any:
    module, _, qual = path.partition(":")
    if not module.startswith("transformers."):
        return None
    try:
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError):
        return None


def cast_tree(obj: Any, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> Any:
    """Floating tensors to `dtype`, every tensor to `device`, through tuples/lists/dicts/ModelOutput."""
    if isinstance(obj, torch.Tensor):
        if dtype is not None and obj.is_floating_point() and obj.dtype != dtype:
            obj = obj.to(dtype)
        if device is not None and obj.device != torch.device(device):
            obj = obj.to(device)
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(cast_tree(v, dtype=dtype, device=device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_tree(v, dtype=dtype, device=device) for v in obj)
    if _is_model_output(obj):
        for k in list(obj.keys()):
            obj[k] = cast_tree(obj[k], dtype=dtype, device=device)
        return obj
    if isinstance(obj, dict):
        return {k: cast_tree(v, dtype=dtype, device=device) for k, v in obj.items()}
    return obj


def compared_tensors(output: Any) -> dict[str, torch.Tensor]:
    """The tensors of a module output that are compared: the floating ones (all of them if none is floating)."""
    ts = dict(iter_tensors(output))
    fl = {k: t for k, t in ts.items() if t.is_floating_point() or t.is_complex()}
    return fl or ts


# ============================================================================================ dumps

@dataclass(frozen=True, kw_only=True)
class CallMeta:
    """One module call: `key` is `name` for the first call of a module, `name#k` for its k-th later call."""

    idx: int  # start order among all calls of the pass
    key: str
    name: str
    module_class: str
    call_index: int
    parent: int | None  # idx of the calling module's call
    depth: int


def call_key(name: str, call_index: int) -> str:
    return name if call_index == 0 else f"{name}#{call_index}"


class DumpWriter:
    """Streams tensors into safetensors chunks (at most `chunk_bytes` buffered) and writes `index.json` on close.

    A tensor object seen again unchanged (its version counter did not move: a module's output passed on as the
    next module's input) is stored once; the check holds only a weak reference, so nothing is kept alive.
    """

    def __init__(self, folder: Path, *, chunk_bytes: int = 64 << 20, meta: Mapping[str, Any] | None = None) -> None:
        self.folder = Path(folder)
        if self.folder.exists():
            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True)
        self.chunk_bytes = chunk_bytes
        self.meta = dict(meta or {})
        self.calls: list[dict[str, Any]] = []
        self.tensor_file: dict[str, int] = {}
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._files = 0
        self._n = 0
        self._seen: dict[int, tuple[Any, int, str]] = {}
        self.bytes_written = 0

    index_name = "index.json"

    def chunk_name(self, i: int) -> str:
        return f"chunk-{i:04d}.safetensors"

    def put(self, t: torch.Tensor) -> str:
        entry = self._seen.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version:
            return entry[2]
        key = f"t{self._n}"
        self._n += 1
        data = t.detach()
        if data.device.type != "cpu":
            data = data.to("cpu")
        data = data.contiguous().clone() if data.is_contiguous() else data.contiguous()
        if data.is_complex():  # safetensors has no complex dtype everywhere: store (real, imag)
            data = torch.view_as_real(data).contiguous()
            key += "c"
        self._buf[key] = data
        self._buf_bytes += data.numel() * data.element_size()
        try:
            self._seen[id(t)] = (weakref.ref(t), t._version, key)
        except TypeError:
            pass
        if self._buf_bytes >= self.chunk_bytes:
            self.flush()
        return key

    def flush(self) -> None:
        if not self._buf:
            return
        from safetensors.torch import save_file

        save_file(self._buf, str(self.folder / self.chunk_name(self._files)))
        for k in self._buf:
            self.tensor_file[k] = self._files
        self.bytes_written += self._buf_bytes
        self._files += 1
        self._buf = {}
        self._buf_bytes = 0

    def close(self) -> Path:
        self.flush()
        self._seen.clear()
        index = {"schema_version": DUMP_SCHEMA_VERSION, **self.meta, "calls": self.calls,
                 "files": [self.chunk_name(i) for i in range(self._files)], "tensors": self.tensor_file}
        return atomic_write_json(self.folder / self.index_name, index, indent=None)


class DumpReader:
    """Reads a dump lazily: one tensor at a time from its chunk (at most `MAX_OPEN` chunk files open; tensors are
    not cached)."""

    MAX_OPEN = 2

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        try:
            self.index = json.loads((self.folder / "index.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise InputError(f"{self.folder}: no index.json: not a complete numerics dump",
                             hint="the reference pass did not finish; rerun the mode") from None
        except json.JSONDecodeError as exc:
            raise InputError(f"{self.folder}/index.json: corrupt ({exc.msg})", hint="rerun the mode") from None
        if self.index.get("schema_version") != DUMP_SCHEMA_VERSION:
            raise InputError(f"{self.folder}: dump schema {self.index.get('schema_version')} is not {DUMP_SCHEMA_VERSION}",
                             hint="dump it again with this version of deepview-ci")
        self.calls: list[dict[str, Any]] = self.index["calls"]
        self.by_key: dict[str, dict[str, Any]] = {c["key"]: c for c in self.calls}
        self._children: dict[int | None, list[dict[str, Any]]] = {}
        for c in self.calls:
            self._children.setdefault(c["parent"], []).append(c)
        self._handles: dict[int, Any] = {}

    def get(self, key: str, *, clone: bool = False) -> torch.Tensor:
        """One stored tensor. `clone=True` for tensors fed to a module: own, aligned memory, because some kernels
        pick their code path by alignment and the isolated view must reproduce the reference bit for bit."""
        from safetensors import safe_open

        fi = self.index["tensors"][key]
        h = self._handles.pop(fi, None)
        if h is None:
            h = safe_open(str(self.folder / self.index["files"][fi]), framework="pt", device="cpu")
            while len(self._handles) >= self.MAX_OPEN:  # each open chunk is a mapping whose read pages count as
                self._handles.pop(next(iter(self._handles)))  # resident: keep few, memory stays flat in depth
        self._handles[fi] = h  # most recently used last
        t = h.get_tensor(key)
        if clone:
            t = t.clone()
        if key.endswith("c"):
            t = torch.view_as_complex(t)
        return t

    def children(self, call: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The direct sub-calls of `call`, in call order."""
        return self._children.get(call["idx"], [])

    def root(self) -> dict[str, Any]:
        return self.calls[0]

    def inputs(self, call: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if call.get("inputs") is None:
            raise Unserializable(call.get("inputs_error") or "inputs not stored")
        spec = call["inputs"]
        return (tuple(decode_value(s, self._fed) for s in spec["args"]),
                {k: decode_value(s, self._fed) for k, s in spec["kwargs"]})

    def output(self, call: Mapping[str, Any]) -> Any:
        return decode_value(call["output"], self._fed)

    def _fed(self, key: str) -> torch.Tensor:
        return self.get(key, clone=True)

    def ref_tensors(self, call: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return {sub: self.get(k) for sub, k in call["compare"].items()}

    def close(self) -> None:
        self._handles.clear()


# ============================================================================================ capture

class CallSink:
    """What `capture_layer_outputs` feeds: `enter` before a module runs, `exit` with its output."""

    def enter(self, meta: CallMeta, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:  # noqa: B027
        pass

    def exit(self, meta: CallMeta, output: Any) -> None:  # noqa: B027
        pass


class _Tracker:
    """Turns ModuleCapture callbacks into CallMeta with the caller's call (a stack of open calls)."""

    def __init__(self, sink: CallSink) -> None:
        self.sink = sink
        self.stack: list[CallMeta] = []
        self.n = 0
        self.errors: list[tuple[str, BaseException]] = []

    def pre(self, info: CallInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        meta = CallMeta(idx=self.n, key=call_key(info.name, info.call_index), name=info.name,
                        module_class=info.module_class, call_index=info.call_index,
                        parent=self.stack[-1].idx if self.stack else None, depth=info.depth)
        self.n += 1
        self.stack.append(meta)
        self.sink.enter(meta, args, kwargs)

    def post(self, info: CallInfo, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        meta = self.stack.pop() if self.stack else None
        if meta is not None:
            self.sink.exit(meta, output)


def capture_layer_outputs(module: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any], sink: CallSink) -> Any:
    """Run `module(*args, **kwargs)` eagerly under no_grad with hooks on every submodule, feeding `sink`.

    Returns the model's output. Sink errors are collected (`CaptureError` after the run), never break the forward.
    """
    tracker = _Tracker(sink)
    with torch.no_grad(), ModuleCapture(module, pre=tracker.pre, post=tracker.post) as cap:
        out = module(*args, **kwargs)
    if cap.errors:
        name, exc = cap.errors[0]
        raise CaptureError(f"while observing module {name or '(root)'}: {type(exc).__name__}: {exc}") from exc
    return out


class CaptureError(DeepviewError):
    """A hook of the numerics capture failed (writing a dump, comparing a layer)."""


class RecordingSink(CallSink):
    """Streams every call's inputs and output into a `DumpWriter`."""

    def __init__(self, writer: DumpWriter) -> None:
        self.writer = writer
        self.done = 0

    def enter(self, meta: CallMeta, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        rec: dict[str, Any] = {"idx": meta.idx, "key": meta.key, "name": meta.name, "module_class": meta.module_class,
                               "call_index": meta.call_index, "parent": meta.parent, "depth": meta.depth}
        try:
            rec["inputs"] = {"args": [encode_value(a, self.writer.put, strict=True) for a in args],
                             "kwargs": [[k, encode_value(v, self.writer.put, strict=True)] for k, v in kwargs.items()]}
        except Unserializable as exc:
            rec["inputs"] = None
            rec["inputs_error"] = f"an input cannot be stored: {exc}"
        self.writer.calls.append(rec)
        assert len(self.writer.calls) == meta.idx + 1

    def exit(self, meta: CallMeta, output: Any) -> None:
        rec = self.writer.calls[meta.idx]
        rec["output"] = encode_value(output, self.writer.put, strict=False)
        rec["compare"] = {sub: self.writer.put(t) for sub, t in compared_tensors(output).items()}
        rec["done"] = self.done
        self.done += 1


def record_reference(module: nn.Module, kwargs: Mapping[str, Any], folder: Path, *, chunk_mb: float = 64.0,
                     meta: Mapping[str, Any] | None = None) -> Path:
    """The reference pass: `module(**kwargs)` with every call's inputs and output streamed to `folder`."""
    writer = DumpWriter(folder, chunk_bytes=int(chunk_mb * (1 << 20)), meta=meta)
    capture_layer_outputs(module, (), kwargs, RecordingSink(writer))
    return writer.close()


def compare_call(reader: DumpReader, call: Mapping[str, Any], output: Any) -> dict[str, Any]:
    """Worst-of metrics of a module's output against the reference's, over the tensors both sides have.

    A tensor present on one side only (an auxiliary output such as collected `hidden_states`, which an isolated
    run does not collect) is listed under `structure`, not compared; no common tensor at all, or a shape
    mismatch, raises `MetricsError`.
    """
    return compare_flat(reader, call, compared_tensors(output))


def compare_flat(reader: DumpReader, call: Mapping[str, Any], tgt: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """`compare_call` on an output already flattened to {sub-name: tensor} (see `compared_tensors`)."""
    ref = reader.ref_tensors(call)
    common = [k for k in ref if k in tgt]
    if not common:
        raise MetricsError(f"{call['key'] or '(root)'}: output structure differs: reference {sorted(ref)[:5]} "
                           f"vs target {sorted(tgt)[:5]}")
    out = worst(compare_tensors(ref[k], tgt[k], where=f"{call['key'] or '(root)'}[{k}]") for k in common)
    if len(common) != len(ref) or len(common) != len(tgt):
        out["structure"] = {"only_reference": sorted(set(ref) - set(tgt))[:10],
                            "only_target": sorted(set(tgt) - set(ref))[:10]}
    return out


ResultFn = Callable[[dict[str, Any]], None]  # one comparison record, see _record()


def _record(view: str, call: Mapping[str, Any], *, metrics: Mapping[str, Any] | None = None,
            error: str | None = None, stage: str | None = None) -> dict[str, Any]:
    rec: dict[str, Any] = {"view": view, "key": call["key"]}
    if metrics is not None:
        rec["metrics"] = dict(metrics)
    if error is not None:
        rec["error"] = error
        rec["stage"] = stage or "run"
    return rec


class CompareSink(CallSink):
    """Cumulative view, eager: each call's output is compared against the reference's when the call returns."""

    def __init__(self, reader: DumpReader, on_result: ResultFn, *, journal: Callable[[str, str], None] | None = None,
                 prefix: str = "") -> None:
        self.reader = reader
        self.on_result = on_result
        self.journal = journal
        self.prefix = prefix
        self.seen: set[str] = set()

    def enter(self, meta: CallMeta, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.journal:
            self.journal("enter-module", self.prefix + meta.key)

    def exit(self, meta: CallMeta, output: Any) -> None:
        if self.journal:
            self.journal("leave-module", self.prefix + meta.key)
        call = self.reader.by_key.get(meta.key)
        if call is None:
            return
        self.seen.add(meta.key)
        if output is None and call["compare"]:  # post hooks run with always_call: the forward raised in here
            self.on_result(_record("cumulative", call, error="no output: the forward raised inside this module",
                                   stage="run"))
            return
        try:
            self.on_result(_record("cumulative", call, metrics=compare_call(self.reader, call, output)))
        except MetricsError as exc:
            self.on_result(_record("cumulative", call, error=exc.message, stage="compare"))


def _capture_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What the cumulative view compiles: the model's call, in a frame of its own. Dynamo caches compiled code per
    code object and, by default, does not guard on hooks; compiling `module` itself could reuse a graph this
    process compiled earlier WITHOUT the capture hooks (the hooks would then silently not run)."""
    return module(*args, **kwargs)


def compile_for_capture(backend: Any) -> Callable[..., Any]:
    """`backend.compile` of the cumulative view's entry point; call it as `fn(module, args, kwargs)`."""
    return backend.compile(_capture_forward)


def capture_compiled_outputs(module: nn.Module, fn: Callable[..., Any], args: Sequence[Any],
                             kwargs: Mapping[str, Any], holder: "CaptureHooks") -> tuple[Any, list[tuple[str, Any]]]:
    """Run `fn = compile_for_capture(backend)` on `module` with `holder`'s hooks on its submodules; returns
    (output, [(key, flat output)]).

    The hooks only append to a list, which Dynamo traces into the graph (no graph break): the outputs are the
    backend's own. Keys count each module's completions, so the k-th call of a module is `name#k`.
    """
    holder.records.clear()
    with torch.no_grad(), torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        out = fn(module, tuple(args), dict(kwargs))
    records = list(holder.records)
    holder.records.clear()  # the same list object, always
    counts: dict[str, int] = {}
    keyed = []
    for name, o in records:
        k = counts.get(name, 0)
        counts[name] = k + 1
        keyed.append((call_key(name, k), o))
    return out, keyed


# One module-level list that every compiled-capture hook appends to. Dynamo does not guard on hooks by default
# (`skip_nnmodule_hook_guards`): a graph traced with an earlier set of hooks is reused for a same-shaped model and
# replays ITS appends. Appending to this one list, never replaced, keeps that replay pointed at the current capture.
_CUMULATIVE_SINK: list[tuple[str, tuple[tuple[str, torch.Tensor], ...]]] = []


class CaptureHooks:
    """Forward hooks that only append `(name, flat output)`: traceable by Dynamo without a graph break."""

    def __init__(self, module: nn.Module) -> None:
        self.records = _CUMULATIVE_SINK
        self.handles = [sub.register_forward_hook(_sink_hook(name)) for name, sub in module.named_modules()]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


_SINK_HOOKS: dict[str, Callable[..., None]] = {}


def _sink_hook(name: str) -> Callable[..., None]:
    """The capture hook for module `name`: one function object per name for the whole process, so that guards on
    hooks (`skip_nnmodule_hook_guards=False` while capturing) hold from one capture to the next."""
    hook = _SINK_HOOKS.get(name)
    if hook is None:
        def hook(mod: nn.Module, args: Any, output: Any) -> None:
            acc: list[tuple[str, torch.Tensor]] = []
            _flatten_traceable(output, "", acc)  # now: the model may mutate a returned ModelOutput later
            _CUMULATIVE_SINK.append((name, tuple(acc)))

        _SINK_HOOKS[name] = hook
    return hook


def _flatten_traceable(obj: Any, prefix: str, acc: list[tuple[str, torch.Tensor]]) -> None:
    """`capture.iter_tensors` in a form Dynamo traces without a graph break (same sub-names, caches skipped)."""
    if isinstance(obj, torch.Tensor):
        acc.append((prefix, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("past_key_values", "cache_params") or "cache" in str(k):
                continue
            _flatten_traceable(v, prefix + "." + str(k) if prefix else str(k), acc)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _flatten_traceable(v, prefix + "." + str(i) if prefix else str(i), acc)


# ============================================================================================ isolated view

_STUB_QUEUE: list[Any] = []  # the reference's outputs of the stubbed sub-calls, in call order
_STUB_SEEN: list[tuple[tuple[str, torch.Tensor], ...]] = []  # what the module passed to each stubbed sub-call
_MISSING = object()


def _stub_forward(*args: Any, **kwargs: Any) -> Any:
    """Stands in for a sub-call in the isolated view: records the inputs the module under test passes to it (its
    own ops may compute them) and returns the reference's output for that sub-call. Traceable by Dynamo."""
    acc: list[tuple[str, torch.Tensor]] = []
    _flatten_traceable(args, "args", acc)
    _flatten_traceable(kwargs, "kwargs", acc)
    _STUB_SEEN.append(tuple(acc))
    return _STUB_QUEUE.pop(0)


def _subcall_input_metrics(reader: DumpReader, kids: Sequence[Mapping[str, Any]],
                           seen: Sequence[tuple[tuple[str, torch.Tensor], ...]]) -> list[tuple[str, dict[str, Any]]]:
    """Metrics of what the module passed to each stubbed sub-call against what the reference passed."""
    out = []
    for kid, passed in zip(kids, seen):
        try:
            ref_args, ref_kwargs = reader.inputs(kid)
        except Unserializable:
            continue
        acc: list[tuple[str, torch.Tensor]] = []
        _flatten_traceable(ref_args, "args", acc)
        _flatten_traceable(ref_kwargs, "kwargs", acc)
        ref = dict(acc)
        tgt = dict(passed)
        common = [k for k in ref if k in tgt and ref[k].shape == tgt[k].shape]
        if common:
            out.append((kid["key"], worst(compare_tensors(ref[k], tgt[k]) for k in common)))
    return out


def _install_stubs(modules: Iterable[nn.Module]) -> list[tuple[nn.Module, Any]]:
    saved = []
    for m in {id(m): m for m in modules}.values():
        saved.append((m, m.__dict__.get("forward", _MISSING)))
        m.forward = _stub_forward  # type: ignore[method-assign]
    return saved


def _remove_stubs(saved: list[tuple[nn.Module, Any]]) -> None:
    for m, prev in saved:
        if prev is _MISSING:
            m.__dict__.pop("forward", None)
        else:
            m.forward = prev  # type: ignore[method-assign]


def _is_compile_error(exc: BaseException) -> bool:
    names = {type(e).__name__ for e in _chain(exc)}
    return bool(names & {"BackendCompilerFailed", "SimCompilerError", "Unsupported", "InternalTorchDynamoError"}) \
        or "backend='" in str(exc) and "raised" in str(exc)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _short(exc: BaseException, limit: int = 400) -> str:
    """`Type: first line` of an exception; a first line that only announces the cause (Dynamo's `backend='x'
    raised:`) is followed by the next line, which holds it."""
    lines = [ln.strip() for ln in f"{type(exc).__name__}: {exc}".splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    text = lines[0]
    if text.endswith(":") and len(lines) > 1:
        text += " " + lines[1]
    return text[:limit]


def run_isolated_view(modules: Mapping[str, nn.Module], reader: DumpReader,
                      runner: Callable[[str, nn.Module], Callable[..., Any]], on_result: ResultFn, *,
                      cast: Callable[[Any], Any] = lambda x: x, skip: Iterable[str] = (),
                      journal: Callable[[str, str], None] | None = None, prefix: str = "",
                      deadline: float | None = None) -> None:
    """Each reference call re-run alone: `runner(name, module)` (the target's compiled module, or a reference
    module) on the reference's inputs, its direct sub-calls stubbed with the reference's outputs for them.

    The call's metrics are the worst of its output and of the inputs it passes to its stubbed sub-calls (an own
    op whose result only feeds a sub-call, e.g. a rotary embedding applied before a projection, shows there; the
    record's `via` then names that sub-call).

    `cast` moves/casts inputs and stubbed outputs (to the target's device, to a reference's dtype). Calls whose
    inputs could not be stored, or that fail to compile or run, become error records; the rest metric records.
    """
    skipped = set(skip)
    for call in reader.calls:
        if call["key"] in skipped:
            continue
        if deadline is not None and time.monotonic() > deadline:
            on_result(_record("isolated", call, error="not run: out of time", stage="timeout"))
            continue
        module = modules.get(call["name"])
        if module is None:
            on_result(_record("isolated", call, error=f"module {call['name']!r} not found in the model", stage="compare"))
            continue
        try:
            args, kwargs = reader.inputs(call)
        except Unserializable as exc:
            on_result(_record("isolated", call, error=f"not run: {exc}", stage="capture"))
            continue
        kids = reader.children(call)
        kid_modules = [modules.get(k["name"]) for k in kids]
        if any(m is None for m in kid_modules):
            on_result(_record("isolated", call, error="a sub-module was not found in the model", stage="compare"))
            continue
        args, kwargs = cast(args), cast(kwargs)
        queue = [cast(reader.output(k)) for k in kids]
        if journal:
            journal("enter-module", prefix + call["key"])
        saved = _install_stubs(kid_modules)  # type: ignore[arg-type]
        _STUB_QUEUE[:] = queue
        _STUB_SEEN.clear()
        stage = "compile"
        try:
            fn = runner(call["name"], module)
            stage = "run"
            with torch.no_grad():
                out = fn(*args, **kwargs)
            left = len(_STUB_QUEUE)
            seen = list(_STUB_SEEN)
            _STUB_SEEN.clear()
            stage = "compare"
            metrics = compare_call(reader, call, out)
            del out
            via = None
            for kid_key, m in _subcall_input_metrics(reader, kids, seen):
                if float(m["rel"]) > float(metrics["rel"]) or math.isnan(float(m["rel"])):
                    via = kid_key
                metrics = {**worst([metrics, m]), **({"structure": metrics["structure"]} if "structure" in metrics else {})}
            rec = _record("isolated", call, metrics=metrics)
            if via is not None:
                rec["via"] = via  # the worst difference is in what this module passes to that sub-call
            if left:
                rec["note"] = f"{left} stubbed sub-call(s) not consumed"
        except MetricsError as exc:
            rec = _record("isolated", call, error=exc.message, stage="compare")
        except Exception as exc:
            rec = _record("isolated", call, error=_short(exc), stage="compile" if _is_compile_error(exc) else stage)
        finally:
            _STUB_QUEUE.clear()
            _STUB_SEEN.clear()
            _remove_stubs(saved)
        if journal:
            journal("leave-module", prefix + call["key"])
        on_result(rec)


# ============================================================================================ thresholds

def derive_reference_stats(primary: nn.Module, primary_ref: Any, secondaries: Sequence[tuple[Any, nn.Module]],
                           sample_inputs: Callable[[int], Mapping[str, Any]], samples: int, dump_root: Path, *,
                           keep: Iterable[int] = (), chunk_mb: float = 64.0,
                           views: Sequence[str] = VIEWS) -> dict[str, LayerStats]:
    """Reference-vs-reference statistics per call key: each secondary reference (a `config.Reference` and its
    module) against the primary's dump, in both views, over `samples` inputs. Dumps of samples in `keep` stay on
    disk (the target is compared against them); the others are deleted once measured."""
    stats: dict[str, LayerStats] = {}
    keep = set(keep)
    for s in range(samples):
        folder = dump_root / f"sample-{s}"
        record_reference(primary, sample_inputs(s), folder, chunk_mb=chunk_mb, meta=_dump_meta(primary_ref, s))
        reader = DumpReader(folder)
        for ref, module in secondaries:
            dt = DTYPES.get(ref.dtype)

            def cast(x: Any, dt: torch.dtype | None = dt, dev: str = ref.device) -> Any:
                return cast_tree(x, dtype=dt, device=dev)

            def add(rec: dict[str, Any]) -> None:
                if "metrics" not in rec:
                    return
                call = reader.by_key[rec["key"]]
                layer = stats.setdefault(rec["key"], LayerStats(module_class=call["module_class"], name=call["name"]))
                layer.add(rec["view"], rec["metrics"])

            if "cumulative" in views:
                args, kwargs = reader.inputs(reader.root())
                capture_layer_outputs(module, cast(args), cast(kwargs), CompareSink(reader, add))
            if "isolated" in views:
                run_isolated_view(dict(module.named_modules()), reader, lambda _n, m: m, add, cast=cast)
        reader.close()
        if s not in keep:
            shutil.rmtree(folder, ignore_errors=True)
    return stats


def runnable_reference(module: nn.Module, dtype: str) -> list[str]:
    """Adjust a reference model so that it can run in `dtype`; returns what was changed (for the notes).

    transformers' MoE experts default to `torch._grouped_mm`, which has no float64 kernel: a float64 reference of a
    Mixtral-style model switches to the `eager` experts (a loop over experts, the same math).
    """
    changed = []
    config = getattr(module, "config", None)
    if dtype == "float64" and config is not None and getattr(config, "_experts_implementation", None) not in (None, "eager"):
        try:
            config._experts_implementation = "eager"
            changed.append("experts_implementation=eager (grouped_mm has no float64 kernel)")
        except (AttributeError, ValueError, TypeError):
            pass
    return changed


def _dump_meta(ref: Any, sample: int) -> dict[str, Any]:
    return {"sample": sample, "reference": {"id": getattr(ref, "id", "?"), "device": getattr(ref, "device", "cpu"),
                                            "dtype": getattr(ref, "dtype", "float32")},
            "torch": torch.__version__}


# ============================================================================================ target

@dataclass(frozen=True, kw_only=True)
class TargetPlan:
    """What a target run does (JSON-able: it is the payload of the child process)."""

    model: Mapping[str, Any]  # ModelSpec fields
    backend: Mapping[str, Any]  # BackendSpec fields
    seed: int
    dtype: str  # the primary reference's dtype: the target runs the same weights in it
    dumps: tuple[str, ...]  # one reference dump folder per compared sample
    results: str  # JSONL file the comparison records are appended to
    journal: str
    views: tuple[str, ...] = VIEWS
    skip: Mapping[str, Sequence[str]] = field(default_factory=dict)  # "<view>:<sample>" -> keys already done
    deadline_wall: float | None = None  # time.time() after which no new module is started
    isolated: str = "all"  # "auto": only when the cumulative view flags or fails something (needs `thresholds`)
    thresholds: str | None = None  # the thresholds file, for `isolated: auto`
    threshold_options: Mapping[str, Any] = field(default_factory=dict)


def compare_target(module: nn.Module, backend: Any, plan: TargetPlan, emit: ResultFn,
                   journal: Callable[[str, str], None] | None = None, *, table: ThresholdTable | None = None) -> None:
    """Both views of the target against every dump of `plan`; each record goes to `emit` as it is made.

    `module` is the model in the primary reference's dtype on CPU; it is moved to the backend's device (eager
    devices) and compiled whole for the cumulative view, then module by module for the isolated view. With
    `plan.isolated == "auto"` the isolated view runs only when the cumulative view flags a layer (against `table`,
    else the thresholds file of the plan), fails, or misses one; otherwise a `{"view": "isolated", "status":
    "skipped"}` record says so. Each view ends with a status record carrying its `seconds`.
    """
    if plan.isolated == "auto" and table is None and plan.thresholds:
        from ..thresholds import load_table

        table = load_table(Path(plan.thresholds), ThresholdOptions.from_mapping(plan.threshold_options))
    needed = plan.isolated != "auto" or table is None
    inner = emit

    def emit(rec: dict[str, Any]) -> None:  # noqa: F811 - watches the cumulative records go by
        nonlocal needed
        if rec.get("view") == "cumulative" and not needed:
            if "error" in rec or rec.get("status") == "error" or rec.get("unobserved_count"):
                needed = True
            elif "metrics" in rec and table is not None and exceeded(rec["metrics"], table.get(rec["key"], "cumulative")[0]):
                needed = True
        inner(rec)

    device = getattr(backend, "device", "cpu")
    if device != "cpu":
        module = backend.to_device(module)
    readers = [DumpReader(Path(d)) for d in plan.dumps]
    deadline = None
    if plan.deadline_wall is not None:
        deadline = time.monotonic() + max(0.0, plan.deadline_wall - time.time())

    def to_dev(x: Any) -> Any:
        return cast_tree(x, device=device)

    with torch._dynamo.config.patch(**DYNAMO_SETTINGS):
        if "cumulative" in plan.views:
            _cumulative(module, backend, readers, plan, emit, to_dev, journal)
        if "isolated" in plan.views and not needed:
            emit({"view": "isolated", "status": "skipped", "seconds": 0.0,
                  "reason": "the cumulative view flagged no layer (isolated: auto)"})
        elif "isolated" in plan.views:
            t0 = time.monotonic()
            compiled: dict[str, Callable[..., Any]] = {}

            def runner(name: str, m: nn.Module) -> Callable[..., Any]:
                if name not in compiled:
                    compiled[name] = backend.compile(m)
                return compiled[name]

            modules = dict(module.named_modules())
            for s, reader in enumerate(readers):
                skip = set(plan.skip.get(f"isolated:{s}", ()))

                def emit_s(rec: dict[str, Any], s: int = s) -> None:
                    emit({**rec, "sample": s})

                run_isolated_view(modules, reader, runner, emit_s, cast=to_dev, skip=skip, journal=journal,
                                  prefix=f"isolated:{s}:", deadline=deadline)
            emit({"view": "isolated", "status": "done", "seconds": round(time.monotonic() - t0, 4)})
    for r in readers:
        r.close()


def _cumulative(module: nn.Module, backend: Any, readers: Sequence[DumpReader], plan: TargetPlan, emit: ResultFn,
                to_dev: Callable[[Any], Any], journal: Callable[[str, str], None] | None) -> None:
    eager = bool(getattr(backend, "is_eager", False))
    appender = None if eager else CaptureHooks(module)
    fn = None
    try:
        for s, reader in enumerate(readers):
            if f"cumulative:{s}" in plan.skip:
                continue
            root = reader.root()
            args, kwargs = reader.inputs(root)
            args, kwargs = to_dev(args), to_dev(kwargs)
            tag = f"cumulative:{s}"
            if journal:
                journal("enter-module", tag)
            t0 = time.monotonic()
            try:
                if eager:
                    sink = CompareSink(reader, lambda r, s=s: emit({**r, "sample": s}), journal=journal, prefix=tag + ":")
                    capture_layer_outputs(module, args, kwargs, sink)
                    seen = sink.seen
                else:
                    assert appender is not None
                    if fn is None:
                        fn = compile_for_capture(backend)
                    _out, records = capture_compiled_outputs(module, fn, args, kwargs, appender)
                    if not records and reader.calls:
                        raise CaptureError("the compiled model ran but none of the capture hooks did")
                    seen = set()
                    records.reverse()
                    while records:
                        key, out = records.pop()  # drop each output once compared
                        call = reader.by_key.get(key)
                        if call is None:
                            continue
                        seen.add(key)
                        flat = dict(out)
                        flat = {k: t for k, t in flat.items() if t.is_floating_point() or t.is_complex()} or flat
                        try:
                            emit({**_record("cumulative", call, metrics=compare_flat(reader, call, flat)), "sample": s})
                        except MetricsError as exc:
                            emit({**_record("cumulative", call, error=exc.message, stage="compare"), "sample": s})
                        del out, flat
                missing = [c["key"] for c in reader.calls if c["key"] not in seen]
                emit({"view": "cumulative", "sample": s, "status": "ok", "unobserved": missing[:50],
                      "unobserved_count": len(missing), "seconds": round(time.monotonic() - t0, 4)})
            except Exception as exc:
                emit({"view": "cumulative", "sample": s, "status": "error", "error": _short(exc, 2000),
                      "stage": "compile" if _is_compile_error(exc) else "run"})
            if journal:
                journal("leave-module", tag)
    finally:
        if appender is not None:
            appender.remove()


def target_child(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Entry point of the target child process (`run_isolated("ci_runner.modes.numerics:target_child", …)`)."""
    from ..backends import resolve_backend
    from ..config import BackendSpec, ModelSpec
    from ..isolate import child_journal
    from ..models import load_model

    plan = TargetPlan(**{**payload, "dumps": tuple(payload["dumps"]), "views": tuple(payload["views"])})
    backend = resolve_backend(spec_from_json(BackendSpec, plan.backend))
    loaded = load_model(spec_from_json(ModelSpec, plan.model), seed=plan.seed, dtype=plan.dtype, device="cpu")
    out = Path(plan.results)
    n = 0

    def emit(rec: dict[str, Any]) -> None:
        nonlocal n
        n += 1
        append_line(out, json.dumps(_json_safe(rec), allow_nan=False))

    compare_target(loaded.module, backend, plan, emit, journal=child_journal)
    return {"records": n}


def _json_safe(obj: Any) -> Any:
    from ..results import _clean

    return _clean(obj)


def read_records(path: Path) -> list[dict[str, Any]]:
    from ..results import number

    out = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if "metrics" in rec:
            rec["metrics"] = {k: (number(v) if k in ("rel", "cos", "mad", "max_abs", "sqnr_db", "ref_absmean") else v)
                              for k, v in rec["metrics"].items()}
        out.append(rec)
    return out


# ============================================================================================ the mode

def _parse_journal_entry(entry: str | None) -> tuple[str, int, str] | None:
    """`isolated:0:model.layers.0.mlp` → ("isolated", 0, key); `cumulative:1` → ("cumulative", 1, "")."""
    if not entry:
        return None
    parts = entry.split(":", 2)
    if len(parts) < 2 or parts[0] not in VIEWS:
        return None
    try:
        s = int(parts[1])
    except ValueError:
        return None
    return parts[0], s, parts[2] if len(parts) > 2 else ""


def _run_target(ctx: "ModeContext", opts: NumericsOptions, dumps: list[Path], work: Path,
                table: ThresholdTable) -> tuple[list[dict[str, Any]], list[str]]:
    """Compare the target against `dumps` (child processes unless `isolate: false`); (records, notes)."""
    from ..isolate import run_isolated
    from ..modes import last_open_entry

    primary = ctx.cell.references[0]
    results = work / "target.jsonl"
    journal = work / "journal.log"
    for p in (results, journal):
        if p.exists():
            p.unlink()
    notes: list[str] = []
    base = dict(model=spec_to_json(ctx.cell.model), backend=spec_to_json(ctx.cell.backend), seed=ctx.cell.inputs.seed,
                dtype=primary.dtype, dumps=tuple(str(d) for d in dumps), results=str(results), journal=str(journal),
                views=opts.views, isolated=opts.isolated, thresholds=str(table.path) if table.path else None,
                threshold_options=opts.thresholds.as_dict())
    if not opts.isolate:
        loaded = ctx.model(dtype=primary.dtype, device="cpu")
        module = loaded.module
        if ctx.backend.device != "cpu":  # moving would move the reference model too: use a copy
            from ..models import load_model

            module = load_model(ctx.cell.model, seed=ctx.cell.inputs.seed, dtype=primary.dtype, device="cpu").module
        plan = TargetPlan(**base, deadline_wall=time.time() + ctx.remaining() * 0.9)

        def emit(rec: dict[str, Any]) -> None:
            append_line(results, json.dumps(_json_safe(rec), allow_nan=False))

        def jour(event: str, name: str) -> None:
            append_line(journal, f"{event}\t{name}")

        compare_target(module, ctx.backend, plan, emit, journal=jour, table=table)
        return read_records(results), notes

    skip: dict[str, list[str]] = {}
    crashed: list[dict[str, Any]] = []
    for attempt in range(opts.max_restarts + 1):
        budget = ctx.remaining() - 5.0
        if opts.timeout is not None:
            budget = min(budget, opts.timeout)
        if budget <= 5.0:
            notes.append("the target was not (fully) compared: the cell ran out of time")
            break
        records = read_records(results)
        skip = _done_keys(records, crashed)
        payload = {**base, "skip": skip, "deadline_wall": time.time() + budget * 0.9}
        if attempt:  # a child died: the cumulative view is incomplete or the isolated view had started
            payload["isolated"] = "all"
        res = run_isolated("ci_runner.modes.numerics:target_child", payload, timeout=budget, journal=journal,
                           env=dict(ctx.cell.backend.env))
        if res.status == "ok":
            break
        entry = _parse_journal_entry(last_open_entry(journal))
        what = {"crashed": f"crashed ({res.signal or res.message})", "timeout": "timed out",
                "error": f"failed: {res.error_type}: {res.message.splitlines()[0] if res.message else ''}"}.get(res.status, res.status)
        if res.status == "error" and entry is None:
            notes.append(f"the target child {what}")
            if res.traceback:
                notes.append(res.traceback[-1500:])
            break
        if entry is None:
            notes.append(f"the target child {what} before any module was entered")
            break
        view, s, key = entry
        crashed.append({"view": view, "sample": s, "key": key, "status": res.status, "message": what,
                        "stderr": (res.stderr_tail or "")[-1500:]})
        append_line(journal, f"leave-module\t{view}:{s}:{key}" if key else f"leave-module\t{view}:{s}")
        notes.append(f"the target child {what} in {view} view, sample {s}" + (f", module {key or '(root)'}" if view == "isolated" or key else ""))
    else:
        notes.append(f"gave up after {opts.max_restarts} restarts")
    records = read_records(results)
    for c in crashed:
        if c["view"] == "cumulative" and not c["key"]:
            records.append({"view": "cumulative", "sample": c["sample"], "status": "error", "stage": "run",
                            "error": f"the whole-model run {c['message']}"})
        elif c["view"] == "cumulative":
            records.append({"view": "cumulative", "sample": c["sample"], "status": "error", "stage": "run",
                            "error": f"the whole-model run {c['message']} in module {c['key'] or '(root)'}"})
        else:
            records.append({"view": "isolated", "sample": c["sample"], "key": c["key"], "stage": "run",
                            "error": f"{c['message']}", "crash": c["status"]})
    return records, notes


def _done_keys(records: list[dict[str, Any]], crashed: list[dict[str, Any]]) -> dict[str, list[str]]:
    skip: dict[str, list[str]] = {}
    for r in records:
        if r.get("view") == "isolated" and "key" in r and "sample" in r:
            skip.setdefault(f"isolated:{r['sample']}", []).append(r["key"])
        elif r.get("view") == "cumulative" and "status" in r:
            skip.setdefault(f"cumulative:{r['sample']}", [])
    for c in crashed:
        if c["view"] == "isolated":
            skip.setdefault(f"isolated:{c['sample']}", []).append(c["key"])
        else:
            skip.setdefault(f"cumulative:{c['sample']}", [])
    return skip


def _rel_path(name: str) -> str:
    """`model.layers.3.post_attention_layernorm` → `model.layers.*.post_attention_layernorm`."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)


@dataclass
class _Layer:
    key: str
    name: str
    module_class: str
    call_index: int
    idx: int
    done: int
    depth: int
    metrics: dict[str, dict[str, Any] | None] = field(default_factory=lambda: {"cumulative": None, "isolated": None})
    errors: dict[str, str] = field(default_factory=dict)
    threshold: dict[str, dict[str, float]] = field(default_factory=dict)
    threshold_source: dict[str, str] = field(default_factory=dict)
    exceeded: dict[str, list[str]] = field(default_factory=dict)
    via: str | None = None  # isolated view: the sub-call whose inputs (computed by this layer) differ most

    def flagged(self, view: str) -> bool:
        return bool(self.exceeded.get(view))


def _merge(layer: _Layer, view: str, metrics: Mapping[str, Any]) -> None:
    cur = layer.metrics.get(view)
    layer.metrics[view] = dict(metrics) if cur is None else worst([cur, metrics])


def _build_layers(reader: DumpReader, records: list[dict[str, Any]], table: ThresholdTable) -> list[_Layer]:
    layers = {c["key"]: _Layer(key=c["key"], name=c["name"], module_class=c["module_class"],
                               call_index=c["call_index"], idx=c["idx"], done=c.get("done", c["idx"]), depth=c["depth"])
              for c in reader.calls}
    for r in records:
        key = r.get("key")
        if key is None or key not in layers:
            continue
        layer = layers[key]
        if "metrics" in r:
            prev = layer.metrics.get(r["view"])
            _merge(layer, r["view"], r["metrics"])
            if r["view"] == "isolated" and (prev is None or float(r["metrics"]["rel"]) >= float(prev["rel"])):
                layer.via = r.get("via")
        elif "error" in r:
            layer.errors.setdefault(r["view"], f"{r.get('stage', 'run')}: {r['error']}")
    for layer in layers.values():
        for view in VIEWS:
            thr, source = table.get(layer.key, view)
            layer.threshold[view] = thr
            layer.threshold_source[view] = source
            m = layer.metrics.get(view)
            layer.exceeded[view] = exceeded(m, thr) if m is not None else []
    return sorted(layers.values(), key=lambda l: l.idx)


def _verdict(layers: list[_Layer], *, isolated_ran: bool) -> dict[str, Any]:
    by_done = sorted(layers, key=lambda l: l.done)
    cum = [l for l in by_done if l.flagged("cumulative")]
    iso = [l for l in by_done if l.flagged("isolated")]
    # where the divergence starts: the first layer wrong on its own (its output, or what it passes on, may show
    # up in a sub-call's output first: the attention's error surfaces at o_proj, inside self_attn); else, for
    # pure drift, the first layer over threshold in the cumulative view
    first = (iso or cum or [None])[0]
    if first is None:
        errs = sum(1 for l in layers if l.errors)
        text = "no layer exceeds its threshold" + (f" ({errs} layer(s) could not be compared)" if errs else "")
        return {"first_divergent": None, "kind": None, "pattern": None, "text": text}
    kind: str
    pattern: str | None = None
    if iso:
        groups: dict[tuple[str, str], set[str]] = {}
        for l in iso:
            groups.setdefault(("class", l.module_class), set()).add(l.name)
            groups.setdefault(("path", _rel_path(l.name)), set()).add(l.name)
        best = max(groups.items(), key=lambda kv: (len(kv[1]), kv[0][0] == "class"))
        if len(best[1]) >= 2:
            kind, pattern = "layer_class", best[0][1]
            members = sorted(best[1])
            text = (f"{len(members)} layers of {'class' if best[0][0] == 'class' else 'path'} {pattern} diverge on "
                    f"their own (isolated view): {', '.join(members[:6])}{' …' if len(members) > 6 else ''}; "
                    f"first divergent layer {first.name or '(root)'}")
        else:
            kind = "algorithmic"
            owner = iso[0]
            text = (f"{owner.name or '(root)'} ({owner.module_class}) diverges on its own (isolated view: a sudden "
                    f"jump, not carried-in drift); first divergent layer {first.name or '(root)'}")
        others = {l.name for l in cum} - {l.name for l in iso}
        if others:
            text += f"; {len(others)} downstream layer(s) carry the error (cumulative view)"
    else:
        kind = "drift"
        rels = [float(l.metrics["cumulative"]["rel"]) for l in by_done if l.metrics.get("cumulative")]
        text = (f"accumulated drift: no layer is wrong on its own{'' if isolated_ran else ' (isolated view not run)'}, "
                f"but the cumulative error grows past the thresholds from {first.name or '(root)'} on "
                f"(rel up to {max(rels):.2e})")
    return {"first_divergent": first.name, "kind": kind, "pattern": pattern, "text": text}


def _fmt(m: Mapping[str, Any] | None) -> str:
    if not m:
        return "n/a"
    return f"rel {float(m['rel']):.2e}, cos {float(m['cos']):.6f}"


def _findings(ctx: "ModeContext", layers: list[_Layer], verdict: Mapping[str, Any], opts: NumericsOptions) -> tuple[list[Finding], int]:
    backend_id, model_id = ctx.cell.backend.id, ctx.cell.model.id
    by_name: dict[str, list[_Layer]] = {}
    for l in layers:
        by_name.setdefault(l.name, []).append(l)
    iso_names = [n for n, ls in by_name.items() if any(l.flagged("isolated") for l in ls)]
    chosen: list[tuple[str, str]] = [(n, "isolated") for n in iso_names]
    if not chosen and verdict.get("first_divergent") is not None:
        chosen = [(verdict["first_divergent"], "cumulative")]
    downstream = sum(1 for l in layers if l.flagged("cumulative"))
    findings = []
    for name, why in chosen:
        ls = by_name[name]
        worst_l = max(ls, key=lambda l: float((l.metrics.get(why) or {}).get("rel", 0.0)))
        both = any(l.flagged("cumulative") for l in ls) and any(l.flagged("isolated") for l in ls)
        view = "both" if both else why
        m = worst_l.metrics.get(why) or {}
        thr = worst_l.threshold.get(why, {})
        over = worst_l.exceeded.get(why, [])
        sev = severity(m) if m else "n/a"
        if why == "isolated":
            where = f" in what it passes to {worst_l.via}" if worst_l.via else ""
            msg = (f"{name or '(root)'} ({worst_l.module_class}) diverges on its own{where}: {_fmt(m)} against "
                   f"threshold rel {thr.get('rel', math.nan):.2e} / cos {thr.get('cos', math.nan):.6f} (isolated "
                   f"view, {sev})")
        else:
            msg = (f"accumulated drift first exceeds the threshold at {name or '(root)'} ({worst_l.module_class}): "
                   f"{_fmt(m)} against rel {thr.get('rel', math.nan):.2e} (cumulative view, {sev}); "
                   f"{downstream} layer(s) over threshold downstream, none wrong on its own")
        if name == verdict.get("first_divergent"):
            msg += "; first divergent layer"
        findings.append(Finding(
            kind="divergence", stage="compare", message=msg,
            fingerprint=fingerprint("divergence", backend_id, model_id, name),
            module=name, module_class=worst_l.module_class,
            metrics={v: public(worst_l.metrics[v]) for v in VIEWS if worst_l.metrics.get(v)},
            threshold={v: dict(worst_l.threshold[v]) for v in VIEWS if v in worst_l.threshold},
            details={"view": view, "exceeded": over, "severity": sev, "calls": len(ls), "via": worst_l.via,
                     "relative_path": _rel_path(name), "first_divergent": name == verdict.get("first_divergent"),
                     "verdict": verdict.get("kind"), "pattern": verdict.get("pattern"),
                     "downstream_flagged": downstream if why == "cumulative" else None},
        ))
    findings.sort(key=lambda f: -float((f.metrics.get("isolated") or f.metrics.get("cumulative") or {}).get("rel", 0.0)))
    total = len(findings)
    return findings[: opts.max_findings], total


def _table(layers: list[_Layer], cap: int) -> list[dict[str, Any]]:
    out = []
    for i, l in enumerate(layers[:cap]):
        row: dict[str, Any] = {
            "name": l.name, "module_class": l.module_class, "index": i, "key": l.key, "call_index": l.call_index,
            "depth": l.depth,
            "cumulative": public(l.metrics["cumulative"]) if l.metrics.get("cumulative") else None,
            "isolated": public(l.metrics["isolated"]) if l.metrics.get("isolated") else None,
            "threshold": dict(l.threshold.get("cumulative") or {}),
            "threshold_isolated": dict(l.threshold.get("isolated") or {}),
            "flagged_cumulative": l.flagged("cumulative"),
            "flagged_isolated": l.flagged("isolated"),
        }
        if l.via:
            row["isolated_via"] = l.via
        if l.errors:
            row["errors"] = dict(l.errors)
        if "fallback" in l.threshold_source.values():
            row["threshold_source"] = dict(l.threshold_source)
        out.append(row)
    return out


def _view_status(layers: list[_Layer], view: str, *, errors: bool, wanted: bool) -> str:
    """`ran` (every layer compared), `partial`, `error` (nothing compared) or `not run`."""
    if not wanted:
        return "not run"
    compared = sum(1 for l in layers if l.metrics.get(view) is not None)
    failed = errors or any(view in l.errors for l in layers)
    if compared == 0:
        return "error" if failed else "not run"
    return "partial" if failed or compared < len(layers) else "ran"


def _thresholds_folder(ctx: "ModeContext", opts: NumericsOptions) -> Path:
    if opts.thresholds.thresholds_dir:
        return Path(os.path.expanduser(opts.thresholds.thresholds_dir))
    return ctx.cell_dir.parent.parent / "thresholds"


def derive_for_cell(ctx: "ModeContext", opts: NumericsOptions, dump_root: Path, keep: Iterable[int]) -> tuple[ThresholdTable, str]:
    """Load the model's thresholds, or derive them (once per key, under a file lock)."""
    from ..models import model_fingerprint

    refs = ctx.cell.references
    primary = refs[0]
    samples = opts.thresholds.samples or max(2, ctx.cell.inputs.samples)
    key = threshold_key(model_fingerprint=model_fingerprint(ctx.cell.model), inputs=ctx.cell.inputs.key(),
                        references=[{"id": r.id, "device": r.device, "dtype": r.dtype} for r in refs], samples=samples)
    path = threshold_path(_thresholds_folder(ctx, opts), ctx.cell.model.id, key)

    def derive() -> dict[str, LayerStats]:
        from ..models import load_model

        loaded = ctx.model(dtype=primary.dtype, device=primary.device)
        # secondary references are loaded here, not through ctx's cache: their memory (a float64 copy is twice the
        # weights) is freed as soon as the thresholds are derived
        secondaries = [(r, load_model(ctx.cell.model, seed=ctx.cell.inputs.seed, dtype=r.dtype, device=r.device).module)
                       for r in refs[1:]]
        for r, module in secondaries:
            runnable_reference(module, r.dtype)

        def sample_inputs(s: int) -> Mapping[str, Any]:
            return ctx.inputs(loaded, sample=s, device=primary.device)

        with torch._dynamo.config.patch(**DYNAMO_SETTINGS):
            return derive_reference_stats(loaded.module, primary, secondaries, sample_inputs, samples, dump_root,
                                          keep=keep, chunk_mb=opts.chunk_mb, views=opts.views)

    return load_or_derive(path, key, opts.thresholds, primary.dtype, derive)


def run(ctx: "ModeContext") -> ModeResult:
    """The numerics mode (see the module docstring)."""
    t0 = time.monotonic()
    from ..dumps import after_numerics, before_numerics, reference_dumps, split_numerics_options

    toolbox, numerics_options = split_numerics_options(ctx.options("numerics"))  # weights/batch/bisect/dumps
    opts = NumericsOptions.from_mapping(numerics_options)
    refs = ctx.cell.references
    if len(refs) < 2:
        return ModeResult(status="error", reason="numerics needs at least two references to derive thresholds from "
                                                 "(the matrix lists one); add e.g. {id: cpu-fp64, device: cpu, dtype: float64}")
    primary = refs[0]
    if primary.dtype not in DTYPES:
        return ModeResult(status="error", reason=f"primary reference dtype {primary.dtype!r} is not one of {list(DTYPES)}")
    work = ctx.artifact_dir("numerics")
    dump_root = work / "ref"
    compare = list(range(opts.compare_samples))
    timings: dict[str, float] = {}
    notes: list[str] = []
    pre = before_numerics(ctx, toolbox, isolate=opts.isolate)  # the weights check, before any forward
    notes.extend(pre.notes)

    t = time.monotonic()
    table, how = derive_for_cell(ctx, opts, dump_root, keep=compare)
    timings["thresholds_s"] = round(time.monotonic() - t, 3)
    notes.append(f"thresholds {how}")

    t = time.monotonic()
    loaded = ctx.model(dtype=primary.dtype, device=primary.device)
    dumps = []
    if toolbox.reference_dump:  # dumped elsewhere (`deepview-ci dump --reference`): replaces the reference pass
        dumps, compare = reference_dumps(ctx, toolbox)
        notes.append(f"reference pass replaced by dump(s) {', '.join(str(d) for d in dumps)}")
    for s in compare if not toolbox.reference_dump else ():
        folder = dump_root / f"sample-{s}"
        if table.reused or not (folder / "index.json").exists():  # derived now: derive() left it on disk
            record_reference(loaded.module, ctx.inputs(loaded, sample=s, device=primary.device), folder,
                             chunk_mb=opts.chunk_mb, meta=_dump_meta(primary, s))
        dumps.append(folder)
    timings["reference_s"] = round(time.monotonic() - t, 3)
    t = time.monotonic()
    records, target_notes = _run_target(ctx, opts, dumps, work, table)
    notes.extend(target_notes)
    timings["target_s"] = round(time.monotonic() - t, 3)

    iso_status = [r for r in records if r.get("view") == "isolated" and "status" in r]
    timings["target_cumulative_s"] = round(sum(float(r.get("seconds", 0.0)) for r in records
                                               if r.get("view") == "cumulative" and "status" in r), 3)
    timings["target_isolated_s"] = round(sum(float(r.get("seconds", 0.0)) for r in iso_status), 3)
    iso_skipped = next((r.get("reason") for r in iso_status if r["status"] == "skipped"), None)
    reader = DumpReader(dumps[0])
    layers = _build_layers(reader, records, table)
    reader.close()
    cumulative_status = [r for r in records if r.get("view") == "cumulative" and "status" in r]
    cum_errors = [r for r in cumulative_status if r["status"] == "error"]
    iso_ran = any(l.metrics.get("isolated") for l in layers)
    cum_ran = any(l.metrics.get("cumulative") for l in layers)
    verdict = _verdict(layers, isolated_ran=iso_ran)
    findings, total_findings = _findings(ctx, layers, verdict, opts)
    post = after_numerics(ctx, toolbox, table=table, layers=layers, verdict=verdict, findings=findings,
                          isolate=opts.isolate)  # batch invariance, bisect of the divergent layer
    errors = [{"key": l.key, "module_class": l.module_class, **{f"{v}": e for v, e in l.errors.items()}}
              for l in layers if l.errors]
    data: dict[str, Any] = {
        "layers": _table(layers, opts.max_layers),
        "layers_total": len(layers),
        "verdict": verdict,
        "thresholds": {"file": str(table.path) if table.path else None, "reused": table.reused,
                       "key_hash": table.path.stem.rsplit("-", 1)[-1] if table.path else None,
                       "references": [r.id for r in refs], "options": opts.thresholds.as_dict(),
                       "derive_seconds": table.derive_seconds},
        "views": {view: _view_status(layers, view, errors=bool(cum_errors) if view == "cumulative" else False,
                                     wanted=view in opts.views) for view in VIEWS},
        "isolated": opts.isolated,
        "compare_samples": compare,
        "timings": timings,
        "notes": notes,
    }
    if iso_skipped:
        data["views"]["isolated"] = "skipped"
        notes.append(f"isolated view skipped: {iso_skipped}")
    if len(layers) > opts.max_layers:
        data["layers_truncated"] = f"{len(layers) - opts.max_layers} more layers not listed (max_layers={opts.max_layers})"
    if cum_errors:
        data["cumulative_errors"] = [{"sample": r["sample"], "stage": r.get("stage"), "error": r["error"]} for r in cum_errors]
    if errors:
        data["errors"] = errors[:200]
        data["errors_total"] = len(errors)
    if total_findings > len(findings):
        data["findings_truncated"] = total_findings - len(findings)
    findings = pre.findings + findings + post.findings
    data.update({**pre.data, **post.data})
    notes.extend(post.notes)
    if not opts.keep_dumps:
        shutil.rmtree(dump_root, ignore_errors=True)
    else:
        data["dumps"] = [str(d.relative_to(ctx.cell_dir)) if d.is_relative_to(ctx.cell_dir) else str(d) for d in dumps]
    duration = time.monotonic() - t0
    if not cum_ran and not iso_ran:
        why = cum_errors[0]["error"] if cum_errors else (notes[-1] if notes else "no comparison could run")
        return ModeResult(status="error", reason=f"the target could not be compared: {why}", findings=findings,
                          data=data, duration_s=duration)
    reason = None
    partial = []
    if not cum_ran:
        partial.append("cumulative view did not run" + (f" ({cum_errors[0]['error'][:300]})" if cum_errors else ""))
    if "isolated" in opts.views and not iso_ran and not iso_skipped:
        partial.append("isolated view did not run")
    if errors:
        partial.append(f"{len(errors)} layer(s) could not be compared")
    if partial:
        reason = "partial: " + "; ".join(partial)
    return ModeResult(status="fail" if findings else "pass", findings=findings, reason=reason, data=data,
                      duration_s=duration)


__all__ = [
    "CallMeta", "CallSink", "CompareSink", "DumpReader", "DumpWriter", "NumericsOptions", "RecordingSink",
    "CaptureHooks", "TargetPlan", "capture_compiled_outputs", "capture_layer_outputs", "compile_for_capture", "cast_tree", "compare_call",
    "compare_target", "compared_tensors", "decode_value", "derive_reference_stats", "encode_value",
    "record_reference", "run", "run_isolated_view", "target_child",
]
