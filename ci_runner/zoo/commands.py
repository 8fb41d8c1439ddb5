"""`deepview-ci zoo inventory|merge|probe|cells`: the zoo's phases as commands, one job each on GitHub.

Each command picks the matrix's zoo cells as `expand` does (`--select/--skip`, or `--plan PLAN.json`: exactly the
zoo cells that plan runs) and calls one phase of `zoo/run.py`, which `deepview-ci run` calls too.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from .. import errors
from ..backends.check import check_backends, load_checked
from ..config import Cell
from ..errors import ConfigError
from ..log import Progress
from ..matrix import expand, select
from ..plan import load_plan
from .run import backend_cells, backend_group, inventory_shard, merge_shards, probe_shard
from .shards import parse_shard


def zoo_cells(matrix_path: str, args: argparse.Namespace) -> tuple[Path, list[Cell]]:
    """(the matrix's path, its zoo cells after --select/--skip and, with --plan, only those the plan runs). With
    `--backend` (probe, cells) that backend is checked first, as `run` checks its backends (backends/check.py)."""
    backend = getattr(args, "backend", None)
    matrix = load_checked(matrix_path, check=backend is not None)
    if backend is not None:
        check_backends(matrix, [matrix.backend(backend).id])
    cells = [c for c in select(expand(matrix), args.select, args.skip) if c.model.zoo]
    if args.plan:
        planned = {p.cell for p in load_plan(Path(args.plan)) if p.job and p.skip_reason is None}
        cells = [c for c in cells if c.id in planned]
    if not cells:
        raise ConfigError(f"{matrix.path}: no zoo cell to run" + (" in the plan" if args.plan else ""),
                          hint="a zoo entry is `models: [{id: zoo, zoo: transformers, select: [...]}]`; list the "
                               "cells with `deepview-ci cells MATRIX`")
    return matrix.path, cells


def cmd_inventory(args: argparse.Namespace) -> int:
    _path, cells = zoo_cells(args.matrix, args)
    shard = parse_shard(args.shard)
    scanned = inventory_shard(cells, out_dir=Path(args.out), shard=shard, jobs=max(1, args.jobs),
                              per_model_timeout=args.per_model_timeout, force=args.force, progress=Progress(0))
    print(f"zoo inventory shard {shard}: " + ", ".join(f"{g}: {n} scanned" for g, n in scanned.items()))
    return errors.EXIT_OK


def cmd_merge(args: argparse.Namespace) -> int:
    _path, cells = zoo_cells(args.matrix, args)
    merged = merge_shards(cells, [Path(d) for d in args.dirs], Path(args.out))
    for backend, m in merged.items():
        print(f"zoo merge, {backend}: {m['scanned']} of {m['architectures']} architecture(s) scanned; {m['pairs']} "
              f"(model, signature) pair(s) → {m['distinct']} distinct, {m['probed']} to probe")
    return errors.EXIT_OK


def _budget(args: argparse.Namespace) -> float | None:
    """--budget-minutes as the child's seconds, 2 minutes kept back for writing what it found."""
    return max(60.0, args.budget_minutes * 60.0 - 120.0) if args.budget_minutes else None


def cmd_probe(args: argparse.Namespace) -> int:
    path, cells = zoo_cells(args.matrix, args)
    shard = parse_shard(args.shard)
    note = probe_shard(cells, backend_id=args.backend, shard=shard, matrix_path=path, out_dir=Path(args.out),
                       progress=Progress(0), budget_s=_budget(args))
    print(f"zoo probes on {args.backend}, shard {shard}: {note.get('signatures', 0)} signature(s), "
          f"{note.get('probed', 0)} probed, {note.get('reused', 0)} already in the store")
    return errors.EXIT_OK


def cmd_cells(args: argparse.Namespace) -> int:
    path, cells = zoo_cells(args.matrix, args)
    results = backend_cells(backend_group(cells, args.backend), matrix_path=path, out_dir=Path(args.out),
                            progress=Progress(0), budget_s=_budget(args))
    bad = [r for r in results if r.status not in ("pass", "skipped")]
    print(f"zoo cells on {args.backend}: {len(results)} architecture(s), {len(bad)} not passing")
    return errors.EXIT_FINDINGS if bad else errors.EXIT_OK


def _missing(args: argparse.Namespace) -> int:
    raise errors.UsageError("zoo: missing subcommand", hint="use `deepview-ci zoo inventory|merge|probe|cells` "
                            "(see `deepview-ci zoo --help`)")


def register(add: Callable[..., argparse.ArgumentParser], parser_class: type,
             selection: Callable[[argparse.ArgumentParser], None]) -> None:
    """The `zoo` command and its four phases."""
    sp = add("zoo", _missing, "The transformers zoo in phases (GitHub jobs): inventory shards, merge, probe shards, "
             "cells.")
    zs = sp.add_subparsers(dest="zoo_command", metavar="SUBCOMMAND", parser_class=parser_class)

    def phase(name: str, handler: Callable[[argparse.Namespace], int], text: str, *,
              matrix: bool = True) -> argparse.ArgumentParser:
        p = zs.add_parser(name, help=text, description=text)
        p.set_defaults(handler=handler)
        if matrix:
            p.add_argument("matrix", help="matrix YAML file")
        selection(p)
        p.add_argument("--plan", default=None, metavar="PLAN_JSON",
                       help="only the zoo cells this plan runs (what `expand --out` wrote)")
        return p

    p = phase("inventory", cmd_inventory, "Scan one shard of the zoo's architectures (on meta; any runner).")
    p.add_argument("--shard", default="1/1", metavar="I/N", help="this shard of N (default 1/1: all)")
    p.add_argument("--out", required=True, metavar="DIR", help="run folder: DIR/zoo/inventory/…")
    p.add_argument("--jobs", type=int, default=1, help="scan children at once (default 1)")
    p.add_argument("--per-model-timeout", type=float, default=180.0, metavar="S",
                   help="seconds one architecture may take (default 180)")
    p.add_argument("--force", action="store_true", help="scan again the architectures that already have a record")

    p = phase("merge", cmd_merge, "Check the inventory shards and write each backend's distinct signatures.",
              matrix=False)
    p.add_argument("dirs", nargs="+", metavar="DIR", help="the shards' run folders, or folders holding them")
    p.add_argument("--matrix", required=True, help="matrix YAML file")
    p.add_argument("--out", required=True, metavar="DIR", help="run folder for the merged records and lists")

    for name, handler, text in (
            ("probe", cmd_probe, "Probe one shard of a backend's merged signatures into its probe store."),
            ("cells", cmd_cells, "Write every architecture's cell on a backend (probing what the shards left).")):
        p = phase(name, handler, text)
        p.add_argument("--backend", required=True, metavar="ID", help="the backend's id in the matrix")
        if name == "probe":
            p.add_argument("--shard", default="1/1", metavar="I/N", help="this shard of N (default 1/1: all)")
        p.add_argument("--out", required=True, metavar="DIR", help="run folder holding the merge (and the store)")
        p.add_argument("--budget-minutes", type=float, default=None, metavar="MIN",
                       help="the step's time limit (default: the cells' timeouts); the child stops 2 minutes before")
