"""What this tool knows about IREE's torch.compile backends (`compile: turbine_cpu` or `iree_turbine`, from the
`iree-turbine` package).

Every compile error it raises reads "JIT compilation failed. See diagnostics."; the op it could not lower is named
only in the MLIR diagnostics it writes to file descriptor 2 ("error: failed to legalize operation 'torch.operator'
… <{name = "torch.aten.histc"}>"), which the modes append to the message. That first line is `BOILERPLATE`: root
causes are keyed on the next line, so two ops it cannot lower are two causes. No watch: it does not fall back.
"""

from __future__ import annotations

__all__ = ["NAME", "NAMES", "BOILERPLATE"]

NAME = "turbine_cpu"  # the matrix's `compile:` for this backend
NAMES = ("turbine_cpu", "iree_turbine")  # the same backend under its other registered name
BOILERPLATE = ("JIT compilation failed. See diagnostics.",)  # message lines that say nothing of the cause
