"""Failures: an exception's first line and traceback, probe outcomes, diagnostics of a dead child."""
