"""`deepview-ci init`: the commented starter matrix, and `./deepview.yaml` as the matrix `run` and `cells` use when
given none (issue 48: a newcomer should not copy the README's matrix by hand)."""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

from .errors import ConfigError
from .fsutil import atomic_write_text

LOCAL_MATRIX = "deepview.yaml"  # what `deepview-ci init` writes, and what `run` and `cells` use when given no MATRIX


def local_matrix(cwd: str | os.PathLike[str] | None = None) -> Path | None:
    """`./deepview.yaml` (in `cwd`) when it is a file: the matrix `run` and `cells` use with no MATRIX argument
    (else the bundled example)."""
    p = Path(cwd or ".") / LOCAL_MATRIX
    return p if p.is_file() else None


def starter_matrix() -> str:
    """The commented starter matrix `deepview-ci init` writes (`data/starter.yaml`: the README's matrix, with the
    phases, tensor parallelism, a factory model and a plugin backend shown commented out)."""
    return (files("ci_runner") / "data" / "starter.yaml").read_text(encoding="utf-8")


def write_starter(path: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Write the starter matrix to `path` atomically; an existing file is kept (`ConfigError`) unless `force`."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{p}: is a folder", hint="give the path of the matrix file to write, e.g. deepview.yaml")
    if p.exists() and not force:
        raise ConfigError(f"{p}: already exists; not overwritten",
                          hint="keep it, write elsewhere (`deepview-ci init PATH`), or replace it with --force")
    return atomic_write_text(p, starter_matrix())
