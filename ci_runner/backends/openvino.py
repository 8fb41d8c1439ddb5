"""What this tool knows about OpenVINO's torch.compile backend (`compile: openvino`, from the `openvino` package).

It falls back silently, logging at DEBUG only: (1) any exception in its compiler hands the graph to Inductor
("Failed in OpenVINO execution"); (2) a failure at run time switches that partition to PyTorch eager for good
(`perm_fallback`, "Falling back to native PyTorch"); (3) its partitioner leaves unsupported ops, and any
single-node partition unless `options: {testing: true}`, in eager. Its default (non-aot) path re-traces the graph
with make_fx inside Dynamo, which breaks Dynamo's guard building (`sources must not be empty for symbol sN`);
`aot_autograd: true` avoids it. On CPUs with bf16 support it computes in bf16 unless
`config: {INFERENCE_PRECISION_HINT: f32}`.

`Watch` is its `vendor.VendorWatch`: it listens to those DEBUG logs and counts the partitions around one compile.
"""

from __future__ import annotations

import importlib
import logging
import re
from typing import Any, Mapping

__all__ = ["NAME", "RECIPE", "FACT_KEYS", "GROUP_TESTING", "BOILERPLATE", "Watch"]

NAME = "openvino"  # the matrix's `compile:` for this backend
# The recipe that makes its findings mean something (docs/backends.md, "Backend recipes"):
RECIPE: Mapping[str, Any] = {"options": {"aot_autograd": True, "testing": True,
                                         "config": {"INFERENCE_PRECISION_HINT": "f32"}}}
FACT_KEYS = ("openvino_partitions", "openvino_executions", "perm_fallback")  # what `Watch.facts` counts
# Whether the ops mode's group testing gives the one-op verdicts (`ops.group_testing: auto`): not here. OpenVINO's
# partitioner runs a single-node graph in PyTorch eager (inconclusive) and some lone ops fail in Dynamo's guard
# building, while in a group they compile and run (tiny-vit: 25 inconclusive + 3 errors alone, 20 pass grouped).
GROUP_TESTING = False
# Message lines that say nothing of the cause (root causes skip them; IREE's "JIT compilation failed. See
# diagnostics." is one): none here, OpenVINO's errors name the op or the conversion step on their first line.
BOILERPLATE: tuple[str, ...] = ()
_OV = "openvino.frontend.pytorch.torchdynamo"


def _op_name(target: Any) -> str:
    return str(target) if hasattr(target, "_schema") else getattr(target, "__name__", str(target))


_SIZE_OF = ("sym_size", "sym_stride", "sym_numel", "sym_storage_offset")  # a tensor's metadata, read on the host


def _scalar(val: Any) -> bool:
    vals = val if isinstance(val, (list, tuple)) else [val]
    return bool(vals) and all(isinstance(v, (int, float, bool)) or type(v).__name__ in ("SymInt", "SymFloat", "SymBool")
                              for v in vals)


def shape_math(node: Any) -> bool:
    """A node that computes a size, not a tensor (`operator.mod` / `neg` on symbolic ints, `sym_max`, a tensor's
    `sym_size`): dynamic shapes' size arithmetic. OpenVINO's partitioner takes some of it (`_operator.add`, `sub`,
    `mul`, `floordiv`, `sym_size` are in its support list) and leaves the rest to PyTorch, where it is still a
    leftover (a sliding-window Mistral's `sym_max` left outside is where OpenVINO then fails): the finding says what
    it is. A scalar read from a tensor's values (`_local_scalar_dense`, `.item()`) is no size arithmetic, and a node
    without a recorded value counts as a tensor op."""
    val = node.meta.get("val", node.meta.get("example_value"))
    if val is None or not _scalar(val):
        return False
    if any(name in str(node.target) for name in _SIZE_OF):
        return True
    args = [a for a in (*node.args, *node.kwargs.values()) if hasattr(a, "meta")]
    return all(_scalar(a.meta.get("val", a.meta.get("example_value"))) for a in args)


def _module_path(source: str) -> str:
    """A module's dotted name from Dynamo's source path (`L['args'][0].model._modules['layers']` -> `model.layers`)."""
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", source)
    path = re.sub(r"^L\['[^']+'\](\[\d+\])?\.?", "", path)
    return path or "(model)"


def _sites(graphs: Any, ops: set[str]) -> dict[str, list[str]]:
    """Op -> the modules (`nn_module_stack`, innermost) whose code called it, where the graph kept that metadata.
    An entry that is not a sub-module of the compiled callable's arguments (a module held in a global, as
    transformers' Mamba kernels are: `G['…modeling_mamba'].mamba_selective_scan`) is skipped for the module that
    called it."""
    out: dict[str, list[str]] = {}
    for gm in graphs:
        for n in gm.graph.nodes:
            name = _op_name(n.target) if n.op == "call_function" else None
            stack = [e for e in (n.meta.get("nn_module_stack") or {}).values() if not str(e[0]).startswith("G[")]
            if name in ops and stack:
                path = _module_path(str(stack[-1][0]))
                if path not in out.setdefault(name, []):
                    out[name].append(path)
    return out


class Watch:
    """Around one compile and run: OpenVINO's own log lines and partitions (`facts`), and why its work ran
    elsewhere (`reason`). Does nothing when the `openvino` package is not installed."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self._handler: logging.Handler | None = None
        self._saved: list[tuple[logging.Logger, int, bool]] = []
        self._facts: dict[str, Any] = {}

    def start(self) -> None:
        try:
            execute = importlib.import_module(f"{_OV}.execute")
        except ImportError:
            return
        execute.clear_caches()
        watch = self

        class _Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                watch.messages.append(record.getMessage()[:400])

        self._handler = _Keep(logging.DEBUG)
        for name in (f"{_OV}.backend", f"{_OV}.execute"):
            lg = logging.getLogger(name)
            self._saved.append((lg, lg.level, lg.propagate))
            lg.setLevel(logging.DEBUG)
            lg.propagate = False
            lg.addHandler(self._handler)

    def stop(self) -> None:
        if self._handler is None:
            return
        for lg, level, propagate in self._saved:
            lg.removeHandler(self._handler)
            lg.setLevel(level)
            lg.propagate = propagate
        execute = importlib.import_module(f"{_OV}.execute")
        mods = [m for gm in execute.partitioned_modules.values() for m in gm.modules()
                if isinstance(m, execute.OpenVINOGraphModule)]
        self._facts = {"openvino_partitions": len(mods), "perm_fallback": sum(bool(m.perm_fallback) for m in mods),
                       "openvino_executions": sum(m.startswith("OpenVINO graph execution successful")
                                                  for m in self.messages)}
        # the partitioner's leftovers: ops outside its fused partitions run in PyTorch eager, silently
        sizes: dict[str, bool] = {}  # each op left outside -> whether every node of it computes a size
        for gm in execute.partitioned_modules.values():
            for n in gm.graph.nodes:
                if n.op == "call_function" and (name := _op_name(n.target)) != "getitem":
                    sizes[name] = sizes.get(name, True) and shape_math(n)
        if mods and sizes:
            self._facts["eager_ops"] = sorted(sizes)
            if any(sizes.values()):
                self._facts["eager_size_ops"] = sorted(op for op, size in sizes.items() if size)
            sites = _sites(execute.partitioned_modules.values(), set(self._facts["eager_ops"]))
            if sites:
                self._facts["eager_sites"] = sites
        self._handler = None

    def facts(self) -> dict[str, Any]:
        return dict(self._facts)

    def reason(self) -> str | None:
        if not self._facts:
            return None
        failed = [m for m in self.messages if m.startswith("Failed in OpenVINO execution")]
        if failed:
            return "OpenVINO failed and handed the graph to Inductor: " + failed[0]
        eager = [m for m in self.messages if "Falling back to native PyTorch" in m  # (cut at 400 characters:
                 or m.startswith("OpenVINO execution failed")]  # a long conversion report hides the tail)
        if self._facts["perm_fallback"] or eager:
            return "OpenVINO's execution failed and the graph ran in PyTorch eager: " + (eager or ["(no message)"])[0]
        if self._facts["openvino_partitions"] == 0 or self._facts["openvino_executions"] == 0:
            return ("OpenVINO ran no partition: it leaves unsupported ops and single-node graphs in PyTorch eager "
                    "(compile_options: {options: {testing: true}} makes it compile single nodes)")
        return None
