"""The probe store across processes (`modes/ops/store.py`): two cells probing at once probe each signature once, a
claim whose holder died is taken over (the store in this process: `tests/unit/test_ops_store.py`)."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any, Sequence

import pytest

from ci_runner.modes.ops.signature import CallSite, OpSignature, signature_key
from ci_runner.modes.ops.store import ProbeStore, probe_through

pytestmark = pytest.mark.subprocess  # forked cells race for the store's claims

IDENTITY = {"backend": "test"}


def _sig(op: str, n: int) -> OpSignature:
    args = [{"__tensor__": {"shape": [n], "stride": [1], "dtype": "float32"}}]
    return OpSignature(op=op, args=args, kwargs={}, key=signature_key(op, args, {}), count=1, site_count=1,
                       sites=[CallSite(module="m", module_class="Linear", source="m.py:1")])


def _worker(root: str, keys: Sequence[str], log: str, start: float) -> None:
    """One cell: probes what it claims (logging each probe), waits for the rest."""
    while time.time() < start:
        time.sleep(0.005)
    sigs = [_sig(k, 1) for k in keys]

    def prober(batch: Sequence[OpSignature]) -> dict[str, dict[str, Any]]:
        out = {}
        for s in batch:
            with open(log, "a") as fh:
                fh.write(f"{os.getpid()} {s.op}\n")
            time.sleep(0.02)
            out[s.key] = {"status": "pass", "op": s.op}
        return out

    got = probe_through(ProbeStore(Path(root), IDENTITY), sigs, prober, remaining=lambda: 60.0)
    assert sorted(o["op"] for o in got.values()) == sorted(keys)


def test_two_processes_probe_each_signature_once(tmp_path: Path) -> None:
    keys = [f"aten.op{i}.default" for i in range(40)]
    log = tmp_path / "probed.log"
    ctx = multiprocessing.get_context("fork")
    start = time.time() + 0.3
    procs = [ctx.Process(target=_worker, args=(str(tmp_path / "store"), order, str(log), start))
             for order in (keys[:30], keys[10:][::-1])]  # 20 shared signatures
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    probed = [line.split() for line in log.read_text().splitlines()]
    assert sorted(op for _, op in probed) == sorted(keys)  # each once
    assert len({pid for pid, _ in probed}) == 2  # each probed its own signatures at least


def _claim_and_die(root: str, key: str) -> None:
    store = ProbeStore(Path(root), IDENTITY)
    assert store.claim(key)
    os._exit(0)  # dies holding the claim, with no outcome


def test_a_claim_whose_holder_died_is_taken_over(tmp_path: Path) -> None:
    sig = _sig("aten.exp.default", 3)
    store = ProbeStore(tmp_path / "store", IDENTITY)
    held = ProbeStore(tmp_path / "store", IDENTITY)
    assert held.claim(sig.key) and not _other_process_can_claim(tmp_path / "store", sig.key)
    held.release(sig.key)
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_claim_and_die, args=(str(tmp_path / "store"), sig.key))
    p.start()
    p.join(30)
    got = probe_through(store, [sig], lambda b: {s.key: {"status": "error", "op": s.op} for s in b},
                        remaining=lambda: 10.0)
    assert got[sig.key]["status"] == "error" and store.get(sig.key) == {"status": "error", "op": sig.op}
    again = probe_through(ProbeStore(tmp_path / "store", IDENTITY), [sig], lambda b: {}, remaining=lambda: 10.0,
                          stats=(stats := {}))
    assert again[sig.key]["status"] == "error" and stats["reused"] == 1
    other = ProbeStore(tmp_path / "store", {"backend": "another build"})
    assert other.get(sig.key) is None  # another backend identity never reads these outcomes


def _other_process_can_claim(root: Path, key: str) -> bool:
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=lambda: q.put(ProbeStore(root, IDENTITY).claim(key)))
    p.start()
    p.join(30)
    return bool(q.get(timeout=5))
