"""The workloads a cell runs: spelled once, resolved once into the cell, and run in one place.

Everything a matrix says about *how* a cell is run, beside which model and which backend, lives in this package.
The spellings import no torch (`config.py` validates each at load with the checks here, and `matrix.expand`
resolves each into a typed field of the cell; the modes read the typed fields, never the raw YAML):

- `phases.py`: `inputs.phases` (prefill, decode, padded batches, long prompts);
- `parallel.py`: `parallel` (a tensor-parallel layout) and a backend's `process_group`; `layout_of`, the typed layout a
  rank reads from its payload;
- `precision.py`: a backend's `precision` policy (the dtypes it computes each op class in).

Where they act (torch):

- `calls.py`: the calls of each phase, as users make them (`phase_calls`, `run_phase`; every mode's per-phase body
  runs them through `ModeContext.each_phase`);
- `tpplan.py` and `collectives.py`: the sharded model a rank builds, and the collectives a sharded graph hands the
  backend, each probed alone;
- `emulate.py` and `rounding.py`: the precision policy's emulation on the CPU and its detection on a backend.
"""
