"""Atomic file writes (a reader never sees a half-written file, Ctrl-C never leaves one), file locks, and the check
that an output path can be written (a failed write is one `OutputError` line naming the path, exit 5)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Literal, TypeVar

from .errors import ExecutionError

T = TypeVar("T")


class OutputError(ExecutionError):
    """An output path cannot be written (read-only, a file where a folder should be, no such device): exit 5."""


def output_error(path: str | os.PathLike[str], exc: OSError, *, what: str = "") -> OutputError:
    """`exc` (raised while writing under `path`) as one line naming the path, the reason and the fix."""
    where = f"{what} {path}" if what else str(path)
    reason = exc.strerror or type(exc).__name__
    if exc.filename and os.fspath(exc.filename) != os.fspath(path):
        reason += f" ({exc.filename})"
    if isinstance(exc, (NotADirectoryError, FileExistsError)):
        hint = "a file is in the way of a folder: choose another path, or move the file"
    elif isinstance(exc, IsADirectoryError):
        hint = "that is a folder: give a file name"
    else:
        hint = "choose a path you can write to (a writable, existing file system)"
    return OutputError(f"cannot write {where}: {reason}", hint=hint)


def check_output(path: str | os.PathLike[str], kind: Literal["dir", "file"], *, what: str = "") -> None:
    """Fail early, before any work, when `path` cannot be written: a folder (`kind="dir"`, created if missing) or a
    file (its folder is created; an existing folder at `path` is refused). A file is created and removed to be sure."""
    target = Path(path)
    folder = target if kind == "dir" else target.parent
    try:
        if kind == "file" and target.is_dir():
            raise IsADirectoryError(21, "Is a directory", str(target))
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(20, "Not a directory", str(folder))
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".deepview-ci-probe.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise output_error(path, exc, what=what) from None


_UMASK: int | None = None


def file_mode() -> int:
    """The mode a new file gets under this process's umask (0o644 under the usual 022): what `open()` would give."""
    global _UMASK
    if _UMASK is None:
        try:  # Linux: read it without changing it (os.umask's set-and-restore is not thread-safe)
            line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("Umask:"))
            _UMASK = int(line.split()[1], 8)
        except (OSError, StopIteration, ValueError, IndexError):
            _UMASK = os.umask(0o022)
            os.umask(_UMASK)
    return 0o666 & ~_UMASK


def atomic_write_with(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """`write(tmp)` fills a temp file in `path`'s folder (`.<name>.<random>.tmp`), then `os.replace` puts it at
    `path`; the temp file is removed if `write` fails.
    The file follows the umask like any `open()` (mkstemp alone would leave it 0600). An `OSError` (read-only
    folder, a file in the way, disk full) is raised as `OutputError` naming `path`."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.fchmod(fd, file_mode())
        os.close(fd)
    except OSError as exc:
        raise output_error(target, exc) from None
    try:
        write(Path(tmp))
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError) and exc.filename in (None, tmp, str(target)):  # the write itself (disk full…)
            raise output_error(target, exc) from None
        raise
    return target


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, sync: bool = True) -> Path:
    """Write `data` to `path` via a temp file in the same folder (fsynced unless `sync` is false: then a reader
    still never sees a half-written file, but an OS crash may leave an empty one) and `os.replace`."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            if sync:
                os.fsync(fh.fileno())

    return atomic_write_with(path, write)


_SURROGATE = re.compile("[\ud800-\udfff]")


def utf8_text(text: str) -> str:
    """`text` with every lone surrogate (a compiler's badly decoded byte; not encodable as UTF-8) replaced by U+FFFD:
    `text` itself when it has none. Every text write goes through it, so such a message never fails a write."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, sync: bool = True) -> Path:
    return atomic_write_bytes(path, utf8_text(text).encode("utf-8"), sync=sync)


def atomic_write_chunks(path: str | os.PathLike[str], chunks: Iterable[str], *, sync: bool = True) -> Path:
    """`atomic_write_text` of the concatenation of `chunks`, written as they come: a big file (results.json, diff.json)
    is never held whole in memory, and a reader still sees the old file or the complete new one, never a part."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            for chunk in chunks:
                fh.write(utf8_text(chunk).encode("utf-8"))
            fh.flush()
            if sync:
                os.fsync(fh.fileno())

    return atomic_write_with(path, write)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 2) -> Path:
    text = json.dumps(obj, indent=indent, sort_keys=False, ensure_ascii=False, allow_nan=False)
    return atomic_write_text(path, text + "\n")


def append_line(path: str | os.PathLike[str], line: str, *, sync: bool = True) -> None:
    """Append one line and fsync: used for crash journals that must survive a segfault. `sync=False`: flushed to
    the OS only, which survives the writer's crash (not the machine's), for lines written many times a second."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "a", encoding="utf-8", errors="replace") as fh:
            fh.write(line.rstrip("\n") + "\n")
            fh.flush()
            if sync:
                os.fsync(fh.fileno())
    except OSError as exc:
        raise output_error(target, exc) from None


def append_record(path: str | os.PathLike[str], record: Any) -> None:
    """Append one JSON record to an append-only `.jsonl` log (fsynced: it must survive the writer's crash)."""
    append_line(path, json.dumps(record, ensure_ascii=False))


def read_records(path: str | os.PathLike[str], parse: Callable[[Any], T], key: Callable[[T], str]) -> dict[str, T]:
    """The records of an append-only `.jsonl` log by key: the last line for a key wins, and a torn last line (the
    writer died mid-write) or a line `parse` rejects with ValueError/TypeError is skipped. No file: empty."""
    out: dict[str, T] = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            rec = parse(json.loads(line))
        except (ValueError, TypeError):
            continue
        out[key(rec)] = rec
    return out


@contextlib.contextmanager
def locked(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created if missing), waiting for it, until the block ends."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the flock


def try_lock(path: str | os.PathLike[str]) -> IO[bytes] | None:
    """An exclusive `flock` on `path` if no live process holds one, else None, without waiting.

    The lock lives as long as the returned file: close it to release (a dead holder's lock is dropped by the OS).
    """
    fh = open(path, "ab")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        return None
    return fh
