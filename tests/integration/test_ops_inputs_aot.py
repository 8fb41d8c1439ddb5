"""The whole-zoo aot_eager probe errors (random inputs broke masked_scatter / index_put / embedding_bag contracts)
probed again on aot_eager, in probing children, grouped as the zoo does: each passes and is compared."""

from __future__ import annotations

from pathlib import Path

import pytest

from ci_runner.config import BackendSpec
from ci_runner.modes.ops.outcome import OpStatus
from ci_runner.modes.ops.signature import OpSignature, signature_key
from ci_runner.modes.ops.store import probe_signatures
from ci_runner.registry import parse_options
from tests.unit.test_ops_inputs import ZOO_PROBE_ERRORS


@pytest.mark.slow
def test_the_zoo_probe_errors_pass_on_aot_eager(tmp_path: Path) -> None:
    sigs = [OpSignature(op=op, args=args, kwargs={}, key=signature_key(op, args, {}),
                        outputs=[0] if "embedding_bag" in op else None) for op, args in ZOO_PROBE_ERRORS]
    got = probe_signatures(BackendSpec(id="aot_eager", compile="aot_eager"), sigs, store_dir=tmp_path / "store",
                           opts=parse_options("ops", {}), work_dir=tmp_path / "work")
    assert {(got[s.key].status, got[s.key].compare) for s in sigs} == {(OpStatus.PASS, "ok")}, \
        {s.op: got[s.key].message[:200] for s in sigs if got[s.key].status is not OpStatus.PASS}
