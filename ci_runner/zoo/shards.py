"""The zoo in shards: which architectures an inventory shard scans, which signatures a probe shard probes, how
many shards a plan makes, and the check that a merge has every inventory shard of one split.

A shard is `I/N` (1-based, as a user types it). `split(items, shard)` is round-robin over the items in the
order given (callers pass them sorted), so the N slices are a partition and stay the same from run to run.
An inventory shard leaves a manifest (`manifest(...)`, `<dir>/zoo/inventory/shards/I-of-N.json`) naming its
slice of every (IR level, host device) group and a digest of the whole selection; `check_manifests` accepts a
set of them only when they are the N shards of one split of one selection, else one `InputError` that names
the file or the missing shard and says what to run.

Plan sizes (`zoo_plan_sizes`) keep every job matrix at or under GitHub's 256 jobs (docs/github.md, Limits).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

from ..errors import ConfigError, InputError

T = TypeVar("T")

MATRIX_LIMIT = 256  # GitHub: jobs per matrix
ARCHS_PER_INVENTORY_SHARD = 25  # about 5 CPU s per architecture on meta (docs/zoo.md): ~2-3 min a job
SIGNATURES_PER_ARCH = 40  # the plan's estimate before any scan (measured: 24,281 pairs / 190 scanned, ÷2.6 distinct)
SIGNATURES_PER_PROBE_SHARD = 800  # distinct signatures a probe job takes on (group testing: a few compiles per 100)
MANIFEST_VERSION = 1
_SHARD = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True, kw_only=True)
class Shard:
    """Shard `index` of `count` (1-based)."""

    index: int = 1
    count: int = 1

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def name(self) -> str:
        """A file and artifact name part: `I-of-N`."""
        return f"{self.index}-of-{self.count}"


ALL = Shard()


def parse_shard(text: str) -> Shard:
    """`"2/4"` → Shard(index=2, count=4); anything else is a `ConfigError` saying the form."""
    m = _SHARD.match(text or "")
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ConfigError(f"--shard {text!r} is not I/N with 1 <= I <= N", hint="e.g. --shard 2/4 (the second of four)")
    return Shard(index=int(m.group(1)), count=int(m.group(2)))


def split(items: Sequence[T], shard: Shard) -> list[T]:
    """The shard's slice of `items`: every N-th item from the I-th (a partition over I = 1..N, stable)."""
    return list(items[shard.index - 1::shard.count])


# --------------------------------------------------------------------------------------------- plan sizes

def shard_count(items: int, per_shard: int, cap: int) -> int:
    """ceil(items / per_shard), at least 1 and at most `cap`."""
    return max(1, min(cap, math.ceil(items / max(1, per_shard))))


def zoo_plan_sizes(architectures: int, backends: int, *, inventory: int = 0, probe: int = 0) -> tuple[int, int]:
    """(inventory shards, probe shards per backend) for a zoo of `architectures` on `backends` backends; `inventory`
    and `probe` (when > 0) are the user's counts, checked against GitHub's 256 jobs per matrix."""
    per_backend_cap = max(1, MATRIX_LIMIT // max(1, backends))
    if inventory > MATRIX_LIMIT:
        raise ConfigError(f"--zoo-inventory-shards {inventory}: more than GitHub's {MATRIX_LIMIT} jobs per matrix",
                          hint=f"use at most {MATRIX_LIMIT}")
    if probe > per_backend_cap:
        raise ConfigError(f"--zoo-probe-shards {probe} on {backends} backend(s) makes {probe * backends} probe jobs, "
                          f"more than GitHub's {MATRIX_LIMIT} per matrix",
                          hint=f"use at most {per_backend_cap} probe shards per backend")
    inv = inventory or shard_count(architectures, ARCHS_PER_INVENTORY_SHARD, MATRIX_LIMIT)
    prb = probe or shard_count(architectures * SIGNATURES_PER_ARCH, SIGNATURES_PER_PROBE_SHARD, per_backend_cap)
    return min(inv, max(1, architectures)), prb


# --------------------------------------------------------------------------------------------- manifests

def manifest_path(run_dir: Path, shard: Shard) -> Path:
    return Path(run_dir) / "zoo" / "inventory" / "shards" / f"{shard.name}.json"


def selection_digest(groups: Mapping[str, Sequence[str]]) -> str:
    """A digest of the whole selection (group -> sorted model types): shards of other selections never mix."""
    text = json.dumps({g: sorted(t) for g, t in sorted(groups.items())}, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def manifest(groups: Mapping[str, Sequence[str]], shard: Shard) -> dict[str, Any]:
    """What inventory shard `shard` of the selection `groups` (group -> sorted model types) scans."""
    return {"version": MANIFEST_VERSION, "shard": shard.index, "of": shard.count,
            "selection": selection_digest(groups),
            "groups": {g: split(list(t), shard) for g, t in sorted(groups.items())}}


def _fix(shard: Shard) -> str:
    return (f"rerun `deepview-ci zoo inventory MATRIX --shard {shard} --out DIR` (the same MATRIX and --select/--skip) "
            f"and pass DIR to the merge, or download that shard's artifact")


def check_manifests(found: Sequence[tuple[Path, Any]], groups: Mapping[str, Sequence[str]]) -> dict[int, Path]:
    """Shard index -> the run folder holding it, when `found` ((manifest path, its JSON)) are the N shards of one
    split of the selection `groups`; else an `InputError` naming the odd file or the missing shard."""
    digest = selection_digest(groups)
    mine: dict[int, tuple[Path, Any]] = {}
    counts: set[int] = set()
    for path, doc in found:
        if not isinstance(doc, dict) or not {"shard", "of", "selection", "groups"} <= set(doc):
            raise InputError(f"{path}: not an inventory shard manifest of this version of deepview-ci",
                             hint="the file is corrupt or truncated; rerun the inventory shard that wrote it")
        if doc["selection"] != digest:
            raise InputError(f"{path}: inventory shard {doc['shard']}/{doc['of']} scanned another selection of "
                             f"architectures than this matrix's zoo", hint="merge only the shards of this matrix, with "
                             "the same --select/--skip as `zoo inventory` had")
        if doc["shard"] in mine:
            raise InputError(f"{path}: inventory shard {doc['shard']}/{doc['of']} is also in {mine[doc['shard']][0]}",
                             hint="pass each shard's folder once")
        mine[doc["shard"]] = (path, doc)
        counts.add(int(doc["of"]))
    if not mine:
        raise InputError("no inventory shard found: no folder holds zoo/inventory/shards/I-of-N.json",
                         hint="pass the folders `deepview-ci zoo inventory MATRIX --shard I/N --out DIR` wrote")
    if len(counts) > 1:
        raise InputError(f"inventory shards of different splits ({', '.join(f'/{n}' for n in sorted(counts))})",
                         hint="merge the shards of one split only (every one with the same N)")
    [n] = counts
    for i in range(1, n + 1):
        if i not in mine:
            raise InputError(f"inventory shard {i}/{n} is missing: none of the folders holds "
                             f"zoo/inventory/shards/{i}-of-{n}.json", hint=_fix(Shard(index=i, count=n)))
    return {i: p.parent.parent.parent.parent for i, (p, _doc) in sorted(mine.items())}
