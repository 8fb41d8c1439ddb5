"""Processes: isolated children, the warm pool, generated scripts, the progress watch, rank launches."""
