"""The one failure classifier: what failed, at which stage, and where it was raised.

Every mode (ops probes, layers probes, culprits, numerics views) and every repro script reads an exception
the same way:

* `unwrap`: the backend's own error, not Dynamo's wrapper around it (``BackendCompilerFailed.inner_exception``,
  the ``__cause__`` of ``InternalTorchDynamoError`` and friends);
* `stage_of`: ``trace`` (Dynamo could not trace the code), ``compile`` (the backend's compiler, or Dynamo
  building the compiled frame: guards, graph compile) or ``run`` (the compiled code ran and raised). Dynamo
  re-raises some errors unwrapped, so the traceback decides when the type does not;
* `raised_traceback`: the traceback of the unwrapped error, its innermost frames, which
  `results.rootcause.raised_in` reads to name the frame it was raised in;
* `first_line`, `headline`, `error_text`, `tail`: the words shown for a failure (the end of a long text: `tail`;
  of a child's stderr file: `isolate.file_tail`).

`unwrap` and `compile_frames_in` use the standard library only: the repro templates embed their source
(`REPRO_SOURCES`), so a repro classifies its failure exactly as the mode that found it.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Iterator

__all__ = ["Failure", "REPRO_FUNCTIONS", "chain", "classify", "compile_frames_in", "error_text", "first_line",
           "headline", "tail", "is_compile_stage", "raised_traceback", "stage_of", "unwrap"]


def unwrap(exc):  # type: ignore[no-untyped-def]
    """The error the backend raised, not Dynamo's wrapper around it."""
    for _ in range(8):
        inner = getattr(exc, "inner_exception", None)  # BackendCompilerFailed
        if isinstance(inner, BaseException):
            exc = inner
        elif (type(exc).__module__ or "").startswith("torch._dynamo") and isinstance(exc.__cause__, BaseException):
            exc = exc.__cause__  # InternalTorchDynamoError and friends
        else:
            break
    return exc


def compile_frames_in(exc):  # type: ignore[no-untyped-def]
    """Whether `exc`'s traceback passes through Dynamo's frame conversion or graph compile (a compile error that
    Dynamo re-raised unwrapped), as opposed to the compiled code's run-time wrappers."""
    frames = ("torch/_dynamo/convert_frame.py", "torch/_dynamo/output_graph.py",
              "torch/_functorch/_aot_autograd/graph_compile.py")
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith(frames):
            return True
        tb = tb.tb_next
    return False


def stage_of(exc):  # type: ignore[no-untyped-def]
    """``compile`` (the backend's compiler refused the graph), ``trace`` (Dynamo itself failed: tracing,
    guards), ``compile`` again for another error raised while Dynamo built the compiled frame, else ``run``."""
    try:
        from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException
    except ImportError:  # torch without Dynamo
        BackendCompilerFailed = TorchDynamoException = ()
    if BackendCompilerFailed and isinstance(exc, BackendCompilerFailed):
        return "compile"
    if TorchDynamoException and isinstance(exc, TorchDynamoException):
        return "trace"
    return "compile" if compile_frames_in(exc) else "run"


# the functions a repro script embeds (by source, `engine.repro.render_template`): standard library and torch only
REPRO_FUNCTIONS = (unwrap, compile_frames_in, stage_of)


def chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then its causes and contexts, each once."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def is_compile_stage(exc: BaseException) -> bool:
    """Whether `exc` (or an error in its chain) came from compiling, Dynamo's tracing included, not from
    running the compiled code."""
    return any(stage_of(e) != "run" for e in chain(exc))


def error_text(exc: BaseException) -> str:
    """The error's message, or its type name when it has none."""
    text = str(exc).strip()
    return text if text else type(exc).__name__


def raised_traceback(exc: BaseException, inner: BaseException | None = None, *, frames: int = 40,
                     limit: int = 6000) -> str:
    """The traceback of the error the backend raised (`inner`, default `unwrap(exc)`), its innermost `frames`
    frames: where it was raised, which `rootcause.raised_in` reads; then the wrapper Dynamo raised, if any."""
    inner = unwrap(exc) if inner is None else inner
    text = "".join(traceback.format_exception(type(inner), inner, inner.__traceback__, limit=-frames, chain=False))
    if inner is not exc:
        text += f"\n(raised to the caller as {type(exc).__name__})\n"
    return text[-limit:]


@dataclass(frozen=True, kw_only=True)
class Failure:
    """One classified failure: the stage, the backend's own error (type, text) and where it was raised."""

    stage: str  # trace | compile | run
    error_type: str
    message: str
    traceback: str
    wrapper: str | None  # the type Dynamo wrapped it in, when it did


def classify(exc: BaseException) -> Failure:
    """The stage, the unwrapped error and its traceback of an exception from compiling or running."""
    inner = unwrap(exc)
    return Failure(stage=stage_of(exc), error_type=type(inner).__name__, message=error_text(inner),
                   traceback=raised_traceback(exc, inner), wrapper=type(exc).__name__ if inner is not exc else None)


# ---------------------------------------------------------------------------- words

def first_line(text: object, limit: int = 300) -> str:
    """The first non-blank line of `text`, stripped, at most `limit` characters."""
    for line in str(text or "").splitlines():
        if line.strip():
            return line.strip()[:limit]
    return ""


def tail(text: str, limit: int = 4000, *, marked: bool = False, keep_head: bool = False) -> str:
    """The last `limit` characters of `text` (all of it when shorter). A cut text starts with "…" when `marked`;
    with `keep_head` it keeps its first line too, then "…" on a line (faulthandler's "Timeout (0:00:03)!")."""
    if len(text) <= limit:
        return text
    if keep_head:
        head = text.splitlines()[0][:200] if text.strip() else ""
        return f"{head}\n…\n{text[-(limit - len(head) - 3):]}"
    return "…" + text[-limit:] if marked else text[-limit:]


def headline(text: str, limit: int = 240) -> str:
    """The headline of a message for a reader; a lead-in such as ``backend='x' raised:`` is joined to the next
    line, and a cut line ends in an ellipsis."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    if len(lines) > 1 and line.endswith(":") and len(line) < 80:
        line = f"{line} {lines[1]}"
    return line if len(line) <= limit else line[: limit - 1] + "…"
