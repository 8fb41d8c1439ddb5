"""The tensor-parallel workload as the matrix spells it: `parallel: {tp: N, plan: {...}}` (no torch here).

```yaml
defaults:
  parallel: {tp: 2}                       # every cell: the model sharded over 2 ranks, by its family's default plan
models:
  - id: tiny-llama
    config: llama
    parallel:                             # this model's own plan (module-name globs → styles)
      tp: 2
      plan: {"*.self_attn.q_proj": colwise, "*.self_attn.o_proj": rowwise, lm_head: colwise_gather}
```

`parallel` may stand in `defaults`, a model or a backend; the most specific one wins whole (a backend's over a
model's over the defaults'). `parallel: null` (or `tp: 1`) on a model or backend turns it off there. A plan maps
module-name globs (`fnmatch`, matched against qualified names) to one of `STYLES`; no `plan`: the default plan of
the model's family (`ci_runner/workloads/tpplan.py`). `check_parallel` finds the mistakes at load, `parse_parallel`
builds the `ParallelSpec` a cell carries.

The ranks join gloo on CPU unless the cell's backend declares its device's own process group (a backend key, not a
`parallel` one: the layout is the model's, the collectives are the device's):

```yaml
backends:
  - {id: npu-inductor, compile: inductor, device: npu, import: [torch_npu], process_group: hccl}
```

`with_process_group` adds it to the cell's layout (`ProcessGroupSpec`: the c10d backend name, the device, the
backend's spec for the ranks to prepare before joining, so a plugin under `import:` can register the name).
`check_process_group` finds a malformed name at load; whether c10d knows it is checked after the backend's imports
(`backends/check.py`), and again in the ranks (`procs/ranks.init_ranks`).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping

MAX_TP = 64
# The styles a plan may name: PyTorch's tensor-parallel styles, as the engine builds them (workloads/tpplan.py)
STYLES: Mapping[str, str] = MappingProxyType({
    "colwise": "ColwiseParallel(): weight rows (output features) sharded; each rank keeps its slice of the output",
    "rowwise": "RowwiseParallel(): weight columns (input features) sharded; the outputs are all-reduced",
    "colwise_gather": "ColwiseParallel(output_layouts=Replicate()): as colwise, the output all-gathered (an LM head)",
    "rowwise_embedding": "RowwiseParallel(input_layouts=Replicate()): an embedding's vocabulary sharded, all-reduced",
})
PARALLEL_KEYS = ("tp", "plan")


DEFAULT_PROCESS_GROUP = "gloo"  # the ranks' c10d backend when the cell's backend declares none (on CPU)
PROCESS_GROUP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # a c10d backend name (`Backend.register_backend`)


@dataclass(frozen=True, kw_only=True)
class ProcessGroupSpec:
    """A device's own process group, declared by the cell's backend (`process_group: <c10d backend name>`)."""

    name: str  # the c10d backend the ranks join (`init_process_group(name)`)
    device: str  # the backend's device: the mesh's device type, where the sharded model and its inputs run
    backend: Mapping[str, Any]  # the backend's spec (config.spec_to_json): prepared in each rank before it joins

    def key(self) -> dict[str, Any]:
        return {"name": self.name, "device": self.device, "backend": dict(self.backend)}


@dataclass(frozen=True, kw_only=True)
class ParallelSpec:
    """A resolved layout: `tp` ranks, the plan (glob → style; empty: the family's default plan), and the device's
    process group when the cell's backend declares one (None: gloo on CPU)."""

    tp: int
    plan: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    process_group: ProcessGroupSpec | None = None

    def label(self) -> str:
        """What findings carry in `parallel`: ``tp2``."""
        return f"tp{self.tp}"

    def key(self) -> dict[str, Any]:
        """The layout as plain JSON (thresholds, fingerprints, reports; the ranks' payload)."""
        out: dict[str, Any] = {"tp": self.tp, "plan": dict(self.plan)}
        if self.process_group is not None:
            out["process_group"] = self.process_group.key()
        return out

    @property
    def group_name(self) -> str:
        """The c10d backend the ranks join: the declared one, else gloo."""
        return self.process_group.name if self.process_group is not None else DEFAULT_PROCESS_GROUP


def check_parallel(raw: Any) -> list[tuple[tuple[str, ...], str, str]]:
    """Problems of one raw `parallel` value: (key path below `parallel`, message, hint) each; empty when valid."""
    if raw is None:
        return []
    if not isinstance(raw, Mapping):
        return [((), f"`parallel` is a mapping, got {raw!r}", "write e.g. `parallel: {tp: 2}`")]
    problems: list[tuple[tuple[str, ...], str, str]] = []
    for key in raw:
        if key not in PARALLEL_KEYS:
            problems.append(((str(key),), f"unknown key {key!r}", _choices(str(key), PARALLEL_KEYS)))
    tp = raw.get("tp")
    if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= MAX_TP:
        problems.append((("tp",), f"tp: {tp!r} is not a number of ranks in 1..{MAX_TP}",
                         "write the tensor-parallel size, e.g. `tp: 2`"))
    plan = raw.get("plan")
    if plan is None:
        return problems
    if not isinstance(plan, Mapping) or not plan:
        return problems + [(("plan",), f"plan: {plan!r} is not a mapping of module globs to styles",
                            'write e.g. `plan: {"*.q_proj": colwise, "*.o_proj": rowwise}`')]
    for glob, style in plan.items():
        if style not in STYLES:
            problems.append((("plan", str(glob)), f"plan[{glob!r}]: unknown style {style!r}",
                             _choices(str(style), tuple(STYLES))))
    return problems


def parse_parallel(raw: Any) -> ParallelSpec | None:
    """The `ParallelSpec` of a value `check_parallel` accepted; None when off (absent, null or `tp: 1`)."""
    if not raw or int(raw.get("tp", 1)) <= 1:
        return None
    return ParallelSpec(tp=int(raw["tp"]), plan=MappingProxyType({str(k): str(v) for k, v in (raw.get("plan") or {}).items()}))


def spec_from_key(key: Mapping[str, Any] | None) -> ParallelSpec | None:
    """The inverse of `ParallelSpec.key` (the layout crossing into the ranks: `layout_of`)."""
    if not key:
        return None
    layout = parse_parallel({k: v for k, v in key.items() if k in PARALLEL_KEYS})
    group = key.get("process_group")
    if layout is None or not group:
        return layout
    return replace(layout, process_group=ProcessGroupSpec(name=str(group["name"]), device=str(group["device"]),
                                                          backend=MappingProxyType(dict(group["backend"]))))


def layout_of(payload: Mapping[str, Any]) -> ParallelSpec:
    """A rank's layout, typed: the one reader of a rank payload's `parallel` key (`ParallelSpec.key`, written by the
    cell that launched the ranks), for every rank task and the ranks' own setup (`procs/ranks.init_ranks`)."""
    layout = spec_from_key(payload.get("parallel"))
    if layout is None:
        raise ValueError(f"a rank's payload carries no tensor-parallel layout: {payload.get('parallel')!r}")
    return layout


def check_process_group(raw: Any) -> list[tuple[str, str]]:
    """Problems of a backend's raw `process_group` (message, hint each); whether c10d knows the name is checked
    after the backend's imports (`backends/check.py`)."""
    if raw is None:
        return []
    if not isinstance(raw, str) or not PROCESS_GROUP_NAME.match(raw):
        return [(f"{raw!r} is not a c10d backend name",
                 "write the name the device's plugin registers with torch.distributed, e.g. `process_group: hccl` "
                 "(leave it out for gloo on CPU)")]
    return []


def with_process_group(layout: ParallelSpec | None, name: str | None, device: str,
                       backend: Mapping[str, Any]) -> ParallelSpec | None:
    """The cell's layout with its backend's declared process group (`name`; None: unchanged, gloo on CPU)."""
    if layout is None or not name:
        return layout
    return replace(layout, process_group=ProcessGroupSpec(name=name, device=device, backend=MappingProxyType(dict(backend))))


def _choices(word: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    known = ", ".join(choices)
    return f"did you mean {close[0]!r}? known: {known}" if close else f"known: {known}"
