"""Did the backend run what the numerics mode compares? The compiled captures, watched, and the ways to capture.

A comparison means something only when the backend ran the code (`backends.ran`). OpenVINO falls back to PyTorch
silently when its conversion fails, and the capture hooks themselves can make it fail: on a shifted-window model
(swin) hooks on every module give "Tensor name is not a number: add", with copies and with references alike, and
the view then compared PyTorch with PyTorch (issue 38). So the cumulative view captures in the first of these ways
(`CAPTURE_WAYS`) that the backend runs, each a fresh compile watched (`Backend.compile_watched`: the graphs given and
run, Dynamo's counters (frames run in eager, aot_autograd failures, the recompile limit; not graph breaks: the graphs
around a break still run on the backend) and the backend's own fallbacks, read as one):

* `hooks-copy`: hooks on every module; outputs the model changes in place later are copied at the hook;
* `hooks-reference`: the same hooks keeping references (tried only when some output is copied): the outputs
  changed in place later are then not comparable in this view;
* `no-hooks`: the model compiled as it is: its output is compared; its layers are compared by the isolated view
  (each module compiled alone, without hooks, its sub-calls stubbed), which `isolated: auto` then runs.

When none runs on the backend, every call of the sample is `not_ran` (inconclusive, never a pass). The isolated
view's modules are watched the same way (`WatchedRunner`), each on its first call; on a backend with a vendor watch
each module is a fresh compile (Dynamo reset first: the watch reads the partitions of one compile, and Dynamo would
otherwise run code it compiled for another module of the same class).

The toolbox's compiled runs of a whole model (a dump of a compiled target, batch invariance) are watched the same
way (`watched_outputs`: every output copied at its hook, else without hooks), and so are the per-phase runs
(`modes/numerics/phases.py`, with `not_ran` and `partial_sites`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Sequence

import torch
from torch import nn

from ...watch.capture import FlatOutput, OutputHooks, iter_tensors
from .capture import capture_compiled_outputs, compared_flat
from .settings import dynamo_settings

CAPTURE_WAYS: tuple[str, ...] = ("hooks-copy", "hooks-reference", "no-hooks")
NOT_RAN = "not_ran"  # the stage of a record whose call the backend did not run (held against a pass)
CAPTURE = "capture"  # the stage of a call this view's capture could not hold (compared in the other view)


def _forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What the watched captures compile: the model's call in a frame of its own (`capture._capture_forward`)."""
    return module(*args, **kwargs)


def partial_sites(facts: Mapping[str, Any]) -> dict[str, list[str]]:
    """The ops a backend's partitioner left to PyTorch (a vendor watch's `eager_ops`) -> the modules whose own code
    calls them (`eager_sites`, from the graph's `nn_module_stack`; `""` is the compiled module itself, and stands
    for an op whose module the graph does not say). Those modules ran in part on PyTorch: not tested there."""
    sites = facts.get("eager_sites") or {}
    return {op: sorted({"" if w == "(model)" else w for w in sites.get(op) or ["(model)"]})
            for op in facts.get("eager_ops") or ()}


def partial_reason(op: str, backend: str | None) -> str:
    """Why a module is not tested on the backend: its partitioner left `op` to PyTorch."""
    return f"{backend or 'the backend'}'s partitioner left {op} to PyTorch eager here (a partial partition)"


@dataclass
class CaptureRun:
    """One sample's compiled capture: the way it was taken, the ways tried before it and why they did not run on
    the backend, the records (`(call key, flat output)`; the root's alone for `no-hooks`), the keys this way cannot
    hold (changed in place, under `hooks-reference`) and, when no way ran on the backend, why."""

    way: str
    records: list[tuple[str, FlatOutput]] = field(default_factory=list)
    tried: list[dict[str, str]] = field(default_factory=list)
    unheld: set[str] = field(default_factory=set)
    not_ran: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    backend: str | None = None  # the backend's compile name (what `partial_reason` says)
    signatures: dict[str, tuple[str, str]] = field(default_factory=dict)  # call key -> (name, `call_signature`)

    def compared(self) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """The records as the toolbox reads them: (call key, {sub: compared tensor})."""
        return [(key, compared_flat(flat)) for key, flat in self.records]

    def status(self) -> dict[str, Any]:
        """What the view's status record says of the capture (`data.capture` in the mode)."""
        out: dict[str, Any] = {"capture": self.way}
        if self.tried:
            out["fallbacks"] = self.tried
        if self.not_ran:
            out["not_ran"] = self.not_ran
        elif self.facts.get("eager_ops"):
            out["partial"] = partial_sites(self.facts)
        return out


def _attempt(module: nn.Module, backend: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
             clone: bool | Collection[str] | None
             ) -> tuple[list[tuple[str, FlatOutput]], str | None, dict[str, Any], dict[str, tuple[str, str]]]:
    """One fresh compile and run, watched: (records, why it did not run on the backend, the backend's facts, what
    each call is (`OutputHooks.signatures`)). `clone` None: no hooks (the root's output is the one record); True:
    every output copied at its hook."""
    fn, watch = backend.compile_watched(_forward)
    with watch:
        if clone is None:
            with torch.no_grad():
                out = fn(module, tuple(args), dict(kwargs))
            records = [("", tuple(iter_tensors(out)))]
            sigs: dict[str, tuple[str, str]] = {}
        else:
            with OutputHooks(module, clone=clone) as hooks:
                _out, records = capture_compiled_outputs(module, fn, args, kwargs, hooks)
                sigs = dict(hooks.signatures)
    return records, watch.not_ran(breaks=False), {**watch.summary(), **watch.vendor_facts()}, sigs


def watched_capture(module: nn.Module, backend: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
                    mutated: Collection[str]) -> CaptureRun:
    """The cumulative view's compiled capture of one sample, in the first of `CAPTURE_WAYS` the backend runs."""
    ways: list[tuple[str, bool | Collection[str] | None]] = [("hooks-copy", set(mutated))]
    if mutated:
        ways.append(("hooks-reference", ()))
    ways.append(("no-hooks", None))
    run = _first_way_that_ran(module, backend, args, kwargs, ways)
    if run.way == "hooks-reference":
        run.unheld = {k for k, _ in run.records if k.partition("#")[0] in mutated}
    return run


def watched_outputs(module: nn.Module, backend: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> CaptureRun:
    """The toolbox's compiled run of a whole model with every submodule's output (a dump of a compiled target,
    batch invariance; watched, as everything the numerics package compiles): a fresh compile with every output copied at
    its hook (no eager pass says which are changed in place later) or, when the backend does not run the model
    with hooks, without them (`no-hooks`: the model's output alone); `not_ran` when it ran neither way."""
    torch._dynamo.reset()  # a fresh compile: the vendor watch counts one compile's partitions
    with torch._dynamo.config.patch(**dynamo_settings()):
        return _first_way_that_ran(module, backend, args, kwargs, [("hooks-copy", True), ("no-hooks", None)])


def watched_outputs_each(module: nn.Module, backend: Any, calls: Sequence[Mapping[str, Any]]) -> list[CaptureRun]:
    """`watched_outputs` of several keyword calls (samples of the same shapes) through ONE fresh compile: the hooks
    stay on across the calls, so Dynamo compiles for the first and reuses that code for the rest (a recompile, when
    a guard differs, is Dynamo's own). Watched once around all of them: when the backend did not run them, every
    call's run says so (`not_ran`), after the same fallback to `no-hooks`."""
    torch._dynamo.reset()  # a fresh compile: the vendor watch counts one compile's partitions
    tried: list[dict[str, str]] = []
    runs: list[CaptureRun] = []
    with torch._dynamo.config.patch(**dynamo_settings()):
        for i, (way, clone) in enumerate((("hooks-copy", True), ("no-hooks", None))):
            if i:
                torch._dynamo.reset()
            each, why, facts = _attempt_each(module, backend, calls, clone)
            runs = [CaptureRun(way=way, records=r, tried=list(tried), not_ran=why, facts=facts,
                               backend=backend.spec.compile) for r in each]
            if why is None:
                break
            tried.append({"capture": way, "not_ran": why[:400]})
    return runs


def _attempt_each(module: nn.Module, backend: Any, calls: Sequence[Mapping[str, Any]],
                  clone: bool | None) -> tuple[list[list[tuple[str, FlatOutput]]], str | None, dict[str, Any]]:
    """`_attempt` of every call in turn under one compile, one watch and (with `clone`) one set of hooks."""
    fn, watch = backend.compile_watched(_forward)
    out: list[list[tuple[str, FlatOutput]]] = []
    with watch:
        if clone is None:
            for kw in calls:
                with torch.no_grad():
                    result = fn(module, (), dict(kw))
                out.append([("", tuple(iter_tensors(result)))])
        else:
            with OutputHooks(module, clone=clone) as hooks:
                for kw in calls:
                    out.append(capture_compiled_outputs(module, fn, (), kw, hooks)[1])
    return out, watch.not_ran(breaks=False), {**watch.summary(), **watch.vendor_facts()}


def _first_way_that_ran(module: nn.Module, backend: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
                        ways: Sequence[tuple[str, bool | Collection[str] | None]]) -> CaptureRun:
    """The first of `ways` ((name, clone)) the backend runs, each a fresh compile; the last one tried (with its
    `not_ran`) when none does."""
    run = CaptureRun(way=ways[0][0], backend=backend.spec.compile)
    for i, (way, clone) in enumerate(ways):
        if i:
            torch._dynamo.reset()  # each way a fresh compile, without counting towards the recompile limit
        records, why, facts, sigs = _attempt(module, backend, args, kwargs, clone)
        run.way, run.records, run.facts, run.not_ran, run.signatures = way, records, facts, why, sigs
        if why is None:
            break
        run.tried.append({"capture": way, "not_ran": why[:400]})
    if run.not_ran is not None:
        run.tried.pop()  # the last way tried is the one reported
    return run


class WatchedRunner:
    """The isolated view's `runner(name, module)`: each module compiled once by `backend`, its first call watched
    (`not_ran` per module name: why the backend did not run it; absent: it did)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.compiled: dict[str, Callable[..., Any]] = {}
        self.not_ran: dict[str, str] = {}

    def __call__(self, name: str, module: nn.Module) -> Callable[..., Any]:
        fn = self.compiled.get(name)
        if fn is not None:
            return fn
        compiled, watch = self.backend.compile_watched(module)
        if watch.active:  # a vendor watch reads one fresh compile: no code compiled for another module of the
            torch._dynamo.reset()  # same class (Linear.forward) may run here (torch.compile compiles on the call)

        def first(*args: Any, **kwargs: Any) -> Any:
            with watch:
                out = compiled(*args, **kwargs)
            # no graph for this record: the module has no op of its own (an identity, or its sub-calls stubbed), or
            # (no vendor watch, no reset) Dynamo ran code it compiled for another module of the same class
            record = watch.record
            given = record is None or bool(record.graphs)
            why = watch.not_ran(breaks=False) if given else watch.counters.fallback(breaks=False)
            own = [op for op, where in partial_sites(watch.vendor_facts()).items() if "" in where]  # not a stub's
            if why or own:
                self.not_ran[name] = why or partial_reason(", ".join(own), self.backend.spec.compile)
            self.compiled[name] = compiled
            return out

        return first
