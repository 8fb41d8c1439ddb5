"""Run history: one immutable record per run, merged into SQLite when read; trends, flaky/drifting, baseline proposals."""
