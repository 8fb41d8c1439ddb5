"""Whether the layers mode's limits fit the cell's timeout (`ModeSpec.fit`, said at the cell's start; issue 44)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...options import LayersOptions
from ...registry import parse_options

if TYPE_CHECKING:
    from ...config import Cell


def fit(cell: "Cell") -> str | None:
    """A note when the cell's timeout is shorter than one probing child may need to start and probe the whole model
    up to probe_timeout: the probes would be cut short by the cell's time, and no hang could be measured."""
    opts: LayersOptions = parse_options("layers", cell.options.get("layers", {}))
    need = opts.startup_timeout + opts.probe_timeout
    if cell.timeout >= need:
        return None
    return (f"layers: the cell's timeout ({cell.timeout:g} s) is shorter than the first probe may need "
            f"(startup_timeout {opts.startup_timeout:g} s + probe_timeout {opts.probe_timeout:g} s): a slow compile will "
            f"be cut short by the cell's time, not measured; raise `timeout` or lower the layers limits")
