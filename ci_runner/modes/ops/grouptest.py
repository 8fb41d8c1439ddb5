"""Group testing: many independent op probes compiled as ONE graph, bisected only where the group fails.

A group is one function that calls each probe's op on its own synthetic inputs and returns every output, compiled
once through `torch.compile` (the backend sees one FX graph) and compared output by output with CPU eager. Then:

* the group compiled, ran on the backend and every output matches: each member passes (one compile for all);
* an output mismatches: that member is probed alone, and its single-probe outcome is the verdict (a backend may
  fuse ops and round differently in a group);
* the group raised, or it did not run on the backend (`CompileWatch.not_ran`: no graph, graph breaks, Dynamo fell
  back to eager, the backend's own fallback), or the backend was given fewer op nodes than members (outputs optimized
  away): the group is split in halves, down to single probes, whose outcomes are exactly today's one-at-a-time
  ones. When a failing group's members all pass alone, it "fails only together": the smallest failing subset
  found (members dropped one by one while the rest still fails) is reported on each member's outcome
  (`fails_together`), not as a finding, since no op fails alone.

Guards against groups that hide failures: eager devices, the `fx` path, ops CPU eager rejects, ops without
tensor outputs and calls with dynamic dims are never grouped; a crash or a hang of a group is journalled under the
group's tag (`g:<ids>`): the parent splits a crashed group in halves and a hung one into single probes (`group_cap`).
A group's inputs together stay within `ops.max_probe_input_mb` (its members' inputs and references are held at
once), as each single probe's do (the parent's guard, `probe.too_big`).
Everything a probe pays besides its compile (the child process, imports, the backend's setup, the Dynamo reset,
the reference run) is paid once per child, or once per group.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from ...backends import named_op_from_error, resolve_backend
from ...config import BackendSpec, spec_from_json
from ...engine.codec import source_of, tensor_specs
from ...failures.diagnostics import capture_fd2
from ...failures.failure import error_text
from ...procs.isolate import child_journal
from ...procs.limits import ChildLimits, HangLimits, stacks_on_signal
from ...models.tree import map_tensors
from ...fsutil import append_line
from .inputs import build_tensors, dynamic_marks, input_bytes
from .probe import (GROUP_PREFIX, TOGETHER_PREFIX, Reference, assemble, judge, packet_of, probe_inputs, reference,
                    reference_inputs, resolve_op, run_probe, select_outputs)

_REDUCE_ATTEMPTS = 24  # most group compiles spent shrinking a "fails only together" set


@dataclass
class _Member:
    probe: Mapping[str, Any]
    op: Any
    ref: Reference
    fresh: list[Any] | None = None  # its inputs as built (`reference_inputs`), for the first attempt


@dataclass
class _Attempt:
    ok: bool
    values: list[Any] | None = None
    why: str = ""  # what went wrong, when not ok
    raised: bool = False  # the group raised (not merely "did not run on the backend")
    named: str | None = None  # the op the error names, when it names one
    ran: dict[str, Any] | None = None
    seconds: float = 0.0


def plan_tasks(probes: Sequence[Mapping[str, Any]], size: int, max_bytes: float = 0) -> list[list[Mapping[str, Any]]]:
    """Consecutive probes in groups of at most `size`, each probe's `group_cap` respected (1: alone), and the
    group's inputs within `max_bytes` (`ops.max_probe_input_mb`; 0: no limit): a group holds its members' inputs
    and their CPU references' copies at once, so it holds no more than one probe at the limit would."""
    tasks: list[list[Mapping[str, Any]]] = []
    cur: list[Mapping[str, Any]] = []
    cap = size
    held = 0
    for p in probes:
        pcap = max(1, min(size, int(p.get("group_cap") or size)))
        if dynamic_marks(p.get("args") or [], p.get("kwargs") or {}):  # alone: group members would share guards
            pcap = 1
        need = input_bytes(p["args"], p["kwargs"]) if max_bytes else 0
        if cur and (pcap != cap or len(cur) >= cap or held + need > max_bytes > 0):
            tasks.append(cur)
            cur, held = [], 0
        cap = pcap
        held += need
        cur.append(p)
    if cur:
        tasks.append(cur)
    return tasks


def group_function(calls: Sequence[tuple[Any, Mapping[str, Any]]], device: str) -> Callable[..., tuple[Any, ...]]:
    """`fn(*tensors)`: each probe's op called on its tensors (in order, `build_tensors`'), the tuple of each one's
    selected outputs. Written as flat Python source (`codec.source_of`, as the repro scripts write a call), so
    Dynamo traces one line per op, not the decoding of every call; a call the source cannot write (a namedtuple,
    a model output) is decoded by a helper, as before."""
    env: dict[str, Any] = {"torch": torch, "select_outputs": select_outputs}
    params: list[str] = []
    lines: list[str] = []

    def tensor(_body: Mapping[str, Any]) -> str:
        params.append(f"t{len(params)}")
        return params[-1]

    for i, (op, probe) in enumerate(calls):
        env[f"op{i}"], env[f"out{i}"] = op, tuple(probe["outputs"]) if probe.get("outputs") is not None else None
        start = len(params)
        try:
            call = f"op{i}({_arguments(probe, tensor, device)})"
        except ValueError:  # decoded at run time by a helper Dynamo inlines
            del params[start:]
            names = [tensor(t) for t in tensor_specs([probe["args"], probe["kwargs"]])]
            env[f"call{i}"] = _decoded_call(op, probe, device)
            call = f"call{i}({', '.join(names)})"
        lines.append(f"    r{i} = select_outputs({call}, out{i})")
    body = "\n".join(lines + [f"    return ({''.join(f'r{i}, ' for i in range(len(calls)))})"])
    code = f"def group({', '.join(params)}):\n{body}\n"
    exec(compile(code, "<deepview-ci probe group>", "exec"), env)  # noqa: S102 - source written above, no input
    return env["group"]


def _arguments(probe: Mapping[str, Any], tensor: Callable[[Mapping[str, Any]], str], device: str) -> str:
    """The call's argument list as source (ValueError: a value or keyword that source cannot write)."""
    import keyword

    dev = f"torch.device({device!r})"
    parts = [source_of(a, tensor, device=dev) for a in probe["args"]]
    for k, v in probe["kwargs"].items():
        if not k.isidentifier() or keyword.iskeyword(k):
            raise ValueError(f"keyword {k!r} is not an identifier")
        parts.append(f"{k}={source_of(v, tensor, device=dev)}")
    return ", ".join(parts)


def _decoded_call(op: Any, probe: Mapping[str, Any], device: str) -> Callable[..., Any]:
    def call(*ts: torch.Tensor) -> Any:
        a, k = assemble(probe["args"], probe["kwargs"], ts, device)
        return op(*a, **k)

    return call


def group_tag(probes: Sequence[Mapping[str, Any]]) -> str:
    return GROUP_PREFIX + ",".join(str(p["id"]) for p in probes)


class _Runner:
    """One child's probing: single probes as `probe.run_probe`, groups as one compile, every outcome emitted."""

    def __init__(self, backend: Any, *, compare_results: bool, limits: ChildLimits, via: str,
                 emit: Callable[[dict[str, Any]], None]) -> None:
        self.backend = backend
        self.compare = compare_results
        self.limits = limits
        self.via = via
        self.emit = emit
        self.device = str(getattr(backend, "device", "cpu"))

    @contextlib.contextmanager
    def guard(self, tag: str, *, measure: bool = False) -> Iterator[None]:
        """Journal `tag` and end the process (faulthandler) when it outlives its limit (`procs/limits.py`: past
        probe_timeout the parent's watch ends it only when it makes no progress; a busy one runs on to the second
        limit, this watchdog's). `measure`: a compile whose duration the next limits derive from."""
        child_journal("enter-probe", tag, sync=False)  # a few per probe: a crash keeps them, fsync is not needed
        faulthandler.dump_traceback_later(self.limits.limit(tag), exit=True)
        t0 = time.monotonic()
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
        if measure:
            self.limits.finished(time.monotonic() - t0)
        child_journal("leave-probe", tag, sync=False)

    def single(self, probe: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
        with self.guard(str(probe["id"]), measure=True):
            out = run_probe(self.backend, probe, compare_results=self.compare, tolerance=tuple(probe["tolerance"]),
                            via=self.via)
        out.update(extra)
        self.emit(out)
        return out

    def task(self, probes: Sequence[Mapping[str, Any]]) -> None:
        """A planned task: groupable members as one group, the rest alone."""
        members: list[_Member] = []
        for p in probes:
            m = None
            if len(probes) > 1:
                with self.guard(str(p["id"])):  # the CPU reference: a crash there is this probe's
                    m = self._member(p)
            if m is None:
                self.single(p)
            else:
                members.append(m)
        if len(members) == 1:
            self.single(members[0].probe)
        elif members:
            self.solve(members)

    def _member(self, probe: Mapping[str, Any]) -> _Member | None:
        """The probe as a group member, or None when it must run alone (see the module docstring)."""
        op = resolve_op(probe)
        if isinstance(op, dict):
            return None
        built = probe_inputs(probe)
        if built is None:  # alone, the probe reports why its inputs cannot be built
            return None
        ref = reference(op, probe, reference_inputs(op, built))
        value = ref.value
        tensors = [value] if isinstance(value, torch.Tensor) else value
        if ref.exc is not None or not isinstance(tensors, (list, tuple)) or not tensors or \
                not all(isinstance(v, torch.Tensor) for v in tensors):
            return None
        return _Member(probe=probe, op=op, ref=ref, fresh=built)

    def solve(self, members: list[_Member]) -> list[dict[str, Any]]:
        """Outcomes of `members`: one compile when the group passes, else the halves, down to single probes."""
        if len(members) == 1:
            return [self.single(members[0].probe)]
        att = self.attempt(members)
        if att.ok:
            return [self._judged(m, v, att, len(members)) for m, v in zip(members, att.values or [])]
        outs = self._split(members, att)
        if att.raised and all(o["status"] == "pass" for o in outs):
            self._together(members, att.why)
        return outs

    def _split(self, members: list[_Member], att: _Attempt) -> list[dict[str, Any]]:
        """A failed group's outcomes: the members whose op the error names first, alone (a vendor compiler names
        the first op it refuses); when one of them fails alone, the rest again as a group; else the halves."""
        named = packet_of(att.named) if att.named else None
        suspects = [m for m in members if named and packet_of(str(m.probe["op"])) == named]
        if suspects and len(suspects) < len(members):
            outs = [self.single(m.probe) for m in suspects]
            rest = [m for m in members if not any(m is x for x in suspects)]
            if any(o["status"] != "pass" for o in outs):
                return outs + self.solve(rest)
            members = rest
            head = outs
        else:
            head = []
        if len(members) == 1:
            return head + [self.single(members[0].probe)]
        half = len(members) // 2
        return head + self.solve(members[:half]) + self.solve(members[half:])

    def _judged(self, m: _Member, value: Any, att: _Attempt, n: int) -> dict[str, Any]:
        verdict = judge(m.probe, m.ref, value, compare_results=self.compare, tolerance=tuple(m.probe["tolerance"]))
        if verdict.get("status") == "mismatch":  # decided alone: the group may have fused and rounded differently
            return self.single(m.probe, group_mismatch=verdict.get("message"))
        out = {"id": m.probe["id"], "op": m.probe["op"], "status": "pass", "stage": None, "error_type": None,
               "message": "", "named_op": None, "named_text": None, "metrics": {}, **verdict,
               "ran": {"graphs": 1, "graphs_executed": 1, "nodes": 1, "group": n},
               "seconds": round(att.seconds / n, 4), "group": n}
        self.emit(out)
        return out

    def attempt(self, members: Sequence[_Member]) -> _Attempt:
        """Compile and run the members as one graph; ok only when the backend compiled and ran every op."""
        probes = [m.probe for m in members]
        t0 = time.monotonic()
        with self.guard(group_tag(probes), measure=True):
            att = self._compile_run(members)
        att.seconds = time.monotonic() - t0
        return att

    def _compile_run(self, members: Sequence[_Member]) -> _Attempt:
        spans, tensors = [], []
        for m in members:  # a run may modify its inputs: a later attempt (a half) builds them again
            built = m.fresh if m.fresh is not None else build_tensors(m.probe["args"], m.probe["kwargs"],
                                                                      int(m.probe["seed"]))
            m.fresh = None
            ts = [self.backend.to_device(t) for t in built]
            spans.append((len(tensors), len(tensors) + len(ts)))
            tensors.extend(ts)
        fn = group_function([(m.op, m.probe) for m in members], self.device)
        try:
            torch._dynamo.reset()  # a fresh cache (torch.compile compiles on the call, under the watch)
            compiled, watch = self.backend.compile_watched(fn)
            with capture_fd2(), watch:
                values = map_tensors(lambda t: t.detach().to("cpu"), compiled(*tensors))
        except Exception as exc:
            text = error_text(exc)
            return _Attempt(ok=False, raised=True, why=f"{type(exc).__name__}: {text[:400]}",
                            named=named_op_from_error(text)[0])
        why = watch.not_ran()
        nodes = watch.summary().get("nodes", 0)
        if not why and nodes < len(members):
            why = f"the backend was given {nodes} op node(s) for {len(members)} probes (outputs optimized away)"
        if why:
            return _Attempt(ok=False, why=why)
        return _Attempt(ok=True, values=list(values), ran={"nodes": nodes})

    def _together(self, members: list[_Member], why: str) -> None:
        """The smallest failing subset of a group whose members all pass alone, emitted as a `together:` row."""
        current = list(members)
        attempts = 0
        for m in list(members):
            if len(current) <= 2 or attempts >= _REDUCE_ATTEMPTS:
                break
            trial = [x for x in current if x is not m]
            attempts += 1
            att = self.attempt(trial)
            if not att.ok and att.raised:
                current, why = trial, att.why
        self.emit({"id": TOGETHER_PREFIX + ",".join(str(m.probe["id"]) for m in current),
                   "members": [m.probe["id"] for m in current], "ops": [m.probe["op"] for m in current],
                   "message": f"fails only together ({len(current)} probes, each passes alone): {why}"[:2000]})


def probe_groups(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Isolated-child entry (`run_isolated`): rebuild the backend, run the probes in groups of
    `payload["group_size"]` (see the module docstring), append each outcome to `payload["results"]`."""
    backend = resolve_backend(spec_from_json(BackendSpec, payload["backend"]))
    backend.prepare()
    results = payload["results"]
    limits = ChildLimits(HangLimits.from_json(payload["limits"]), float(payload["deadline_wall"]),
                         Path(payload["limits_file"]), [float(s) for s in payload.get("measured_s") or ()])
    runner = _Runner(backend, compare_results=bool(payload.get("compare", True)), limits=limits,
                     via=str(payload.get("via", "dynamo")),
                     emit=lambda o: append_line(results, json.dumps(o, default=str), sync=False))
    groupable = not bool(getattr(backend, "is_eager", False)) and runner.via == "dynamo"
    tasks = plan_tasks(payload["probes"], int(payload.get("group_size", 1)) if groupable else 1,
                       float(payload.get("max_probe_input_mb") or 0) * 2**20)
    with stacks_on_signal():  # the parent's watch: where a stalled probe is stuck
        for task in tasks:
            runner.task(task)
    return {"probed": len(payload["probes"]), "tasks": len(tasks)}
