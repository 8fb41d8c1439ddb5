"""The layers mode: the smallest failing submodule. `search` (top-down walk, isolated), `culprit` + `culprit_search` (the op inside it), `mode` (the run)."""
