"""Mode `compile`: graphs, graph breaks, recompiles, compile seconds and eager fallbacks per phase (docs/compile.md)."""
