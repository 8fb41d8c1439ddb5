"""One probe per (backend, op signature) per run: inventories merged across models, and a per-backend probe store.

`merge_inventories` folds several models' inventories into their distinct signatures, each with every (model,
call site) that uses it. `probe_signatures` probes the signatures a backend's store lacks and returns an outcome
for every one of them; the ops mode of every cell and the zoo scan call it with the same store folder.

The store is a folder per backend (`<out>/probes/<backend-id>/<identity>/`); `<identity>` hashes what decides an
outcome besides the signature (the backend spec, torch and backend versions, tolerances, compare, via), so a
changed backend never reads another's outcomes. Per signature, `<hash>.json` is the outcome (written atomically)
and `<hash>.claim` the claim: a cell holds an exclusive `flock` on it while it probes the signature. Several cells
of one backend running at once (`--jobs`) therefore probe each signature once: a cell probes what it could claim,
then waits for the outcomes of signatures another cell claimed, and takes over a claim whose holder died (the
kernel drops a dead process's locks). Outcomes that say nothing about the backend (`not_run`: time ran out, the
probe process could not start; a probe whose synthetic inputs CPU eager rejects too) are never stored or reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Mapping, Sequence

from ...config import BackendSpec, spec_to_json
from ...fsutil import atomic_write_text, try_lock
from ...options import OpsOptions
from .outcome import OpOutcome
from .inputs import probe_seed, with_ranges
from .probe import ProbeRunner, float_dtype, grouped, not_run_outcome
from .signature import CallSite, Inventory, OpSignature

STORE_VERSION = 1
_CLAIM_CHUNK = 256  # signatures claimed (locks held) at a time, at least: bounded open files whatever the zoo's size
_MAX_CLAIM_CHUNK = 4096  # at most (`claim_chunk`)
_WAIT_POLL_S = 0.5
MAX_SITES = 8  # call sites a merged signature keeps (as `inventory.MAX_SITES`; `Merged.uses` keeps every one)


# --------------------------------------------------------------------------------------------- merged inventories

@dataclass(frozen=True, kw_only=True)
class Merged:
    """Distinct signatures over several models, and who uses each (`uses[key]`: (model id, call site) pairs)."""

    signatures: list[OpSignature]
    uses: dict[str, list[tuple[str, CallSite]]]
    models: dict[str, list[str]]  # key -> the model ids calling it, in first-seen order
    pairs: int  # (model, signature) pairs before deduplication

    @property
    def factor(self) -> float:
        """The deduplication factor: (model, signature) pairs per distinct signature."""
        return self.pairs / len(self.signatures) if self.signatures else 1.0


def merge_inventories(invs: Mapping[str, Inventory]) -> Merged:
    """The models' signatures deduplicated by key (first-seen order; call counts summed, sites of every model)."""
    merged: dict[str, OpSignature] = {}
    uses: dict[str, list[tuple[str, CallSite]]] = {}
    models: dict[str, list[str]] = {}
    pairs = 0
    for model_id, inv in invs.items():
        for sig in inv.signatures:
            pairs += 1
            base = merged.get(sig.key)
            if base is None:
                base = merged[sig.key] = OpSignature(op=sig.op, args=sig.args, kwargs=sig.kwargs, key=sig.key,
                                                     order=len(merged), outputs=sig.outputs, imports=sig.imports)
            base.count += sig.count
            base.site_count += sig.site_count
            base.sites.extend(s for s in sig.sites if s not in base.sites and len(base.sites) < MAX_SITES)
            models.setdefault(sig.key, [])
            if model_id not in models[sig.key]:
                models[sig.key].append(model_id)
            uses.setdefault(sig.key, []).extend((model_id, s) for s in sig.sites)
    return Merged(signatures=list(merged.values()), uses=uses, models=models, pairs=pairs)


# --------------------------------------------------------------------------------------------- the store

def store_identity(spec: BackendSpec, opts: OpsOptions, versions: Mapping[str, Any] | None = None,
                   precision: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What decides a probe's outcome besides its signature (`precision`: the cell's policy classes below
    float32, only when there are any, so a float32 policy keeps the identity stores always had)."""
    import torch  # deferred: the store's file logic needs no torch

    extra = {"precision": dict(precision)} if precision else {}
    return {**extra, "store_version": STORE_VERSION, "backend": spec_to_json(spec), "torch": torch.__version__,
            "versions": {str(k): str(v) for k, v in sorted(dict(versions or {}).items())},
            "compare": opts.compare, "via": opts.via, "probe_timeout": opts.probe_timeout,
            "grouped": grouped(opts, spec), "tolerance": {k: list(v) for k, v in sorted(opts.tolerance.items())}}


def _digest(text: str, n: int = 20) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:n]


@dataclass
class ProbeStore:
    """Outcomes and claims of one backend identity (see the module docstring)."""

    root: Path  # <out>/probes/<backend-id>
    identity: Mapping[str, Any]
    _held: dict[str, IO[bytes]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        text = json.dumps(self.identity, sort_keys=True, default=str)
        self.dir = self.root / _digest(text, 12)
        self.dir.mkdir(parents=True, exist_ok=True)
        ident = self.dir / "identity.json"
        if not ident.exists():
            atomic_write_text(ident, json.dumps(self.identity, indent=2, sort_keys=True, default=str) + "\n")

    def name(self, key: str) -> str:
        return _digest(key)

    def get(self, key: str) -> OpOutcome | None:
        """The stored outcome of signature `key` (None: not probed yet, or a torn file)."""
        try:
            row = json.loads((self.dir / f"{self.name(key)}.json").read_text(encoding="utf-8"))
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        got = row.get("outcome") if row.get("key") == key else None
        try:
            out = OpOutcome.from_row(got) if isinstance(got, dict) else None
        except (TypeError, ValueError):  # a status this version does not know: probe it again
            return None
        return out if out is not None and out.storable else None  # an earlier version's invalid inputs: again

    def put(self, key: str, outcome: OpOutcome) -> None:
        """Store an outcome (atomically; its wire row without the batch's probe id) and drop the claim on it."""
        body = {"key": key, "outcome": {k: v for k, v in outcome.to_row().items() if k != "id"}}
        # not fsynced (one file per signature, thousands): an OS crash may leave an empty file, which `get` reads
        # as not probed yet
        atomic_write_text(self.dir / f"{self.name(key)}.json", json.dumps(body, default=str) + "\n", sync=False)
        self.release(key)

    def claim(self, key: str) -> bool:
        """An exclusive claim on probing `key`, held until `put` or `release` (False: another live process has it)."""
        if key in self._held:
            return True
        fh = try_lock(self.dir / f"{self.name(key)}.claim")
        if fh is None:
            return False
        fh.write(f"{os.getpid()}\n".encode())
        fh.flush()
        self._held[key] = fh
        return True

    def release(self, key: str) -> None:
        fh = self._held.pop(key, None)
        if fh is not None:
            fh.close()  # closing drops the flock

    def release_all(self) -> None:
        for key in list(self._held):
            self.release(key)


# --------------------------------------------------------------------------------------------- probing through it

Prober = Callable[[Sequence[OpSignature]], dict[str, OpOutcome]]


def claim_chunk(opts: OpsOptions) -> int:
    """Signatures claimed and handed to the prober at once: a full batch for each worker (every chunk starts new
    probing children), within a quarter of the open-file limit (a claim holds its file open)."""
    try:
        import resource

        files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        unlimited = files == resource.RLIM_INFINITY
    except (ImportError, ValueError, OSError):  # pragma: no cover - no resource module (Windows)
        files, unlimited = 1024, False
    limit = _MAX_CLAIM_CHUNK if unlimited else max(64, files // 4)
    return max(1, min(max(_CLAIM_CHUNK, opts.workers * opts.batch_size), _MAX_CLAIM_CHUNK, limit))


def probe_through(store: ProbeStore, signatures: Sequence[OpSignature], prober: Prober, *,
                  remaining: Callable[[], float], stats: dict[str, Any] | None = None,
                  chunk: int = _CLAIM_CHUNK) -> dict[str, OpOutcome]:
    """Every signature's outcome: stored ones read back, claimed ones probed by `prober` (key -> outcome, `chunk`
    at a time) and stored, the ones another process is probing waited for (or taken over when their holder dies)."""
    stats = stats if stats is not None else {}
    stats.update(reused=0, probed=0, waited=0)
    out: dict[str, OpOutcome] = {}
    todo: list[OpSignature] = []
    for sig in _unique(signatures):
        got = store.get(sig.key)
        if got is not None:
            out[sig.key] = got
            stats["reused"] += 1
        else:
            todo.append(sig)
    try:
        while todo:
            others = _probe_claimed(store, todo, prober, out, stats, chunk)
            todo = _wait_for(store, others, out, stats, remaining)
            if todo and remaining() <= 1.0:
                break
    finally:
        store.release_all()
    return out


def _unique(signatures: Sequence[OpSignature]) -> Iterator[OpSignature]:
    seen: set[str] = set()
    for sig in signatures:
        if sig.key not in seen:
            seen.add(sig.key)
            yield sig


def _probe_claimed(store: ProbeStore, todo: list[OpSignature], prober: Prober, out: dict[str, OpOutcome],
                   stats: dict[str, Any], chunk: int) -> list[OpSignature]:
    """Claim and probe `todo` in chunks; the signatures other processes hold."""
    others: list[OpSignature] = []
    for start in range(0, len(todo), chunk):
        mine = []
        for sig in todo[start:start + chunk]:
            got = store.get(sig.key)
            if got is not None:
                out[sig.key] = got
                stats["reused"] += 1
            elif store.claim(sig.key):
                got = store.get(sig.key)  # finished between our look and our claim
                if got is not None:
                    store.release(sig.key)
                    out[sig.key] = got
                    stats["reused"] += 1
                else:
                    mine.append(sig)
            else:
                others.append(sig)
        if not mine:
            continue
        results = prober(mine)
        for sig in mine:
            o = results.get(sig.key)
            if o is None:
                store.release(sig.key)
                continue
            out[sig.key] = o
            if o.storable:
                store.put(sig.key, o)
                stats["probed"] += 1
            else:
                store.release(sig.key)
    return others


def _wait_for(store: ProbeStore, others: list[OpSignature], out: dict[str, OpOutcome], stats: dict[str, Any],
              remaining: Callable[[], float]) -> list[OpSignature]:
    """Wait for the outcomes other processes are probing; return those whose holder let go without one."""
    pending = list(others)
    while pending:
        left, free = [], []
        for sig in pending:
            got = store.get(sig.key)
            if got is not None:
                out[sig.key] = got
                stats["waited"] += 1
            elif store.claim(sig.key):  # the holder died or gave up: ours now
                store.release(sig.key)
                free.append(sig)
            else:
                left.append(sig)
        if free:
            return free + left
        pending = left
        if pending:
            if remaining() <= 1.0:
                return []
            time.sleep(_WAIT_POLL_S)
    return []


def probe_spec(sig: OpSignature, opts: OpsOptions, probe_id: str,
               precision: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The probe of one signature: synthetic-input ranges, seed and tolerance, as the child runs it; with
    `precision` (the policy's classes below float32) the child widens the tolerance by the op's emulated spread
    (`probe.policy_tolerance`)."""
    args, kwargs = with_ranges(sig.op, sig.args, sig.kwargs)
    extra = {"precision": dict(precision)} if precision else {}
    return {"id": probe_id, "op": sig.op, "key": sig.key, "args": args, "kwargs": kwargs, "outputs": sig.outputs,
            "imports": list(sig.imports), "seed": probe_seed(sig.key),
            "tolerance": list(opts.tolerance_for(float_dtype(args, kwargs))), **extra}


def probe_signatures(spec: BackendSpec, signatures: Sequence[OpSignature], *, store_dir: Path, opts: OpsOptions,
                     remaining: Callable[[], float] = lambda: float("inf"),
                     journal: Callable[[str, str], None] | None = None, work_dir: Path | None = None,
                     versions: Mapping[str, Any] | None = None,
                     stats: dict[str, Any] | None = None,
                     precision: Mapping[str, str] | None = None) -> dict[str, OpOutcome]:
    """Signature key -> outcome for every signature, probing (in isolated children, `ProbeRunner`) only what the
    backend's store at `store_dir` (`<out>/probes/<backend-id>`) lacks. A signature left without an outcome (time
    ran out) gets a `not_run` one. `stats` (when given) receives reused / probed / waited counts and the
    probe runner's `setup_error`."""
    store = ProbeStore(store_dir, store_identity(spec, opts, versions, precision))
    stats = stats if stats is not None else {}
    work = work_dir or store.dir / f"work-{os.getpid()}"
    runner = ProbeRunner(backend_spec=spec, work_dir=work, opts=opts, remaining=remaining, journal=journal)

    def prober(sigs: Sequence[OpSignature]) -> dict[str, OpOutcome]:
        probes = [probe_spec(s, opts, f"s{i:05d}", precision) for i, s in enumerate(sigs)]
        got = runner.run(probes)
        return {p["key"]: got.get(p["id"]) or not_run_outcome(p, "no outcome recorded") for p in probes}

    try:
        out = probe_through(store, signatures, prober, remaining=remaining, stats=stats, chunk=claim_chunk(opts))
    finally:
        if work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    stats["setup_error"] = runner.setup_error
    for i, sig in enumerate(signatures):
        if sig.key not in out:
            out[sig.key] = not_run_outcome(probe_spec(sig, opts, f"s{i:05d}", precision), "the cell's time ran out while "
                                           "another process was probing this signature")
    return out
