"""The numerics mode and its library: per-layer divergence of a target against trusted references, and its toolbox.

The numerics mode (`ci_runner/modes/numerics/mode.py`) is a thin layer over these modules; none of them imports a
mode. Method: `docs/numerics.md`.

==================  =================================================================================
module              concern
==================  =================================================================================
`settings`          views, dtypes, Dynamo settings, the cell context the toolbox needs
`metrics`           per-tensor comparison metrics (float64) and severities
`thresholds`        data-derived per-layer thresholds (derive, store, reuse)
`store`             the reference dump: streaming writer and lazy reader (`index.json` + chunks); `ChunkFiles`,
                    the one chunk-file reader (also under `dumps.Dump`)
`capture`           the numerics hooks: record a reference pass, compare calls as they return, compiled capture
`views`             the isolated view (a module fed the reference's inputs) and the cumulative view
`target`            the target child: plan, both views against the dumps, its records
`verdict`           layers, verdict, findings and the result table from the records
`repro`             a verified standalone script per divergence finding (the layer, eager against compiled)
`dumps`             the offline dump format (`deepview-ci dump`) and `compare`
`toolbox`           the toolbox's options and its hooks into the mode (weights, batch, bisect, reference dumps)
`weights`           weights round-trip check
`batch_invariance`  batch-invariance experiment
`bisect`            compiler-pass / graph-node bisect of a divergent layer
==================  =================================================================================
"""
