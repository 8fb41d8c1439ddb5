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
the model's family (`ci_runner/engine/tpplan.py`). `check_parallel` finds the mistakes at load, `parse_parallel`
builds the `ParallelSpec` a cell carries.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

MAX_TP = 64
# The styles a plan may name: PyTorch's tensor-parallel styles, as the engine builds them (engine/tpplan.py)
STYLES: Mapping[str, str] = MappingProxyType({
    "colwise": "ColwiseParallel(): weight rows (output features) sharded; each rank keeps its slice of the output",
    "rowwise": "RowwiseParallel(): weight columns (input features) sharded; the outputs are all-reduced",
    "colwise_gather": "ColwiseParallel(output_layouts=Replicate()): as colwise, the output all-gathered (an LM head)",
    "rowwise_embedding": "RowwiseParallel(input_layouts=Replicate()): an embedding's vocabulary sharded, all-reduced",
})
PARALLEL_KEYS = ("tp", "plan")


@dataclass(frozen=True, kw_only=True)
class ParallelSpec:
    """A resolved layout: `tp` ranks, the plan (glob → style; empty: the family's default plan)."""

    tp: int
    plan: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def label(self) -> str:
        """What findings carry in `parallel`: ``tp2``."""
        return f"tp{self.tp}"

    def key(self) -> dict[str, Any]:
        """The layout as plain JSON (thresholds, fingerprints, reports)."""
        return {"tp": self.tp, "plan": dict(self.plan)}


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
    """The inverse of `ParallelSpec.key` (a cell crossing a process boundary)."""
    return parse_parallel(dict(key)) if key else None


def _choices(word: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    known = ", ".join(choices)
    return f"did you mean {close[0]!r}? known: {known}" if close else f"known: {known}"
