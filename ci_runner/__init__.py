"""deepview-ci: models × accelerator backends as CI (missing operators, failing layers, numerical divergence)."""

__version__ = "0.1.0"
