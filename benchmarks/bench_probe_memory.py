"""Peak memory of probing one big op signature, in this process: `aten.embedding(f32[ROWS, COLS], i64[1, 16])`.

A probe builds its inputs (`make_tensor`), runs the op on CPU eager (the reference) and on the backend
(`probe.run_probe`, as a probing child does). Before issue 21, `make_tensor` drew one float64 buffer of the
weight's whole element count (twice the float32 weight) and the reference always ran on a copy of the inputs; now
it draws 4 Mi elements at a time and copies only for an op that writes its inputs (`probe.reference_inputs`). Run
it once per checkout under `/usr/bin/time -v` and compare "Maximum resident set size" (this script also prints its
own peak RSS, after torch's import, and the draw's):

    nice -n 10 /usr/bin/time -v env PYTHONPATH=/path/to/checkout python benchmarks/bench_probe_memory.py 262144 2048

With 262144 x 2048 (2 GiB of weight), measured on 2 loaded cores: 6.31 GiB peak before (weight + the 4 GiB draw
buffer), 4.36 GiB with chunked draws alone (weight + the reference's copy), 2.36 GiB now (the weight once).
"""

from __future__ import annotations

import argparse
import resource
import time


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", type=int, nargs="?", default=262144)
    ap.add_argument("cols", type=int, nargs="?", default=2048)
    ap.add_argument("--backend", default="aot_eager")
    args = ap.parse_args()

    import torch  # noqa: F401 - counted in the baseline

    from ci_runner.backends import resolve_backend
    from ci_runner.config import BackendSpec
    from ci_runner.modes.ops.inputs import build_tensors, with_ranges
    from ci_runner.modes.ops.probe import run_probe

    backend = resolve_backend(BackendSpec(id=args.backend, compile=args.backend))
    backend.prepare()
    base = _rss_gib()
    weight = {"__tensor__": {"dtype": "float32", "shape": [args.rows, args.cols], "stride": [args.cols, 1]}}
    ids = {"__tensor__": {"dtype": "int64", "shape": [1, 16], "stride": [16, 1]}}
    a, k = with_ranges("aten.embedding.default", [weight, ids], {})
    t0 = time.monotonic()
    built = build_tensors(a, k, 1)
    draw_s = time.monotonic() - t0
    draw_peak = _rss_gib()
    del built
    probe = {"id": "p0", "op": "aten.embedding.default", "args": a, "kwargs": k, "seed": 1, "tolerance": [1e-4, 1e-5]}
    t0 = time.monotonic()
    out = run_probe(backend, probe, compare_results=True, tolerance=(1e-4, 1e-5))
    print(f"weight {args.rows * args.cols * 4 / 2**30:.2f} GiB; probe {out['status']} (compare {out.get('compare')}) "
          f"in {time.monotonic() - t0:.1f}s; drawing the inputs alone {draw_s:.1f}s")
    print(f"peak RSS: after imports {base:.2f} GiB, after drawing {draw_peak:.2f} GiB, after the probe "
          f"{_rss_gib():.2f} GiB")


if __name__ == "__main__":
    main()
