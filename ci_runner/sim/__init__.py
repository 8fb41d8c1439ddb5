"""Self-test backends: small, honest backends that reproduce each accelerator failure class on CPU.

They exist because no accelerator is at hand: our tests, the bundled example and users checking their own CI
pipeline run them. Each one fails in exactly one documented way and is otherwise correct (a graph the backend
accepts runs with PyTorch's own CPU kernels). Select them in a matrix by name, options in `backend_options`:

```yaml
backends:
  - {id: sim-subset, compile: sim-subset}
  - {id: sim-drift, compile: sim-drift, backend_options: {op: norm, dtype: float16}}
  - {id: simdev, device: simdev, backend_options: {extra_allow: [rsqrt]}}
```

| name | kind | reproduces | when | options |
|---|---|---|---|---|
| `sim-subset` | torch.compile | a compiler without some operators: raises `SimCompilerError: [sim-subset] unsupported operator aten.convolution.default in node convolution: …` on the FIRST op outside its allowlist | compile | `allow` (replaces the default transformer-only allowlist, `compilers.TRANSFORMER_OPS`), `extra_allow` (added to it) |
| `sim-drift` | torch.compile | silent numerical drift: the chosen ops run in reduced precision, deterministically | run (no error) | `op` (default `norm`: `aten.rsqrt.default` of RMSNorm, `aten.native_layer_norm.default` of LayerNorm, `aten._fused_rms_norm.default`), `dtype` (default `bfloat16`; `float16`) |
| `sim-crash` | torch.compile | a runtime error from inside the backend: ``RuntimeError: [sim-crash] Assertion `layout.is_contiguous()` failed at lowering/attention.cpp:214: while executing <op> (node <node>)`` | run | `op` (default `attention`: `aten._scaled_dot_product_*`, and `aten._safe_softmax` of its inlined math path; the tiny CPU models use `aten._scaled_dot_product_flash_attention_for_cpu.default`) |
| `sim-abort` | torch.compile | a native abort (SIGABRT, "terminate called after throwing…" on stderr) | run | `op` (default `attention`) |
| `sim-segv` | torch.compile | a segmentation fault (SIGSEGV: reads address 0 through ctypes) | run | `op` (default `attention`) |
| `sim-hang` | torch.compile | a hang (sleeps forever; with `seconds`, raises after that long) | run | `op` (default `attention`), `seconds` |
| `sim-slow` | torch.compile | a slow compiler on a busy runner: each graph's compile spends `seconds` of busy CPU time (not sleeping: on a loaded machine it takes longer in wall time), then runs correctly (like `aot_eager`) | compile (no error) | `seconds` (default 20, CPU seconds per graph) |
| `sim-decode` | torch.compile | prefill OK, decode fails: raises `SimCompilerError: [sim-decode] unsupported operator aten._scaled_dot_product_flash_attention_for_cpu.default in node …: query sequence length 1 is not supported (a one-token decode step)…` for a graph whose attention has a one-token query (a symbolic length never fires) | compile | `op` (default `attention`), `max_query_len` (default 1: fail at query length ≤ 1) |
| `sim-kvdrift` | torch.compile | KV-cache contamination: the values a cache write (`index_copy`, `index_put`, `slice_scatter`, DynamicCache's `cat`, when the result outlives the call) stores are rounded to a low dtype; the first token is right, later ones drift | run (no error) | `dtype` (default `bfloat16`; `float16`), `writes` (default `decode`: writes of one position; `all`: every write, the prefill's too) |
| `sim-masknan` | torch.compile | padded batch NaN: attention with a plain softmax, so a fully-masked query row (a left-padded row's pads) is NaN where eager gives 0, and the NaN spreads to that row's real tokens; other rows match eager | run (no error) | `op` (default `attention`) |
| `sim-long` | torch.compile | short prompt OK, long prompt fails: raises `SimCompilerError: [sim-long] unsupported operator … key/value sequence length 80 exceeds the maximum of 64 tokens…` when an attention's query or key/value length (a static cache's `max_cache_len`) is over the limit; graphs without attention: their token inputs; a dynamic length is checked again at run time | compile | `max_tokens` (default 64), `op` (default `attention`) |
| `sim-precision` | torch.compile | a precision policy followed or broken: each op class computed in the dtype its option names; the defaults are a correct bf16 accelerator (matmul-class inputs in bfloat16, float32 accumulation, the rest float32) | run (no error) | `matmul` (default `bfloat16`), `conv`, `attention` (default: `matmul`'s), `accumulate`, `softmax`, `norm` (with RMSNorm's rsqrt), `reduction`, `elementwise`, `kv_cache` (default `float32`), `overflow` (an fp16 saturation: matmul outputs above it become ±inf), `overflow_in` (only in modules whose path contains it) (`precision.py`) |
| `sim-reuse` | torch.compile | output buffers reused across calls: each graph returns its outputs in buffers it keeps per output, so a tensor one call returned is overwritten by the same graph's next call | run (no error) | `outputs` (default `all`; or a list of graph output indices) |
| `sim-memhog` | torch.compile | a compiler change that makes a layer need more memory: the graph runs op by op and keeps `copies` extra copies of every intermediate tensor until it returns, for the chosen instances (layers sharing one compiled graph, numbered by first call); results identical to eager (`memhog.py`) | run (no error) | `instances` (default `[0]`: the first layer that runs; `all`), `copies` (default 1) |
| `sim-tp-drop` | torch.compile | tensor parallel: the `nth` `_c10d_functional.all_reduce` of the forward graph removed, each rank keeps its partial sum (`collectives.py`) | run (no error) | `nth` (default 1: layer 0's `o_proj` under the default decoder plan; 0 is the embedding's) |
| `sim-tp-dup` | torch.compile | tensor parallel: the `nth` all-reduce done twice, the output is tp × the reference | run (no error) | `nth` (default 1) |
| `sim-tp-shard` | torch.compile | tensor parallel: the `nth` transposed weight (a colwise shard) has its rows reversed, its output features come out permuted | run (no error) | `nth` (default 0: layer 0's `q_proj`) |
| `simdev` | device | an out-of-tree eager device plugin missing kernels: `model.to("simdev")` works; an op without a kernel raises PyTorch's own `NotImplementedError: Could not run 'aten::rsqrt.out' with arguments from the 'simdev' backend…` | run | `allow` (replaces the op set), `extra_allow`, `deny` (default: `rsqrt`, `_softmax`), `capacity_mb` (device memory; allocator statistics in `simalloc.py`) |

Op patterns (`allow`, `extra_allow`, `op`, simdev's lists) match overload names (`aten.rsqrt.default`), packet
names (`aten.rsqrt`) or bare aten names (`rsqrt`), with `fnmatch` globs; `attention` and `norm` are aliases.
A chosen op that never appears in a graph means the backend behaves like `aot_eager`.

The workload sims (`sim-decode`, `sim-kvdrift`, `sim-masknan`, `sim-long`, `sim-reuse`; `workloads.py`) each fail
in one regime of generation only (a one-token decode step, decode's cache writes, a padded batch, a long prompt,
repeated calls) and match eager everywhere else.

All torch.compile sims are `aot_autograd` backends: they see ATen overloads (the matrix's `ir: aten`), the same
names `torch.export` + the ops inventory record. The op an error names (sim-subset's `unsupported operator X`,
simdev's `Could not run 'aten::X'`) is parsed by `ci_runner/backends/errortext.py` (`unsupported_op_from_error`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .compilers import (
    ALIASES,
    ATTENTION_OPS,
    NORM_OPS,
    TRANSFORMER_OPS,
    SimCompilerError,
    expand_patterns,
    make_drift,
    make_fault,
    make_slow,
    make_subset,
    op_matches,
    op_name,
)
from .collectives import make_collective
from .memhog import make_memhog
from .workloads import make_decode, make_kvdrift, make_long, make_masknan, make_reuse
from .precision import CLASSES as PRECISION_CLASSES, make_precision

__all__ = [
    "ALIASES", "ATTENTION_OPS", "NORM_OPS", "SIM_BACKENDS", "SimBackendInfo", "SimCompilerError",
    "TRANSFORMER_OPS", "expand_patterns", "make_backend", "op_matches", "op_name",
    "register_with_dynamo", "table_markdown",
]

@dataclass(frozen=True, kw_only=True)
class SimBackendInfo:
    name: str
    kind: str  # "torch.compile" or "device"
    reproduces: str
    stage: str  # "compile" or "run": when the failure shows
    options: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # option -> meaning
    factory: Callable[..., Any] | None = None  # torch.compile sims: (**options) -> backend


def _fault(kind: str) -> Callable[..., Any]:
    def factory(**options: Any) -> Any:
        return make_fault(kind, **options)

    return factory


def _subset(**options: Any) -> Any:
    return make_subset(**options)


def _drift(**options: Any) -> Any:
    return make_drift(**options)


def _collective(kind: str) -> Callable[..., Any]:
    def factory(**options: Any) -> Any:
        return make_collective(kind, **options)

    return factory


_OP = "ops to fault on (patterns or alias); default `attention`"
SIM_BACKENDS: Mapping[str, SimBackendInfo] = MappingProxyType({
    "sim-subset": SimBackendInfo(
        name="sim-subset", kind="torch.compile", stage="compile",
        reproduces="compiler lacks operators: SimCompilerError on the first op outside an allowlist (transformer-only by default)",
        options=MappingProxyType({"allow": "the allowlist (replaces the default)", "extra_allow": "ops added to the allowlist"}),
        factory=_subset),
    "sim-drift": SimBackendInfo(
        name="sim-drift", kind="torch.compile", stage="run",
        reproduces="silent numerical drift: chosen ops (default the normalization's) computed in reduced precision",
        options=MappingProxyType({"op": "ops to compute in low precision; default `norm`", "dtype": "bfloat16 (default) or float16"}),
        factory=_drift),
    "sim-crash": SimBackendInfo(
        name="sim-crash", kind="torch.compile", stage="run",
        reproduces="runtime error: a C++-assertion-like RuntimeError when the chosen op (default attention) runs",
        options=MappingProxyType({"op": _OP}), factory=_fault("crash")),
    "sim-abort": SimBackendInfo(
        name="sim-abort", kind="torch.compile", stage="run",
        reproduces="hard crash: os.abort() (SIGABRT) when the chosen op (default attention) runs",
        options=MappingProxyType({"op": _OP}), factory=_fault("abort")),
    "sim-segv": SimBackendInfo(
        name="sim-segv", kind="torch.compile", stage="run",
        reproduces="hard crash: a real segfault (SIGSEGV) when the chosen op (default attention) runs",
        options=MappingProxyType({"op": _OP}), factory=_fault("segv")),
    "sim-hang": SimBackendInfo(
        name="sim-hang", kind="torch.compile", stage="run",
        reproduces="hang: sleeps forever when the chosen op (default attention) runs",
        options=MappingProxyType({"op": _OP, "seconds": "hang only this long, then raise (for tests)"}),
        factory=_fault("hang")),
    "sim-slow": SimBackendInfo(
        name="sim-slow", kind="torch.compile", stage="compile",
        reproduces="a slow compiler: each graph's compile spends `seconds` of busy CPU time, then runs correctly",
        options=MappingProxyType({"seconds": "CPU seconds spent compiling each graph; default 20"}),
        factory=make_slow),
    "sim-decode": SimBackendInfo(
        name="sim-decode", kind="torch.compile", stage="compile",
        reproduces="prefill OK, decode fails: SimCompilerError for a graph whose attention has a one-token query",
        options=MappingProxyType({"op": "attention ops to check; default `attention`",
                                  "max_query_len": "fail at query lengths up to this; default 1"}),
        factory=make_decode),
    "sim-kvdrift": SimBackendInfo(
        name="sim-kvdrift", kind="torch.compile", stage="run",
        reproduces="KV-cache contamination: cache writes stored in reduced precision; first token right, later tokens drift",
        options=MappingProxyType({"dtype": "bfloat16 (default) or float16",
                                  "writes": "`decode` (default: one-position writes) or `all`"}),
        factory=make_kvdrift),
    "sim-masknan": SimBackendInfo(
        name="sim-masknan", kind="torch.compile", stage="run",
        reproduces="padded batch NaN: attention with a plain softmax, fully-masked query rows are NaN (eager gives 0)",
        options=MappingProxyType({"op": "attention ops to replace; default `attention`"}),
        factory=make_masknan),
    "sim-long": SimBackendInfo(
        name="sim-long", kind="torch.compile", stage="compile",
        reproduces="long prompt fails: SimCompilerError when an attention spans more than `max_tokens` tokens",
        options=MappingProxyType({"max_tokens": "the longest sequence accepted; default 64",
                                  "op": "attention ops to check; default `attention`"}),
        factory=make_long),
    "sim-precision": SimBackendInfo(
        name="sim-precision", kind="torch.compile", stage="run",
        reproduces="a precision policy followed (default: a correct bf16 accelerator) or broken in one class",
        options=MappingProxyType({c: "the dtype of that op class" for c in PRECISION_CLASSES} |
                                 {"overflow": "matmul outputs above this magnitude become ±inf (fp16 saturation)",
                                  "overflow_in": "only the matmuls of modules whose path contains this text overflow"}),
        factory=make_precision),
    "sim-reuse": SimBackendInfo(
        name="sim-reuse", kind="torch.compile", stage="run",
        reproduces="output buffers reused across calls: a returned tensor is overwritten by the same graph's next call",
        options=MappingProxyType({"outputs": "graph output indices that reuse; default `all`"}),
        factory=make_reuse),
    "sim-memhog": SimBackendInfo(
        name="sim-memhog", kind="torch.compile", stage="run",
        reproduces="a layer needs more memory compiled: extra copies of its activations kept until it returns (same results)",
        options=MappingProxyType({"instances": "which layers sharing a graph hoard, by first call; default [0]; `all`",
                                  "copies": "extra copies of each activation; default 1"}),
        factory=make_memhog),
    "sim-tp-drop": SimBackendInfo(
        name="sim-tp-drop", kind="torch.compile", stage="run",
        reproduces="tensor parallel: one all-reduce dropped (each rank keeps its partial sum; `collectives.py`)",
        options=MappingProxyType({"nth": "which all-reduce of the graph; default 1 (layer 0's o_proj under the default plan)"}),
        factory=_collective("drop")),
    "sim-tp-dup": SimBackendInfo(
        name="sim-tp-dup", kind="torch.compile", stage="run",
        reproduces="tensor parallel: one all-reduce done twice (the output is tp × the reference)",
        options=MappingProxyType({"nth": "which all-reduce of the graph; default 1"}),
        factory=_collective("dup")),
    "sim-tp-shard": SimBackendInfo(
        name="sim-tp-shard", kind="torch.compile", stage="run",
        reproduces="tensor parallel: one colwise weight shard laid out the wrong way (its output features permuted)",
        options=MappingProxyType({"nth": "which transposed weight of the graph; default 0 (layer 0's q_proj)"}),
        factory=_collective("shard")),
    "simdev": SimBackendInfo(
        name="simdev", kind="device", stage="run",
        reproduces="eager out-of-tree device (PrivateUse1) missing kernels: PyTorch's \"Could not run 'aten::…' with arguments from the 'simdev' backend\"",
        options=MappingProxyType({"allow": "the op set (replaces the default)", "extra_allow": "ops added",
                                  "deny": "ops removed (default rsqrt, _softmax)",
                                  "capacity_mb": "device memory in MiB: past it `torch.OutOfMemoryError` (default: unlimited)"})),
})


def make_backend(name: str, options: Mapping[str, Any] | None = None) -> Any:
    """The torch.compile backend for sim `name` with `options`; ValueError for unknown names/options."""
    info = SIM_BACKENDS.get(name)
    if info is None or info.factory is None:
        compile_sims = [n for n, i in SIM_BACKENDS.items() if i.factory is not None]
        close = difflib.get_close_matches(str(name), compile_sims, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{name!r} is not a sim torch.compile backend{hint}; known: {', '.join(compile_sims)}")
    options = dict(options or {})
    unknown = [k for k in options if k not in info.options]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(info.options), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{name}: unknown option {unknown[0]!r}{hint}; known: {', '.join(info.options)}")
    return info.factory(**options)


def register_with_dynamo() -> list[str]:
    """Register the torch.compile sims (default options) under their names, so `torch.compile(backend="sim-subset")`
    works in any script after this call. Idempotent; returns the names."""
    from torch._dynamo import list_backends, register_backend  # deferred: importing Dynamo takes seconds

    names = []
    existing = set(list_backends(exclude_tags=()))
    for name, info in SIM_BACKENDS.items():
        if info.factory is None:
            continue
        names.append(name)
        if name not in existing:
            register_backend(compiler_fn=make_backend(name), name=name)
    return names


def table_markdown() -> str:
    """The table above, generated from the registry (for `deepview-ci env`; docs/backends.md has the table too)."""
    rows = ["| name | kind | reproduces | when | options |", "|---|---|---|---|---|"]
    for info in SIM_BACKENDS.values():
        opts = ", ".join(f"`{k}`: {v}" for k, v in info.options.items()) or "-"
        rows.append(f"| `{info.name}` | {info.kind} | {info.reproduces} | {info.stage} | {opts} |")
    return "\n".join(rows)
