"""sim-abort, sim-segv and sim-hang: compile fine, then kill or stall the process when the chosen op runs.

Each runs in its own child process (they take the process down by design).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from tests.fixtures.paths import ROOT

pytestmark = pytest.mark.subprocess  # each fault takes its own child process down

SCRIPT = """
import sys, torch
from ci_runner.sim import make_backend
def attention(q):
    return (torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True),)
q = torch.randn(1, 2, 8, 16)
compiled = make_backend(sys.argv[1])(torch.fx.symbolic_trace(attention), [q])
print("compiled", flush=True)
x = torch.randn(3, 3)
make_backend(sys.argv[1])(torch.fx.symbolic_trace(lambda x: ((x @ x).relu(),)), [x])(x)  # no attention: runs
print("other graph ran", flush=True)
compiled(q)
print("unreachable", flush=True)
"""


def _spawn(name: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", SCRIPT, name], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def children():
    """All three children start together (they mostly wait on imports), each test then reads its own."""
    procs = {name: _spawn(name) for name in ("sim-abort", "sim-segv", "sim-hang")}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


@pytest.mark.parametrize(("name", "sig", "stderr_text"), [
    ("sim-abort", signal.SIGABRT, "what():  [sim-abort] device runtime lost while executing "
                                  "aten._scaled_dot_product_flash_attention_for_cpu.default"),
    ("sim-segv", signal.SIGSEGV, "[sim-segv] reading address 0x0 while executing "
                                 "aten._scaled_dot_product_flash_attention_for_cpu.default"),
])
def test_hard_crash_at_run_time(children, name: str, sig: signal.Signals, stderr_text: str) -> None:
    proc = children[name]
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -sig, (proc.returncode, err[-2000:])
    assert out.splitlines() == ["compiled", "other graph ran"]
    assert stderr_text in err


def test_hang_at_run_time(children) -> None:
    proc = children["sim-hang"]
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline:  # stderr announces the hang when the op runs
            line = proc.stderr.readline() if proc.stderr else ""
            if "[sim-hang]" in line or not line:
                break
        assert "[sim-hang] waiting for a device fence that never signals" in line
        time.sleep(2.0)
        assert proc.poll() is None  # still stuck
    finally:
        proc.kill()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert out.splitlines() == ["compiled", "other graph ran"]
