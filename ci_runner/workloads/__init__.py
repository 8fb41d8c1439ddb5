"""The workloads a cell runs, spelled once and resolved once (no torch here).

Everything a matrix says about *how* a cell is run, beside which model and which backend, lives in this package:

- `phases.py`: `inputs.phases` (prefill, decode, padded batches, long prompts);
- `parallel.py`: `parallel` (a tensor-parallel layout) and a backend's `process_group`;
- `precision.py`: a backend's `precision` policy (the dtypes it computes each op class in).

`config.py` validates each spelling at load with the checks here, and `matrix.expand` resolves each into a typed
field of the cell; the modes read the typed fields, never the raw YAML.
"""
