"""The numerics on the model's graph: node data for Google's Model Explorer, one file per view, beside the model's
exported program.

Model Explorer's PyTorch adapter loads a `torch.export.ExportedProgram` (`.pt2`) and shows one node per FX node of
its graph: the node's id is the FX node's name (`linear_4`), its namespace the modules of its `nn_module_stack`.
Its node-data files (`--node_data_paths`) are the documented `GraphNodeData` JSON: ``{"results": {node id:
{"value": number}}, "gradient": [{"stop": 0..1, "bgColor": …}, …]}``, the gradient's stops running from the
smallest value in `results` (0) to the largest (1).

Each op node gets the value of the innermost module of its stack that the view compared (`data.layers`, the module's
call by its `name#k` key: the export's `@k` stack entries are the same calls): that module's worst metric over its
threshold, ``max(rel / thr.rel, mad / thr.mad, (1 − cos) / (1 − thr.cos))``. Under 1 the layer is within its
threshold; the gradient is placed so that 1.0 is the amber edge, green below, orange to red above (red from
`RED_AT` times the threshold), so the first divergent layer and, in the cumulative view, the drift it carries stand
out; the isolated view colours only the layers wrong on their own. A non-finite metric counts as `RATIO_CAP`
(JSON has no NaN or infinity).

The program is the primary reference's model exported on the first compared sample's inputs (the calls the
comparison ran), `strict=False` as the ops mode exports it; it is saved (`model.pt2`, with its weights) when those
weights take at most `model_explorer_mb` MiB, else only its node data are written, and the note says how to export
it. It is the same for every backend of a model, so it is exported and saved once per model key in the run folder
(`shared_program`) and hard-linked into each cell folder (`place`).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from ...models.load import normalize_module_path
from ...fsutil import atomic_write_json, atomic_write_with, locked

VIEW_FILES = {"cumulative": "cumulative.json", "isolated": "isolated.json"}
PROGRAM_FILE = "model.pt2"
NODES_FILE = "nodes.json"  # beside the shared program: its op nodes' module stacks (`node_stacks`)
RATIO_CAP = 1e6  # a NaN/inf metric, or a zero threshold exceeded
RED_AT = 10.0  # ratio shown fully red (an order of magnitude over the threshold)
# ratio → colour: green under the threshold, amber at it, orange just over, red from RED_AT (Primer's palette)
GREEN, AMBER, ORANGE, RED = "#2da44e", "#d4a72c", "#fb8500", "#cf222e"
_CALL = re.compile(r"@(\d+)$")


def ratio(metrics: Mapping[str, Any] | None, threshold: Mapping[str, Any] | None) -> float | None:
    """The worst metric over its threshold (see the module docstring); None when nothing can be compared."""
    if not metrics or not threshold:
        return None
    parts: list[float] = []
    for key, over in (("rel", lambda v, t: v / t), ("mad", lambda v, t: v / t),
                      ("cos", lambda v, t: (1.0 - v) / (1.0 - t))):
        if key not in metrics or key not in threshold or metrics[key] is None or threshold[key] is None:
            continue
        v, t = float(metrics[key]), float(threshold[key])
        if not math.isfinite(v):
            parts.append(RATIO_CAP)
            continue
        bound = t if key != "cos" else 1.0 - t
        err = v if key != "cos" else 1.0 - v
        if bound <= 0.0:
            parts.append(0.0 if err <= 0.0 else RATIO_CAP)
        else:
            parts.append(over(v, t))
    if not parts:
        return None
    return min(RATIO_CAP, max(0.0, max(parts)))


def module_ratios(rows: Sequence[Mapping[str, Any]], view: str) -> dict[str, float]:
    """Call key → ratio of each `data.layers` row the view compared."""
    thr_key = "threshold" if view == "cumulative" else f"threshold_{view}"
    out: dict[str, float] = {}
    for row in rows:
        r = ratio(row.get(view), row.get(thr_key))
        if r is not None and row.get("key") is not None:
            out[str(row["key"])] = r
    return out


def node_stacks(graph_nodes: Iterable[Any]) -> dict[str, list[str]]:
    """FX op node name → the call keys of its modules, innermost first (`model.layers.0.mlp#1`: the module's second
    call, from the stack's `@1` entry; the root module is ``""``); modules held in globals (`G[…]`) are not the
    model's and are left out."""
    out: dict[str, list[str]] = {}
    for node in graph_nodes:
        if getattr(node, "op", None) != "call_function":
            continue
        stack = (getattr(node, "meta", None) or {}).get("nn_module_stack") or {}
        keys = []
        for entry, value in stack.items():
            path = str(value[0]) if isinstance(value, (tuple, list)) and value else ""
            if path.startswith("G["):
                continue
            m = _CALL.search(str(entry))
            name = normalize_module_path(path)
            keys.append(name if not m or m.group(1) == "0" else f"{name}#{m.group(1)}")
        out[str(node.name)] = list(reversed(keys)) + ([""] if "" not in keys else [])
    return out


def _mix(a: str, b: str, f: float) -> str:
    """The colour `f` of the way from hex colour `a` to `b` (rounded down, as Model Explorer interpolates)."""
    ca, cb = (tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in (a, b))
    return "#" + "".join(f"{math.floor(x + (y - x) * min(1.0, max(0.0, f))):02x}" for x, y in zip(ca, cb))


def colour_at(value: float) -> str:
    """The colour of a ratio on the absolute scale: green → amber up to 1, orange → red from just over 1 to RED_AT."""
    if value <= 1.0:
        return _mix(GREEN, AMBER, value)
    return _mix(ORANGE, RED, (value - 1.0) / (RED_AT - 1.0))


def gradient(lo: float, hi: float) -> list[dict[str, Any]]:
    """Model Explorer's gradient (stops relative to [lo, hi], the smallest and largest value in the file) that
    reproduces `colour_at`: the amber stop at ratio 1.0, a hard edge to orange right above it."""
    if hi <= lo:
        return [{"stop": 0, "bgColor": colour_at(lo)}, {"stop": 1, "bgColor": colour_at(hi)}]

    def at(v: float) -> float:
        return (v - lo) / (hi - lo)

    stops = [{"stop": 0, "bgColor": colour_at(lo)}]
    if lo < 1.0 < hi:
        stops += [{"stop": at(1.0), "bgColor": AMBER}, {"stop": at(1.0), "bgColor": ORANGE}]
    if lo < RED_AT < hi:
        stops.append({"stop": at(RED_AT), "bgColor": RED})
    return stops + [{"stop": 1, "bgColor": colour_at(hi)}]


def graph_node_data(stacks: Mapping[str, Sequence[str]], ratios: Mapping[str, float], *, view: str) -> dict[str, Any]:
    """One view's `GraphNodeData` JSON: each op node the ratio of its innermost compared module."""
    results: dict[str, dict[str, float]] = {}
    for node, keys in stacks.items():
        value = next((ratios[k] for k in keys if k in ratios), None)
        if value is not None:
            results[node] = {"value": float(f"{value:.6g}")}
    values = [r["value"] for r in results.values()]
    lo, hi = (min(values), max(values)) if values else (0.0, 0.0)
    data: dict[str, Any] = {"name": f"deepview-ci {view}: worst metric / threshold", "results": results,
                            "gradient": gradient(lo, hi)}
    if hi <= lo:  # one value: the gradient has no span to place it on
        for r in results.values():
            r["bgColor"] = colour_at(r["value"])
    return data


def _tensors(value: Any) -> list[Any]:
    """The tensors of a model's output (a tensor, a tuple, a dict or a transformers `ModelOutput`), in order."""
    import torch  # deferred: as above

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def export_program(module: Any, inputs: Mapping[str, Any]) -> Any:
    """`module` exported on keyword `inputs` (torch.export, `strict=False`), as Model Explorer loads it.

    Model Explorer's adapter needs a program of tensors in and out: its outputs are returned as a flat tuple of
    tensors (a program returning a transformers `ModelOutput` loads only where transformers is imported, for its
    pytree node, and Model Explorer's server does not import it) and the inputs that are not tensors
    (`use_cache=False`) are passed as constants (the adapter prints every input as a tensor). The wrapper that does
    both is taken out of every node's `nn_module_stack` again, so the graph's namespaces (and `node_stacks`) are the
    model's own, as if it had been exported directly."""
    import torch  # deferred: as above

    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    constants = {k: v for k, v in inputs.items() if k not in tensors}

    class FlatOutputs(torch.nn.Module):
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

        def forward(self, **kwargs: Any) -> tuple[Any, ...]:
            return tuple(_tensors(self.model(**kwargs, **constants)))

    with torch.no_grad():
        program = torch.export.export(FlatOutputs(module), (), tensors, strict=False)
    for node in program.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = _unwrapped(stack)
    return program


def _unwrapped(stack: Mapping[str, Any]) -> dict[str, Any]:
    """A node's `nn_module_stack` without `FlatOutputs`: its root entry dropped, `model.` taken off the paths."""
    out: dict[str, Any] = {}
    for key, value in stack.items():
        path = str(value[0]) if isinstance(value, (tuple, list)) and value else ""
        if path == "" or "FlatOutputs" in str(value[1] if len(value) > 1 else ""):
            continue
        if path == "model" or path.startswith("model."):
            path = path[len("model."):] if path != "model" else ""
        out[str(key)] = (path, *tuple(value[1:]))
    return out


def weights_mb(module: Any) -> float:
    """MiB of the module's parameters and buffers (what a saved program holds)."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def shared_program(shared: Path, export: Callable[[], Any], *, save: bool) -> tuple[dict[str, list[str]], Path | None]:
    """The exported program's node stacks (`node_stacks`) and, when `save`, the saved program: made once per model
    key in the folder `shared` (under the run folder, held under a lock while it is made) and read by every other
    cell of the same model, reference and inputs; (stacks, program file or None)."""
    import torch  # deferred: as above

    nodes, program = shared / NODES_FILE, shared / PROGRAM_FILE
    with locked(shared.parent / f"{shared.name}.lock"):
        if not nodes.exists() or (save and not program.exists()):
            ep = export()
            if save:
                atomic_write_with(program, lambda tmp: torch.export.save(ep, str(tmp)))
            atomic_write_json(nodes, node_stacks(ep.graph.nodes), indent=None)  # last: it says the folder is done
        stacks = json.loads(nodes.read_text(encoding="utf-8"))
    return stacks, (program if save and program.exists() else None)


def place(source: Path, target: Path) -> None:
    """`source` at `target`, atomically: a hard link (no second copy of the weights on disk), else a copy."""

    def link(tmp: Path) -> None:
        tmp.unlink()
        try:
            os.link(source, tmp)
        except OSError:  # another file system, or links not allowed
            shutil.copyfile(source, tmp)

    atomic_write_with(target, link)


def write_node_data(folder: Path, stacks: Mapping[str, Sequence[str]], rows: Sequence[Mapping[str, Any]],
                    views: Iterable[str]) -> dict[str, Any]:
    """The node-data file of each view in `views` that compared a layer, in `folder`: {"node_data": {view: file},
    "nodes": op nodes, "coloured": {view: nodes with a value}, "over": {view: nodes over their threshold}}."""
    out: dict[str, Any] = {"node_data": {}, "nodes": len(stacks), "coloured": {}, "over": {}}
    for view in views:
        ratios = module_ratios(rows, view)
        if not ratios:
            continue
        data = graph_node_data(stacks, ratios, view=view)
        atomic_write_json(folder / VIEW_FILES[view], data, indent=None)
        out["node_data"][view] = VIEW_FILES[view]
        out["coloured"][view] = len(data["results"])
        out["over"][view] = sum(1 for r in data["results"].values() if r["value"] > 1.0)
    return out


__all__ = ["NODES_FILE", "PROGRAM_FILE", "RATIO_CAP", "VIEW_FILES", "colour_at", "export_program", "gradient",
           "graph_node_data", "module_ratios", "node_stacks", "place", "ratio", "shared_program", "weights_mb",
           "write_node_data"]
