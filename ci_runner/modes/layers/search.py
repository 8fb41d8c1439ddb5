"""The `layers` mode's engine: the module tree, replayable call inputs, the top-down search, the probing child.

The search is a pure function of the probe outcomes (`search(tree, probe)`): breadth-first from the root,
a failing module's children are tried, a passing module's subtree never is. The smallest failing modules are
the failing ones none of whose tried children fail alone (this covers "fails only in combination": the parent
fails, every child passes alone).

Because the search is deterministic, a crash costs nothing already learnt: the probing child appends each
outcome to a JSON-lines file as soon as it has it; after an abort, segfault or hang the parent appends the
crashed module's outcome (named by the crash journal) and a fresh child replays the known outcomes and goes on
with the remaining candidates.

Call inputs are stored once per capture with the call codec (`codec.py`, strict: only what can be rebuilt
exactly): every distinct tensor in one safetensors file, and per module and call a small JSON spec of the call
structure. Strides are kept, so a module is replayed on inputs laid out as they were on the reference.
"""

from __future__ import annotations

import faulthandler
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

import torch

from ...engine import codec
from ...backends import CompileWatch, boilerplate_lines, resolve_backend
from ...watch.capture import ModuleCapture, detach_tree, iter_tensors
from ...engine.codec import TensorStore, Unstorable, check_value, decode_call
from ...failures.diagnostics import capture_fd2, compiler_words
from ...failures.failure import is_compile_stage, raised_traceback, unwrap
from ...fsutil import atomic_write_json
from ...config import BackendSpec, ModelSpec, spec_from_json
from ...procs.isolate import child_journal
from ...procs.limits import ChildLimits, HangLimits, stacks_on_signal
from ...models.load import load_model
from ...failures.outcome import ProbeOutcome, append_outcome, read_outcomes
from ...models.tree import module_tensors, tensors_in
from .tree import ROOT, ModuleTree, SearchResult, StopSearch, label, unlabel
from .tracking import ExecutingTracker

BOILERPLATE = boilerplate_lines()  # the backends' message lines that say nothing of a cause (root causes skip them)

# --------------------------------------------------------------------------- call inputs

def encode_call(args: tuple[Any, ...], kwargs: Mapping[str, Any], store: TensorStore) -> dict[str, Any]:
    """A module call's inputs as the layers mode stores them: strict (replayable exactly), strides kept."""
    return codec.encode_call(args, kwargs, store, strict=True, keep_strides=True)


# --------------------------------------------------------------------------- capture

@dataclass
class RecordedCall:
    name: str
    module_class: str
    call_index: int
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    opaque: str | None = None  # why the call's inputs cannot be stored, if they cannot


class _Enough(BaseException):
    """Raised by a capture hook once every wanted call is recorded: the rest of the forward is not needed (a
    BaseException, so that the capture's own guard against failing callbacks lets it through)."""


def record_calls(model: torch.nn.Module, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None, *,
                 include: Collection[str] | None = None, keep: bool = True, clone: bool = False,
                 first_only: bool = False) -> tuple[list[RecordedCall], bool]:
    """One reference forward with pre-hooks on every submodule (or on those named in `include`).

    With `keep`, each call's args and kwargs are kept: by reference (cheap) unless `clone`; the second value
    says whether the forward later modified a kept tensor in place, in which case the caller must record
    again with `clone=True`. Without `keep`, only the call structure is recorded (names, classes, call
    counts, whether the inputs can be stored): hooks, nothing retained. With `first_only` (and `include`), the
    forward stops as soon as each named module's first call is recorded.
    """
    recorded: list[RecordedCall] = []
    versions: list[tuple[torch.Tensor, int]] = []
    wanted = None if include is None else set(include)
    pending = set(wanted) if first_only and wanted else None

    def pre(info: Any, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
        rec = RecordedCall(info.name, info.module_class, info.call_index)
        if keep:
            if clone:
                a, kw = detach_tree(a), detach_tree(kw)
            else:
                versions.extend((t, t._version) for t in tensors_in((a, kw)))
            rec.args, rec.kwargs = a, dict(kw)
        else:
            try:
                check_value((a, dict(kw)), strict=True)
            except Unstorable as exc:
                rec.opaque = f"call {info.call_index} takes {exc}"
        recorded.append(rec)
        if pending is not None:
            pending.discard(info.name)
            if not pending:
                raise _Enough()

    include_fn = None if wanted is None else (lambda name, _m: name in wanted)
    try:
        with torch.no_grad(), ModuleCapture(model, pre=pre, include=include_fn) as cap:
            model(*args, **dict(kwargs or {}))
    except _Enough:
        pass
    if cap.errors:
        name, exc = cap.errors[0]
        raise RuntimeError(f"capture hook failed in {label(name)}: {exc}") from exc
    mutated = any(t._version != v for t, v in versions)
    return recorded, mutated


def scan_model(model: torch.nn.Module, kwargs: Mapping[str, Any], *, all_calls: bool = False) -> ModuleTree:
    """The capture pass over every call: which modules run, how often, and whether their inputs can be replayed.

    Tensor values are not kept here (that would cost a fresh copy of every activation); `capture_inputs`
    records the values of the modules about to be probed, level by level.
    """
    recorded, _ = record_calls(model, (), kwargs, keep=False)
    why_not: dict[str, str] = {}
    for rec in recorded:
        if rec.opaque and (all_calls or rec.call_index == 0):
            why_not.setdefault(rec.name, rec.opaque)
    return tree_of(recorded, why_not)


def tree_of(recorded: Iterable[Any], why_not: Mapping[str, str] | None = None) -> ModuleTree:
    """The module tree of one recorded forward (`record_calls`' records): every module that ran, its class and its
    call count, in first-call order; replayable unless `why_not` says why not."""
    why_not = why_not or {}
    classes: dict[str, str] = {}
    counts: dict[str, int] = {}
    for rec in recorded:
        counts[rec.name] = counts.get(rec.name, 0) + 1
        classes.setdefault(rec.name, rec.module_class)
    return ModuleTree.build((n, classes[n], counts[n], n not in why_not, why_not.get(n)) for n in classes)


def capture_inputs(model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], names: Collection[str], *,
                   all_calls: bool = False) -> dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    """The inputs of the named modules (first call, or every call) from one reference forward."""
    recorded, mutated = record_calls(model, args, kwargs, include=names, first_only=not all_calls)
    if mutated:
        recorded, _ = record_calls(model, args, kwargs, include=names, clone=True, first_only=not all_calls)
    out: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}
    for rec in recorded:
        if rec.call_index == 0 or all_calls:
            out.setdefault(rec.name, []).append((rec.args, rec.kwargs))
    return out


# --------------------------------------------------------------------------- outcomes and the search

def search(tree: ModuleTree, probe: Callable[[str], ProbeOutcome],
           prefetch: Callable[[list[str]], None] | None = None, *, twins: bool = True) -> SearchResult:
    """Top-down, breadth-first: the whole model, then the children of every failing module, level by level.

    A module that cannot be replayed (opaque inputs) is not run; the search looks through it to its children.
    `prefetch` is told the modules about to be probed (their inputs are captured in one reference forward).
    `twins`, so the cost follows root causes, not layers:
    * cousins: failing parents of a level with the same class, cause and children (`twin_plan`) are searched once;
      a twin probes only the children that failed in the first and, when each fails with the same cause, its
      other children take the first's outcomes (`inferred_from`); else they are probed too;
    * siblings with the same class and subtree (the layers of a decoder): the first is searched to the bottom
      at once; each other one probes only its counterparts of the first's smallest failing modules and, when each
      fails with the same cause, takes the first's outcomes for the rest of its subtree; else it is searched."""
    outcomes: dict[str, ProbeOutcome] = {}
    complete = True
    try:
        outcomes[tree.root] = probe(tree.root)
        _descend(tree, [tree.root] if outcomes[tree.root].failed else [], probe, prefetch, outcomes, twins)
        _probe_looked_through(tree, probe, outcomes)
    except StopSearch:
        complete = False
    return SearchResult(outcomes=outcomes, minimal=minimal_failing(tree, outcomes), complete=complete)


Probe = Callable[[str], ProbeOutcome]
Prefetch = Callable[[list[str]], None] | None


def _descend(tree: ModuleTree, frontier: list[str], probe: Probe, prefetch: Prefetch,
             outcomes: dict[str, ProbeOutcome], twins: bool) -> None:
    order = {name: i for i, name in enumerate(tree.nodes)}
    while frontier:
        firsts, twin_of = twin_plan(tree, frontier, outcomes) if twins else (frontier, {})
        kids = [c for p in firsts for c in tree.children(p)]
        later = _sibling_twins(tree, kids) if twins else {}
        nxt = _probe_children(tree, firsts, probe, prefetch, outcomes, only=[c for c in kids if c not in later])
        nxt += _probe_twins(tree, twin_of, probe, prefetch, outcomes)
        nxt += _probe_siblings(tree, later, probe, prefetch, outcomes)
        frontier = sorted(nxt, key=lambda n: order[n])


def _under(name: str, top: str) -> bool:
    return name == top or name.startswith(top + ".")


def _sibling_twins(tree: ModuleTree, kids: Sequence[str]) -> dict[str, str]:
    """Each child after the first of its parent's children with the same class and subtree → that first one."""
    first: dict[tuple[Any, ...], str] = {}
    out: dict[str, str] = {}
    for kid in kids:
        node = tree.nodes[kid]
        if not node.replayable or not tree.children(kid):
            continue
        shape = tuple((n[len(kid):], tree.nodes[n].module_class) for n in tree.nodes if n.startswith(kid + "."))
        lead = first.setdefault((node.parent, node.module_class, shape), kid)
        if lead != kid:
            out[kid] = lead
    return out


def _probe_siblings(tree: ModuleTree, later: Mapping[str, str], probe: Probe, prefetch: Prefetch,
                    outcomes: dict[str, ProbeOutcome]) -> list[str]:
    """The later sibling twins (`_sibling_twins`): confirmed through the first's smallest failing modules, else
    probed and returned for the search when failing."""
    searched: set[str] = set()
    plain: list[str] = []
    smallest_of: dict[str, list[str]] = {}
    for lead in dict.fromkeys(later.values()):
        if outcomes[lead].failed and lead not in searched:  # the first one, to the bottom, now
            searched.add(lead)
            _descend(tree, [lead], probe, prefetch, outcomes, True)
            smallest_of[lead] = [n for n in minimal_failing(tree, outcomes) if _under(n, lead)]
    if prefetch is not None:  # every twin's counterparts in one reference forward, not one forward per twin
        need = [kid + n[len(lead):] for kid, lead in later.items() for n in smallest_of.get(lead, [])]
        if need := [n for n in need if n not in outcomes]:
            prefetch(need)
    for kid, lead in later.items():
        if not outcomes[lead].failed:
            plain.append(kid)
            continue
        smallest = smallest_of[lead]
        mine = [kid + n[len(lead):] for n in smallest]
        for n in mine:
            outcomes[n] = outcomes.get(n) or probe(n)
        if not smallest or any(outcomes[m].cause_of(BOILERPLATE) != outcomes[n].cause_of(BOILERPLATE)
                               for m, n in zip(mine, smallest)):
            plain.append(kid)
            continue
        for n in [n for n in outcomes if _under(n, lead) and n not in smallest]:
            o = outcomes[n]
            outcomes[kid + n[len(lead):]] = ProbeOutcome(
                name=kid + n[len(lead):], status=o.status, stage=o.stage, error_type=o.error_type, ran=dict(o.ran),
                inferred_from=n, message=f"not probed: {label(kid)} is a twin of {label(lead)} (same class and "
                                         f"submodules) whose smallest failing modules fail here too with the same "
                                         f"cause, so it takes the outcome of {label(n)}")
    return _probe_children(tree, list(dict.fromkeys(tree.nodes[k].parent or ROOT for k in plain)), probe, prefetch, outcomes,
                           only=plain) if plain else []


def twin_plan(tree: ModuleTree, names: Sequence[str], outcomes: Mapping[str, ProbeOutcome]) -> tuple[list[str], dict[str, str]]:
    """`names` split into the first of each twin group (same class, cause and children's shape) and the rest,
    each mapped to its group's first."""
    firsts: list[str] = []
    twin_of: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name in names:
        o = outcomes.get(name)
        if name == ROOT or o is None or not o.failed or not tree.children(name):
            firsts.append(name)
            continue
        shape = tuple((c[len(name) + 1:], tree.nodes[c].module_class) for c in tree.children(name))
        key = (tree.nodes[name].module_class, o.cause_of(BOILERPLATE), shape)
        if key in seen:
            twin_of[name] = seen[key]
        else:
            seen[key] = name
            firsts.append(name)
    return firsts, twin_of


def _probe_children(tree: ModuleTree, parents: Sequence[str], probe: Callable[[str], ProbeOutcome],
                    prefetch: Callable[[list[str]], None] | None, outcomes: dict[str, ProbeOutcome],
                    only: Collection[str] | None = None) -> list[str]:
    """Probe the children of `parents` (those in `only`, when given); the failing and skipped ones are returned."""
    kids = [c for p in parents for c in tree.children(p) if only is None or c in only]
    if prefetch is not None:
        level = [c for c in kids if tree.nodes[c].replayable and c not in outcomes and not wrapped(tree, c, outcomes)]
        if level:
            prefetch(level)
    nxt: list[str] = []
    for child in kids:
        node = tree.nodes[child]
        if not node.replayable:
            outcomes[child] = ProbeOutcome(name=child, status="skipped",
                                           message=f"inputs cannot be replayed: {node.why_not}")
            nxt.append(child)  # look through it
            continue
        if child not in outcomes and wrapped(tree, child, outcomes):
            outcomes[child] = ProbeOutcome(name=child, status="skipped", message=LOOKED_THROUGH)
            nxt.append(child)
            continue
        res = outcomes[child] if child in outcomes and not outcomes[child].inferred_from else probe(child)
        outcomes[child] = res
        if res.failed:
            nxt.append(child)
    return nxt


def _probe_twins(tree: ModuleTree, twin_of: Mapping[str, str], probe: Callable[[str], ProbeOutcome],
                 prefetch: Callable[[list[str]], None] | None, outcomes: dict[str, ProbeOutcome]) -> list[str]:
    def counterpart(child: str, parent: str) -> str:
        return twin_of[parent] + child[len(parent):]

    confirm = {c for p in twin_of for c in tree.children(p)
               if (o := outcomes.get(counterpart(c, p))) is None or o.failed or o.status == "skipped"}
    nxt = _probe_children(tree, list(twin_of), probe, prefetch, outcomes, only=confirm)
    def same(c: str, p: str) -> bool:
        return (o := outcomes.get(c)) is not None and (t := outcomes.get(counterpart(c, p))) is not None and o.cause_of(BOILERPLATE) == t.cause_of(BOILERPLATE)

    unlike = [p for p in twin_of if not all(same(c, p) for c in tree.children(p) if c in confirm)]
    rest = {c for p in unlike for c in tree.children(p) if c not in confirm}
    nxt += _probe_children(tree, unlike, probe, prefetch, outcomes, only=rest)
    for parent in twin_of:
        if parent in unlike:
            continue
        for child in tree.children(parent):
            if child in confirm:
                continue
            twin = counterpart(child, parent)
            o = outcomes[twin]
            outcomes[child] = ProbeOutcome(
                name=child, status=o.status, ran=dict(o.ran), inferred_from=twin,
                message=f"not probed: {label(parent)} fails like its twin {label(twin_of[parent])} (same class, "
                        f"same cause, same children), so it takes the outcome of {label(twin)}")
    return nxt


LOOKED_THROUGH = ("not probed alone: it holds nearly all of its parent (its parent's only child with child modules), "
                  "so its child modules were probed directly; it is probed itself only when none of them fails")


def wrapped(tree: ModuleTree, name: str, outcomes: Mapping[str, ProbeOutcome]) -> bool:
    """`name` is the whole model's only child that has child modules (its `model` beside `lm_head`), or such a
    child's in turn: probing it alone would compile nearly the whole model again, so the search looks through it
    (`LOOKED_THROUGH`). Lower down it does not: failing parents are what twin layers are found by. A module below
    it that fails alone is reported although the wrapper itself never ran alone (were it to pass, or be
    inconclusive, alone, the plain search would not have looked below it)."""
    parent = tree.nodes[name].parent
    if parent is None or not tree.children(name):
        return False
    top = parent == tree.root or ((o := outcomes.get(parent)) is not None and o.message == LOOKED_THROUGH)
    return top and [c for c in tree.children(parent) if tree.children(c)] == [name]


def _probe_looked_through(tree: ModuleTree, probe: Probe, outcomes: dict[str, ProbeOutcome]) -> None:
    """Each looked-through module none of whose descendants fails alone is probed after all, deepest first: then
    the search's answer is the one probing it in its turn would have given."""
    for name in reversed([n for n, o in outcomes.items() if o.status == "skipped" and o.message == LOOKED_THROUGH]):
        if not _fails_below(tree, outcomes, name):
            outcomes[name] = probe(name)


def _fails_below(tree: ModuleTree, outcomes: Mapping[str, ProbeOutcome], name: str) -> bool:
    for child in tree.children(name):
        o = outcomes.get(child)
        if o is not None and (o.failed or (o.status == "skipped" and _fails_below(tree, outcomes, child))):
            return True
    return False


def minimal_failing(tree: ModuleTree, outcomes: Mapping[str, ProbeOutcome]) -> list[str]:
    """Failing modules none of whose tried descendants (looking through skipped ones) fail alone."""

    return [n for n in tree.nodes
            if (o := outcomes.get(n)) is not None and o.failed and not _fails_below(tree, outcomes, n)]


OWN_SUFFIX = "#own"  # outcome name of a module probed with its child modules run eagerly


def own_name(name: str) -> str:
    """The outcome name of `name`'s own-code probe: the module compiled with its child modules run eagerly."""
    return label(name) + OWN_SUFFIX


def own_code_candidates(tree: ModuleTree, outcomes: Mapping[str, ProbeOutcome]) -> list[str]:
    """Smallest failing modules whose child modules all pass alone (or are inconclusive: raised nothing, but the
    backend never ran them): it is open whether the module fails in its own code or needs its children together,
    which an own-code probe decides."""
    out = []
    for name in minimal_failing(tree, outcomes):
        kids = tree.children(name)
        if (outcomes[name].status == "fail" and kids
                and all(c in outcomes and outcomes[c].status in ("pass", "inconclusive") for c in kids)):
            out.append(name)
    return out




# --------------------------------------------------------------------------- the probing child

@dataclass(frozen=True, kw_only=True)
class ChildPlan:
    """What a probing child needs; JSON through `run_isolated`."""

    model: dict[str, Any]  # ModelSpec fields
    backend: dict[str, Any]  # BackendSpec fields
    seed: int
    dtype: str | None
    layers_dir: str  # holds tree.json, root_call.json and root_inputs.safetensors
    outcomes_file: str
    timeout_file: str  # faulthandler writes here when a module overruns probe_timeout
    probe_timeout: float
    deadline_wall: float  # time.time() after which no new module is started
    all_calls: bool = False
    fd2_file: str | None = None  # each module's fd 2 goes here while it compiles and runs (read after a crash)
    limits_file: str | None = None  # a JSON line per probe: the limit it runs under and why (`probe_limit`)
    limits: dict[str, float] = field(default_factory=dict)  # `HangLimits.to_json()`


MEASURED = ("pass", "fail", "inconclusive")  # probes that finished: their durations are what this cell measured


def measured_s(known: Mapping[str, ProbeOutcome]) -> list[float]:
    """The durations this cell measured: probes that finished (not a hang, not one inferred from a twin)."""
    return [o.duration_s for o in known.values() if o.status in MEASURED and not o.inferred_from]


def probe_limit(plan: ChildPlan, known: Mapping[str, ProbeOutcome], name: str) -> float:
    """The limit the child's own watchdog puts on probing `name` (`procs/limits.ChildLimits`: the second limit,
    else the time left), recorded in `plan.limits_file` for the parent."""
    child = ChildLimits(HangLimits.from_json(plan.limits), plan.deadline_wall,
                        Path(plan.limits_file) if plan.limits_file else None)
    return child.limit(name, measured_s(known))


def write_root_call(layers_dir: Path, tree: ModuleTree, kwargs: Mapping[str, Any]) -> None:
    """What the probing child starts from: the tree and the model's own call (its inputs)."""
    store = TensorStore()
    spec = encode_call((), kwargs, store)
    store.save(layers_dir / "root_inputs.safetensors")
    atomic_write_json(layers_dir / "root_call.json", spec)
    atomic_write_json(layers_dir / "tree.json", tree.to_json())


def _materialize(out: Any) -> None:
    """Force asynchronous devices to finish (and surface their errors) by fetching the outputs."""
    for _, t in iter_tensors(out):
        if t.device.type != "cpu":
            t.to("cpu")


def probe_child(payload: dict[str, Any]) -> dict[str, Any]:
    """Entry point of a probing child (`run_isolated("ci_runner.modes.layers.search:probe_child", …)`).

    Loads the model and the backend, replays the outcomes already known, and probes the rest of the search,
    appending every outcome as soon as it has it. Each level's inputs are captured by one reference forward
    of the CPU model (which probing never modifies: a module is copied before it goes to a device).
    """
    faulthandler.enable(file=sys.stderr)

    from safetensors.torch import load_file

    plan = ChildPlan(**payload)
    layers_dir = Path(plan.layers_dir)
    tree = ModuleTree.from_json(json.loads((layers_dir / "tree.json").read_text(encoding="utf-8")))
    root_spec = json.loads((layers_dir / "root_call.json").read_text(encoding="utf-8"))
    root_args, root_kwargs = decode_call(root_spec, load_file(str(layers_dir / "root_inputs.safetensors")))
    outcomes_file = Path(plan.outcomes_file)
    known = read_outcomes(outcomes_file)

    loaded = load_model(spec_from_json(ModelSpec, plan.model), seed=plan.seed, dtype=plan.dtype)
    backend = resolve_backend(spec_from_json(BackendSpec, plan.backend))
    backend.prepare()
    model = loaded.module
    inputs: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {ROOT: [(root_args, root_kwargs)]}
    timeout_fh = open(plan.timeout_file, "a", encoding="utf-8")  # closed, and the stacks' handler removed, below
    probed = 0
    kept: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}  # failing modules' inputs, for own-code probes

    def prefetch(names: list[str]) -> None:
        need = [n for n in names if n not in known and n not in inputs]
        if need:
            inputs.update(capture_inputs(model, root_args, root_kwargs, need, all_calls=plan.all_calls))

    def probe(name: str) -> ProbeOutcome:
        nonlocal probed
        if name in known:
            return known[name]
        if time.time() >= plan.deadline_wall:
            raise StopSearch()
        if name not in inputs:
            prefetch([name])
        versions = weight_versions(model)
        calls = inputs.pop(name, [])
        seen = [(t, t._version) for t in tensors_in(calls[:1])]
        outcome = probe_one(name, model=model, backend=backend, calls=calls, all_calls=plan.all_calls,
                             timeout=probe_limit(plan, known, name), timeout_fh=timeout_fh, fd2_file=plan.fd2_file)
        if outcome.failed and name != ROOT:  # its parent is not a smallest failing module
            kept.pop(tree.nodes[name].parent or ROOT, None)
        if outcome.status == "fail" and tree.children(name) and calls and versions_unchanged(seen):
            kept[name] = calls[:1]  # an own-code candidate, if it stays smallest: no second capture for it
        if not versions_unchanged(versions):  # the target wrote into the shared weights: the reference's again
            restore_weights(model, load_model(spec_from_json(ModelSpec, plan.model), seed=plan.seed,
                                              dtype=plan.dtype).module)
        append_outcome(outcomes_file, outcome)
        known[name] = outcome
        probed += 1
        return outcome

    with timeout_fh, stacks_on_signal(timeout_fh):  # the parent's watch: where it is stuck
        result = search(tree, probe, prefetch)
        if result.complete and not backend.is_eager:  # eager devices name the running module instead
            firsts, _ = twin_plan(tree, own_code_candidates(tree, result.outcomes), result.outcomes)
            own = [n for n in firsts if own_name(n) not in known]  # a twin takes its first's (mode.py)
            calls = {n: kept[n] for n in own if n in kept}
            if (missing := [n for n in own if n not in calls]) and time.time() < plan.deadline_wall:
                calls.update(capture_inputs(model, root_args, root_kwargs, missing, all_calls=False))
            for name in own:
                if time.time() >= plan.deadline_wall:
                    break
                outcome = probe_one(name, model=model, backend=backend, calls=calls.get(name, []), all_calls=False,
                                     timeout=probe_limit(plan, known, own_name(name)), timeout_fh=timeout_fh,
                                     eager_children=tree.children(name), fd2_file=plan.fd2_file)
                append_outcome(outcomes_file, outcome)
                known[outcome.name] = outcome
    return {"complete": result.complete, "probed": probed}


def _target_copy(sub: torch.nn.Module, backend: Any) -> torch.nn.Module:
    """The module the target gets: a copy, so the CPU reference model stays intact for later captures. On a CPU
    target the copy shares the parameters and buffers (a whole model is not held twice; `versions_unchanged` checks
    afterwards that the target wrote none of them)."""
    import copy

    memo: dict[int, Any] = {}
    if str(backend.device) == "cpu":
        memo = {id(t): t for t in (*sub.parameters(), *sub.buffers())}
    try:
        sub = copy.deepcopy(sub, memo)
    except Exception:  # an uncopyable module: probe it in place (later captures may then see its changes)
        pass
    return backend.to_device(sub)


def weight_versions(model: torch.nn.Module) -> list[tuple[torch.Tensor, int]]:
    return [(t, t._version) for t in (*model.parameters(), *model.buffers())]


def versions_unchanged(versions: Sequence[tuple[torch.Tensor, int]]) -> bool:
    """No parameter or buffer was written in place since `weight_versions` (torch's version counters)."""
    return all(t._version == v for t, v in versions)


def restore_weights(model: torch.nn.Module, fresh: torch.nn.Module) -> None:
    """Every parameter and buffer of `model` (persistent or not) set to `fresh`'s."""
    new = module_tensors(fresh)
    with torch.no_grad():
        for key, t in module_tensors(model).items():
            t.copy_(new[key])


def probe_one(name: str, *, model: torch.nn.Module, backend: Any, calls: list[tuple[tuple[Any, ...], dict[str, Any]]],
               all_calls: bool, timeout: float, timeout_fh: Any, eager_children: Sequence[str] = (),
               fd2_file: str | None = None) -> ProbeOutcome:
    """Compile `name` alone on the backend and run it on its captured inputs. With `eager_children` (qualified
    names of its child modules) those run eagerly (`torch._dynamo.disable`), so only the module's own code is
    compiled: the outcome is then named `own_name(name)`.

    As the ops mode's probes: the compile goes through `Backend.compile_watched` (graphs and nodes the backend
    was given, executions, Dynamo's counters and the backend's own fallbacks, watched around the compile and the
    calls); a module that raised nothing but the backend never ran is `inconclusive`, not `pass`. What the compiler wrote to fd 2 (to `fd2_file`, which
    outlives a crash) and the exception chain are reduced to its own diagnostic lines (`diagnostics`)."""
    import torch._dynamo

    outcome_name = own_name(name) if eager_children else name
    child_journal("enter-module", label(outcome_name))
    faulthandler.dump_traceback_later(timeout, exit=True, file=timeout_fh)
    t0 = time.monotonic()
    tracker: ExecutingTracker | None = None
    tried = 0
    watch = CompileWatch(None if backend.is_eager else backend.spec.compile)  # the compile's record joins it
    err = [""]
    try:
        with capture_fd2(fd2_file) as err, watch:
            if not calls:
                raise RuntimeError(f"{label(name)} did not run in the reference forward: no inputs to replay")
            torch._dynamo.reset()
            sub = _target_copy(model if name == ROOT else model.get_submodule(name), backend)
            for child in eager_children:
                kid = sub.get_submodule(child[len(name) + 1:] if name else child)
                kid.forward = torch._dynamo.disable(kid.forward)  # type: ignore[method-assign]
            fn, _ = backend.compile_watched(sub, join=watch)
            if backend.is_eager:
                tracker = ExecutingTracker(sub, name)
            for args, kwargs in (calls if all_calls else calls[:1]):
                args, kwargs = backend.to_device(args), backend.to_device(kwargs)
                tried += 1
                with torch.no_grad():
                    if tracker is not None:
                        with tracker:
                            out = fn(*args, **kwargs)
                    else:
                        out = fn(*args, **kwargs)
                    _materialize(out)
                del out
        ran = {} if backend.is_eager else watch.ran()
        # an own-code probe breaks the graph at each child it runs eagerly, on purpose
        why = None if backend.is_eager else watch.not_ran("torch.compiler.disable()" if eager_children else "")
        if why:
            outcome = ProbeOutcome(name=outcome_name, status="inconclusive", duration_s=time.monotonic() - t0,
                                   calls_tried=tried, ran=ran,
                                   message=f"{label(outcome_name)} raised nothing but did not run on the backend: "
                                           f"{why}"[:2000])
        else:
            outcome = ProbeOutcome(name=outcome_name, status="pass", duration_s=time.monotonic() - t0,
                                   calls_tried=tried, ran=ran)
    except Exception as exc:  # the backend's error is the finding
        inner = unwrap(exc)
        stage = "compile" if (not backend.is_eager and is_compile_stage(exc)) else "run"
        message = str(inner)[:4000] or type(inner).__name__
        words, _ = compiler_words(err[0], inner, message)
        if words:  # the compiler's own lines after the error's first line (the cause line past boilerplate: rootcause)
            message = (message + "\n" + "\n".join(words))[:6000]
        outcome = ProbeOutcome(name=outcome_name, status="fail", stage=stage, error_type=type(inner).__name__,
                               message=message, traceback=raised_traceback(exc, inner),
                               executing=tracker.failed_in if tracker is not None else None,
                               duration_s=time.monotonic() - t0, calls_tried=tried,
                               ran={} if backend.is_eager else watch.ran(), diagnostics=words)
    finally:
        faulthandler.cancel_dump_traceback_later()
        child_journal("leave-module", label(outcome_name))
    return outcome
