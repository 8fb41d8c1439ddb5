"""The reference dump of the numerics mode: a streaming writer and a lazy reader.

A dump folder holds `index.json` (every module call: key, name, class, caller, depth, its inputs and output as
specs of the one call codec, `ci_runner/engine/codec.py`, the keys of its compared tensors) and safetensors chunks of at
most `chunk_bytes`; only the current chunk is in memory while writing, and a reader keeps at most two chunk files
open. Loading uses safetensors and JSON only, never pickle.

Index schema 3 stores a call's inputs and output as specs of the one wire format (`codec.encode_call`:
`{"args": {"__tuple__": […]}, "kwargs": {"__dict__": […]}}`, a tensor `{"__tensor__": {"key": k}}`). Schema 2 wrote
the codec's earlier dialect (`{"tensor": k}`, `{"value": x}`, `{"tuple": …}`); schema 1 (before the codec was
shared) stored `{"args": [spec, …], "kwargs": [[name, spec], …]}` with keys `t`/`v`/`f`. The reader reads all
three: `upgrade_index` turns a schema-1 or schema-2 index into schema 3 when it is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from ...engine.codec import TensorDedupe, Unstorable, decode_call, decode_value, upgrade_call_v2, upgrade_v2
from ...errors import InputError, UsageError
from ...fsutil import atomic_write_json

DUMP_SCHEMA_VERSION = 3
READABLE_SCHEMA_VERSIONS = (1, 2, 3)
INDEX_NAME = "index.json"

_V1_KEYS = {"t": "tensor", "v": "value", "f": "float"}


def upgrade_spec(spec: Any) -> Any:
    """A schema-1 value spec (keys `t`/`v`/`f`) in schema 2's keys (`tensor`/`value`/`float`)."""
    if not isinstance(spec, dict):
        return spec
    out: dict[str, Any] = {}
    for k, v in spec.items():
        if k in ("tuple", "list"):
            v = [upgrade_spec(x) for x in v]
        elif k in ("dict", "items"):
            v = [[name, upgrade_spec(x)] for name, x in v]
        out[_V1_KEYS.get(k, k)] = v
    return out


def upgrade_index(index: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 or schema-2 index in schema 3 (see the module docstring); a schema-3 index as it is."""
    version = index.get("schema_version")
    if version not in (1, 2):
        return index
    calls = []
    for call in index.get("calls") or []:
        call = dict(call)
        inputs = call.get("inputs")
        if inputs is not None and version == 1:
            inputs = {"args": {"tuple": [upgrade_spec(a) for a in inputs["args"]]},
                      "kwargs": {"dict": [[k, upgrade_spec(v)] for k, v in inputs["kwargs"]]}}
        if inputs is not None:
            call["inputs"] = upgrade_call_v2(inputs)
        if "output" in call:
            call["output"] = upgrade_v2(upgrade_spec(call["output"]) if version == 1 else call["output"])
        calls.append(call)
    return {**index, "schema_version": DUMP_SCHEMA_VERSION, "calls": calls}


class DumpFolderError(UsageError):
    """The folder given for a dump holds files that are not a dump's: it is not emptied."""


def dump_matches(folder: Path, key: str) -> bool:
    """Whether `folder` holds a complete reference dump recorded for `key` (the thresholds key hash: model, inputs,
    references, samples, torch). A dump of another key, or of none, is stale and must be recorded again."""
    try:
        index = json.loads((Path(folder) / INDEX_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(index, dict) and index.get("schema_version") in READABLE_SCHEMA_VERSIONS and index.get("key") == key


class DumpWriter:
    """Streams tensors into safetensors chunks (at most `chunk_bytes` buffered) and writes `index.json` on close.

    A tensor object seen again unchanged (its version counter did not move: a module's output passed on as the
    next module's input) is stored once; the check holds only a weak reference, so nothing is kept alive.
    """

    index_name = INDEX_NAME

    def __init__(self, folder: Path, *, chunk_bytes: int = 64 << 20, meta: Mapping[str, Any] | None = None) -> None:
        self.folder = Path(folder)
        self.clear_folder()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.chunk_bytes = chunk_bytes
        self.meta = dict(meta or {})
        self.calls: list[dict[str, Any]] = []
        self.tensor_file: dict[str, int] = {}
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._files = 0
        self._n = 0
        self._seen = TensorDedupe()
        self.bytes_written = 0

    def chunk_name(self, i: int) -> str:
        return f"chunk-{i:04d}.safetensors"

    def is_own_file(self, name: str) -> bool:
        """A file a writer of this kind writes into its folder (a previous dump's, replaced by this one)."""
        return name == self.index_name or (name.startswith("chunk-") and name.endswith(".safetensors")) or \
            (name.startswith(".") and name.endswith(".tmp"))

    def clear_folder(self) -> None:
        """Remove a previous dump's files from the folder; refuse a folder that holds anything else.

        Only files this writer writes are ever removed: a folder given by mistake (a home, a results folder) is
        left as it is, with `DumpFolderError` saying so."""
        if not self.folder.exists():
            return
        if not self.folder.is_dir():
            raise DumpFolderError(f"{self.folder}: exists and is not a folder",
                                  hint="give a new or empty folder for the dump")
        entries = list(self.folder.iterdir())
        strangers = sorted(p.name for p in entries if not (p.is_file() and self.is_own_file(p.name)))
        if strangers:
            raise DumpFolderError(f"{self.folder}: not empty and not a dump (holds {', '.join(strangers[:3])}"
                                  f"{' …' if len(strangers) > 3 else ''})",
                                  hint="give a new or empty folder; a previous dump folder is replaced")
        for p in entries:
            p.unlink()

    def put(self, t: torch.Tensor) -> str:
        known = self._seen.get(t)
        if known is not None:
            return known
        key = f"t{self._n}"
        self._n += 1
        data = t.detach()
        if data.device.type != "cpu":
            data = data.to("cpu")
        data = data.contiguous().clone() if data.is_contiguous() else data.contiguous()
        if data.is_complex():  # safetensors has no complex dtype everywhere: store (real, imag)
            data = torch.view_as_real(data).contiguous()
            key += "c"
        self._buf[key] = data
        self._buf_bytes += data.numel() * data.element_size()
        self._seen.remember(t, key)
        if self._buf_bytes >= self.chunk_bytes:
            self.flush()
        return key

    def flush(self) -> None:
        if not self._buf:
            return
        from safetensors.torch import save_file  # deferred: loaded only when a dump is written

        save_file(self._buf, str(self.folder / self.chunk_name(self._files)))
        for k in self._buf:
            self.tensor_file[k] = self._files
        self.bytes_written += self._buf_bytes
        self._files += 1
        self._buf = {}
        self._buf_bytes = 0

    @property
    def files(self) -> list[str]:
        """The chunk files written so far, in order."""
        return [self.chunk_name(i) for i in range(self._files)]

    def close(self) -> Path:
        self.flush()
        self._seen.clear()
        index = {"schema_version": DUMP_SCHEMA_VERSION, **self.meta, "calls": self.calls,
                 "files": self.files, "tensors": self.tensor_file}
        return atomic_write_json(self.folder / self.index_name, index, indent=None)


class ChunkFiles:
    """The one way a dump's safetensors chunk files are read (the numerics mode's `DumpReader` and the toolbox's
    `dumps.Dump`): at most `max_open` files open at once, the least recently used dropped first. Each open chunk is
    a mapping whose read pages count as resident: keep few, and memory stays flat however deep the model is.
    Tensors are not cached; a key ending in ``c`` is a complex tensor stored as real pairs."""

    def __init__(self, folder: Path, *, listed_in: str, max_open: int = 2) -> None:
        self.folder = Path(folder)
        self.listed_in = listed_in  # the index or manifest file that lists the chunks (for error texts)
        self.max_open = max_open
        self._handles: dict[str, Any] = {}

    def _open(self, file: str) -> Any:
        from safetensors import safe_open  # deferred: loads safetensors only when a dump is read

        h = self._handles.pop(file, None)
        if h is None:
            while len(self._handles) >= self.max_open:  # drop the least recently used chunk (and its mapping)
                self._handles.pop(next(iter(self._handles)))
            path = self.folder / file
            try:
                h = safe_open(str(path), framework="pt", device="cpu")
            except FileNotFoundError:
                raise InputError(f"{path}: missing (listed in {self.folder / self.listed_in})",
                                 hint="copy the whole dump folder; every chunk file belongs to it") from None
            except Exception as exc:  # safetensors' SafetensorError, a truncated header, …
                raise InputError(f"{path}: not a readable safetensors file: {exc}",
                                 hint="the dump is corrupt or was cut short; dump it again") from None
        self._handles[file] = h  # most recently used last
        return h

    def tensor(self, file: str, key: str, *, what: str = "") -> torch.Tensor:
        """Tensor `key` of chunk `file` (`what` names it in the error when the chunk lacks it)."""
        h = self._open(file)
        try:
            t = h.get_tensor(key)
        except Exception as exc:
            raise InputError(f"{self.folder / file}: no tensor {key!r}{f' for {what}' if what else ''} ({exc})",
                             hint="the manifest and the chunk files disagree; dump it again") from None
        return torch.view_as_complex(t) if key.endswith("c") else t

    @property
    def open_count(self) -> int:
        """How many chunk files are open now (at most `max_open`)."""
        return len(self._handles)

    def close(self) -> None:
        self._handles.clear()


class DumpReader:
    """Reads a dump lazily: one tensor at a time from its chunk (`ChunkFiles`: at most `MAX_OPEN` chunk files open;
    tensors are not cached)."""

    MAX_OPEN = 2

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        try:
            index = json.loads((self.folder / INDEX_NAME).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise InputError(f"{self.folder}: no index.json: not a complete numerics dump",
                             hint="the reference pass did not finish; rerun the mode") from None
        except json.JSONDecodeError as exc:
            raise InputError(f"{self.folder}/index.json: corrupt ({exc.msg})", hint="rerun the mode") from None
        version = index.get("schema_version") if isinstance(index, dict) else None
        if version not in READABLE_SCHEMA_VERSIONS:
            raise InputError(f"{self.folder}: dump schema {version} is not "
                             f"{' or '.join(map(str, READABLE_SCHEMA_VERSIONS))}",
                             hint="dump it again with this version of deepview-ci")
        self.index: dict[str, Any] = upgrade_index(index)
        self.calls: list[dict[str, Any]] = self.index["calls"]
        self.by_key: dict[str, dict[str, Any]] = {c["key"]: c for c in self.calls}
        self._children: dict[int | None, list[dict[str, Any]]] = {}
        for c in self.calls:
            self._children.setdefault(c["parent"], []).append(c)
        self._chunks = ChunkFiles(self.folder, listed_in=INDEX_NAME, max_open=self.MAX_OPEN)

    def get(self, key: str, *, clone: bool = False) -> torch.Tensor:
        """One stored tensor. `clone=True` for tensors fed to a module: own, aligned memory, because some kernels
        pick their code path by alignment and the isolated view must reproduce the reference bit for bit."""
        t = self._chunks.tensor(self.index["files"][self.index["tensors"][key]], key)
        return t.clone() if clone else t

    def mutated_names(self) -> set[str]:
        """The modules with a call whose output the model changed in place after the hook (see `RecordingSink`)."""
        return {c["name"] for c in self.calls if c.get("mutated_later")}

    def children(self, call: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The direct sub-calls of `call`, in call order."""
        return self._children.get(call["idx"], [])

    def root(self) -> dict[str, Any]:
        return self.calls[0]

    def inputs(self, call: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if call.get("inputs") is None:
            raise Unstorable(call.get("inputs_error") or "inputs not stored")
        return decode_call(call["inputs"], self._fed)

    def output(self, call: Mapping[str, Any]) -> Any:
        return decode_value(call["output"], self._fed)

    def _fed(self, key: str) -> torch.Tensor:
        return self.get(key, clone=True)

    def ref_tensors(self, call: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return {sub: self.get(k) for sub, k in call["compare"].items()}

    def close(self) -> None:
        self._chunks.close()

