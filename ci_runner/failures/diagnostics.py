"""A compiler's own words about a failure: what it wrote to file descriptor 2 and the exception chain, reduced to
the lines that name the failing op or pass."""

from __future__ import annotations

import contextlib
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from .failure import chain, first_line


@contextlib.contextmanager
def capture_fd2(path: str | Path | None = None) -> Iterator[list[str]]:
    """`with capture_fd2() as got:` … `got[0]` is everything written to file descriptor 2 inside the block.

    Native compilers write their diagnostics there, past `sys.stderr` (IREE prints "failed to legalize operation
    …" from C++). Without `path`, when fd 2 is a regular file (an isolated child's stderr.log), the text stays
    where it is written and is read back afterwards, so a child that aborts or hangs inside the block still leaves
    its last words in the log its parent reads; otherwise fd 2 goes to a temporary file for the block and the text
    is passed on to the real stderr afterwards. With `path`, the text goes to that file (truncated first) and
    stays there for the parent to read, and is passed on too. Nothing is hidden either way."""
    got = [""]
    sys.stderr.flush()
    try:
        regular = stat.S_ISREG(os.fstat(2).st_mode)
        start = os.lseek(2, 0, os.SEEK_CUR) if regular else 0
    except OSError:
        regular = False
    if regular and path is None:
        try:
            yield got
        finally:
            sys.stderr.flush()
            try:
                with open("/proc/self/fd/2", "rb") as f:
                    f.seek(start)
                    got[0] = f.read().decode("utf-8", "replace")
            except OSError:
                got[0] = ""
        return
    saved = os.dup(2)
    opened = open(path, "w+b") if path is not None else tempfile.TemporaryFile(mode="w+b")
    with opened as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield got
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            got[0] = tmp.read().decode("utf-8", "replace")
            if got[0]:
                os.write(2, got[0][-20000:].encode("utf-8", "replace"))


_DIAG_RE = re.compile(r"(\berror:|failed to legalize|not supported|unsupported|cannot|could not|Exception|Error\b)",
                      re.IGNORECASE)
_DIAG_NOISE_RE = re.compile(r"^(Traceback|File |\s*[\^~]+\s*$|During handling|The above exception|warnings\.warn|raise |"
                             r"return |Set TORCH_LOGS|\[\d+/\d+\]\s*$)")
_LOG_PREFIX_RE = re.compile(r"^[EWIDV]\d{4} [\d:.]+ \d+ \S+\] (\[[^\]]*\] )?")  # torch's own log lines


def compiler_diagnostics(text: str, op: str | None = None, *, limit: int = 6) -> list[str]:
    """The lines of a compiler's output that name the failing op or pass: MLIR-style `error:` lines first, then
    lines naming the op, then other lines that read as a diagnostic (Python traceback lines left out)."""
    lines = [_LOG_PREFIX_RE.sub("", ln.strip()).strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not _DIAG_NOISE_RE.match(ln)]
    bare = (op or "").split(".")[1] if op and op.count(".") >= 2 else (op or "")
    picked: list[str] = []
    for keep in (lambda ln: "error:" in ln,
                 lambda ln: bool(bare) and bare in ln and bool(_DIAG_RE.search(ln)),
                 lambda ln: bool(_DIAG_RE.search(ln)) and "Warning" not in ln):
        for ln in lines:
            if keep(ln) and ln[:500] not in picked:
                picked.append(ln[:500])
    return picked[:limit]


def exception_chain(exc: BaseException, limit: int = 6) -> list[str]:
    """`Type: first line` of an exception and its causes / contexts, outermost first."""
    return [f"{type(e).__name__}: {first_line(str(e), 500)}"[:500] for e in chain(exc)][:limit]


def compiler_words(fd2_text: str, exc: BaseException, message: str, op: str | None = None) -> tuple[list[str], list[str]]:
    """(the compiler's diagnostic lines not already in `message`'s first line, the exception chain) for a failure
    `exc` whose compile/run wrote `fd2_text` to fd 2."""
    links = exception_chain(exc)
    words = compiler_diagnostics(fd2_text + "\n" + "\n".join(links[1:]), op)
    first = (message.splitlines() or [""])[0]
    return [w for w in words if w not in first and not (first and first in w)], links
