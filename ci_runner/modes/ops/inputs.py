"""The `ops` mode's synthetic inputs: a probe's tensors from its recorded shapes, strides and dtypes.

`with_ranges` gives each tensor of a call the values that keep the op in its domain and its contract: a value
range per tensor (positive floats for log/sqrt …, integers that are valid indices), and for the ops whose contract
ties one input to another (`INVARIANTS`) a mask's True count (`trues`: masked_scatter, index_put with a bool
index) or sorted offsets from 0 (`offsets`: embedding_bag). `make_tensor` draws them, in chunks straight into the
tensor's storage. `input_bytes` is what a probe's inputs take (the parent's memory guard,
`ops.max_probe_input_mb`). The functions of `SCRIPT_FUNCTIONS` are self-contained (torch only): their source is
copied into every op repro script, so a repro rebuilds exactly the values the probe used.
"""

from __future__ import annotations

import json
import math
import zlib
from typing import Any, Callable, Mapping, Sequence

import torch

from ...engine.codec import source_of, tensor_specs
from .compare import matches_any

__all__ = ["POSITIVE_INPUT_OPS", "SCRIPT_FUNCTIONS", "build_tensors", "call_source", "copy_tensors", "input_bytes",
           "make_tensor", "probe_seed", "storage_span", "with_ranges"]

# Ops whose floating inputs must be positive to stay in their domain (log, sqrt, pow with fractional exponents …).
POSITIVE_INPUT_OPS = ("log", "log2", "log10", "log1p", "sqrt", "rsqrt", "pow", "reciprocal", "div", "lgamma",
                      "digamma", "polygamma", "xlogy", "_standard_gamma", "bernoulli", "multinomial", "erfinv",
                      "float_power", "true_divide", "divide", "special_*", "_weight_norm*")


# --------------------------------------------------------------------------------------------- drawing (copied into repros)

def storage_span(shape, stride):  # type: ignore[no-untyped-def]
    """Elements of storage a layout spans: 1 + its farthest offset (0 when a dimension is empty)."""
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(s > 0 for s in shape) else 0


def mask_with_trues(shape, stride, n, trues, gen):  # type: ignore[no-untyped-def]
    """The `n` storage elements of a bool mask with `trues` True elements in seeded random places; an element a
    layout shows several times (stride 0) counts that many times, and then the count may stay below `trues`."""
    where = torch.arange(n).as_strided(tuple(shape), tuple(stride)).reshape(-1)
    shown = torch.zeros(n, dtype=torch.int64).index_add_(0, where, torch.ones_like(where))
    order = torch.randperm(n, generator=gen)
    order = order[shown[order] > 0]
    out = torch.zeros(n, dtype=torch.bool)
    out[order[torch.cumsum(shown[order], 0) <= trues]] = True
    return out


def make_tensor(shape, stride, dtype, low, high, seed, trues=None, offsets=False, chunk=1 << 22,  # type: ignore[no-untyped-def]
                masked_rows=None):
    """A synthetic input with the recorded shape, stride and dtype; values uniform in [low, high) from `seed`.

    Drawn in float64 / int64 `chunk` elements at a time, each scaled and cast into the tensor's storage (the
    generator's sequence is the same as one draw of the whole: the same values, a bounded buffer). `trues`: a bool
    mask with that many True elements; `offsets`: the values sorted, the first one `low` (embedding_bag's offsets);
    `masked_rows`: an attention mask whose query rows (second-to-last dimension) of these indices mask every key
    (False in a bool mask, -inf in an additive one), as a padded batch's padded queries are.
    """
    if masked_rows:
        t = make_tensor(shape, stride, dtype, low, high, seed, trues, offsets, chunk)
        fill = False if t.dtype == torch.bool else float("-inf")
        if t.dim() >= 2:
            for row in masked_rows:
                t[..., row, :] = fill
        return t
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype)
    t = torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype)
    n = storage_span(shape, stride)
    flat = t.as_strided((n,), (1,))  # the storage: fills overlapping (stride 0) layouts too
    if n > 0 and trues is not None:
        flat.copy_(mask_with_trues(shape, stride, n, trues, gen))
        return t
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        if dtype == torch.bool:
            part = torch.randint(0, 2, (m,), generator=gen)
        elif dtype.is_floating_point or dtype.is_complex:
            part = torch.rand(m, generator=gen, dtype=torch.float64).mul_(high - low).add_(low)
        else:
            part = torch.randint(int(low), max(int(high), int(low) + 1), (m,), generator=gen)
        flat[start:start + m].copy_(part)
    if offsets and n > 0:  # sorted storage: any 1-D layout with a positive stride reads it sorted
        flat.copy_(flat.sort().values)
        flat[0] = low
    return t


SCRIPT_FUNCTIONS: tuple[Callable[..., Any], ...] = (storage_span, mask_with_trues, make_tensor)


# --------------------------------------------------------------------------------------------- value ranges

def with_ranges(op: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The encoded call with a value range per tensor (`low`, `high`) that keeps the op in its domain, and the
    invariants of `INVARIANTS` (`trues`, `offsets`) where the op's contract ties its inputs together.

    Integer tensors (indices, ids, masks) take values in [0, smallest dimension of the call's other tensors),
    at most 16: valid for embedding, gather, index, index_select … whichever dimension they index.
    """
    args, kwargs = json.loads(json.dumps(args)), json.loads(json.dumps(kwargs))
    specs = list(tensor_specs([args, kwargs]))
    positive = matches_any(op, POSITIVE_INPUT_OPS)
    for i, spec in enumerate(specs):
        dtype = spec["dtype"]
        if dtype == "bool":
            low, high = 0, 2
        elif dtype.startswith(("float", "bfloat", "complex")):
            low, high = (0.1, 1.1) if positive else (-1.0, 1.0)
        else:
            dims = [int(d) for j, other in enumerate(specs) if j != i for d in other["shape"] if int(d) > 0]
            bound = min(dims) if dims else 16
            low, high = 0, max(1, min(bound, 16))
        spec["low"], spec["high"] = low, high
    for pattern, keep in INVARIANTS:
        if matches_any(op, (pattern,)):
            keep(args, kwargs)
    return args, kwargs


def _tensor(args: Sequence[Any], kwargs: Mapping[str, Any], index: int, name: str) -> dict[str, Any] | None:
    """The `__tensor__` body of argument `index` (positional) or `name` (keyword), if it is a tensor."""
    value = args[index] if index < len(args) else kwargs.get(name)
    return value["__tensor__"] if isinstance(value, dict) and isinstance(value.get("__tensor__"), dict) else None


def _numel(spec: Mapping[str, Any]) -> int:
    return math.prod(int(d) for d in spec["shape"])


def _keep_masked_scatter(args: list[Any], kwargs: dict[str, Any]) -> None:
    """masked_scatter(self, mask, source): the mask, broadcast to self's shape, has at most source.numel() Trues."""
    this, mask, source = (_tensor(args, kwargs, i, n) for i, n in enumerate(("self", "mask", "source")))
    if this is None or mask is None or source is None or mask["dtype"] != "bool" or not _numel(mask):
        return
    try:
        spread = math.prod(torch.broadcast_shapes(tuple(this["shape"]), tuple(mask["shape"]))) // _numel(mask)
    except RuntimeError:  # shapes that do not broadcast: CPU eager says so
        return
    limit = _numel(source) // max(1, spread)
    if limit < _numel(mask):
        mask["trues"] = limit


def _keep_index_put(args: list[Any], kwargs: dict[str, Any]) -> None:
    """index_put(self, indices, values): a lone bool index selects as many elements as `values` has there."""
    this, values = _tensor(args, kwargs, 0, "self"), _tensor(args, kwargs, 2, "values")
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    if this is None or values is None or not isinstance(indices, list):
        return
    given = [(p, v["__tensor__"]) for p, v in enumerate(indices) if isinstance(v, dict) and "__tensor__" in v]
    if len(given) != 1 or given[0][1]["dtype"] != "bool":
        return
    place, mask = given[0]
    trailing = len(this["shape"]) - place - len(mask["shape"])
    at = len(values["shape"]) - trailing - 1  # the dimension of `values` the selected elements line up with
    if trailing >= 0 and at >= 0 and int(values["shape"][at]) != 1 and int(values["shape"][at]) <= _numel(mask):
        mask["trues"] = int(values["shape"][at])


def _keep_embedding_bag(args: list[Any], kwargs: dict[str, Any], indices_at: int) -> None:
    """embedding_bag's offsets: from 0, non-decreasing, at most the number of indices."""
    indices, offsets = _tensor(args, kwargs, indices_at, "indices"), _tensor(args, kwargs, 2, "offsets")
    if indices is None or offsets is None or offsets["dtype"] == "bool" or offsets["dtype"].startswith(
            ("float", "bfloat", "complex")):
        return
    offsets["low"], offsets["high"], offsets["offsets"] = 0, _numel(indices) + 1, True


# (fnmatch pattern of the op, what keeps its contract) — aten's argument order; functional embedding_bag's input
# (the indices) comes first
INVARIANTS: tuple[tuple[str, Callable[[list[Any], dict[str, Any]], None]], ...] = (
    ("aten.masked_scatter*", _keep_masked_scatter),
    ("aten.index_put*", _keep_index_put), ("aten._index_put_impl_*", _keep_index_put),
    ("aten._unsafe_index_put*", _keep_index_put),
    ("aten.embedding_bag*", lambda a, k: _keep_embedding_bag(a, k, 1)),
    ("aten._embedding_bag*", lambda a, k: _keep_embedding_bag(a, k, 1)),
    ("torch.nn.functional.embedding_bag", lambda a, k: _keep_embedding_bag(a, k, 0)),
)


# --------------------------------------------------------------------------------------------- building and sizing

def probe_seed(key: str) -> int:
    return zlib.crc32(key.encode("utf-8")) & 0x7FFFFFFF


def _draw(s: Mapping[str, Any], seed: int) -> torch.Tensor:
    return make_tensor(s["shape"], s["stride"], s["dtype"], s["low"], s["high"], seed, trues=s.get("trues"),
                       offsets=bool(s.get("offsets")), masked_rows=s.get("masked_rows"))


def build_tensors(args: Any, kwargs: Any, seed: int) -> list[torch.Tensor]:
    """The call's tensors on CPU, in argument order; tensor i is seeded with `seed + i`."""
    return [_draw(s, seed + i) for i, s in enumerate(tensor_specs([args, kwargs]))]


def dynamic_marks(args: Any, kwargs: Any) -> list[tuple[int, int]]:
    """(tensor index, dim) of every dim the call's graph had symbolic (`described_tensor`'s `dynamic`): the probe
    and its repro mark them dynamic before compiling, so the backend gets the call as the phase gave it."""
    return [(i, int(d)) for i, s in enumerate(tensor_specs([args, kwargs])) for d in s.get("dynamic") or ()]


def input_bytes(args: Any, kwargs: Any) -> int:
    """Bytes the call's tensors take as `make_tensor` builds them (each one's storage span × its item size; a
    dtype torch does not know counts 0 here: building it fails in the child, which reports it)."""
    return sum(storage_span([int(d) for d in s["shape"]], [int(d) for d in s["stride"]])
               * int(getattr(getattr(torch, str(s["dtype"]), None), "itemsize", 0) or 0)
               for s in tensor_specs([args, kwargs]))


def copy_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies as `make_tensor` builds them (same shape, strides, dtype and storage values, not views): a probe's
    inputs are built once and copied for its CPU reference (copying costs a fraction of drawing the values)."""
    out = []
    for t in tensors:
        shape, stride = tuple(t.shape), tuple(t.stride())
        c = torch.empty_strided(shape, stride, dtype=t.dtype)
        n = storage_span(shape, stride)
        if n > 0:
            c.as_strided((n,), (1,)).copy_(t.as_strided((n,), (1,)))
        out.append(c)
    return out


def call_source(args: Any, kwargs: Any) -> tuple[list[str], list[str], str]:
    """Python source for a repro: tensor-building lines, tensor names, and the call's argument list."""
    names: list[str] = []
    lines: list[str] = []

    def tensor(s: Mapping[str, Any]) -> str:
        name = f"t{len(names)}"
        keep = (f", trues={int(s['trues'])!r}" if s.get("trues") is not None else "") + \
            (", offsets=True" if s.get("offsets") else "") + \
            (f", masked_rows={list(s['masked_rows'])!r}" if s.get("masked_rows") else "")
        lines.append(f"{name} = make_tensor({list(s['shape'])!r}, {list(s['stride'])!r}, {s['dtype']!r}, "
                     f"{s['low']!r}, {s['high']!r}, SEED + {len(names)}{keep})")
        names.append(name)
        return name

    parts = [source_of(a, tensor) for a in args] + [f"{k}={source_of(v, tensor)}" for k, v in kwargs.items()]
    return lines, names, ", ".join(parts)
