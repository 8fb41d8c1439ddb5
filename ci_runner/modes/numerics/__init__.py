"""The numerics mode: per-layer divergence against data-derived thresholds. `mode` is the run; the method lives in `ci_runner/numerics/`."""
