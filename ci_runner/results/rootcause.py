"""Root causes: findings grouped by their normalised error signature, and the volatile-token rule.

One compiler bug often surfaces as many findings (every module of a model fails on the same guard error). A
finding's signature is a short hash of

* its error type (or, for a numerical finding without an error, its kind),
* its error message's first line with the volatile parts normalised (`normalize_text`),
* where it was raised: the package of the innermost frame of the root exception's traceback
  (`raised_in`: the backend's package, ``torch._dynamo``/``torch._inductor``/``torch.fx``/…, or the model's).

The volatile-token rule (`normalize_text`), used for signatures and for repro verification:

===================  ===========================================  ============
what                 example                                      becomes
===================  ===========================================  ============
symbolic-shape ids   ``s96``, ``u3`` (sympy symbols)              ``s<N>``
addresses            ``0x7f3a2c``                                 ``0x<ADDR>``
temporary paths      ``/tmp/tmpab12cd/x.py``                      ``<TMP>``
process ids          ``pid 4242``, ``pid=4242``                   ``pid <N>``
counters             ``getitem_12``, ``__compiled_fn_7``, ``[0/3]``  ``getitem_<N>``, ``[<N>/<N>]``
long hex hashes      ``3f9c0a…`` (≥ 12 hex digits)                ``<HASH>``
MLIR op dumps        ``source.mlir:6:10:``, ``%3``, ``%arg0``,    ``<LOC>:``, ``%<N>``,
                     `` : (!torch.vtensor<[8],f32>) -> …``        `` : <TYPES>``
===================  ===========================================  ============

A message's line is its first non-blank line that is not a backend's boilerplate (`cause_line`): IREE's every
compile error reads "JIT compilation failed. See diagnostics." and names the op on a later line (the compiler's
words the modes append). The lines are declared by the vendor modules (`backends/vendor.boilerplate_lines`) and
passed in by the callers (`boilerplate=`), which sit above this module.

Everything else (op names, shapes, dtypes, line numbers of the raising frame) is kept: it is what tells
two causes apart.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Mapping

from ..failures.failure import first_line
from .model import Finding, Results

# ---------------------------------------------------------------------------- the volatile-token rule

_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"0x[0-9a-fA-F]+"), "0x<ADDR>"),
    (re.compile(r"\b(pid|process|PID)([ =:#]+)\d+\b"), r"\1 <N>"),
    (re.compile(r"\b[0-9a-f]{12,}\b"), "<HASH>"),
    (re.compile(r"\b[su]\d+\b"), "s<N>"),
    (re.compile(r"(?<=[A-Za-z_])_\d+\b"), "_<N>"),
    (re.compile(r"\[\d+/\d+\]"), "[<N>/<N>]"),
    # MLIR diagnostics (IREE): the location, SSA value names and the op's function type vary with the module
    # (each rule linear in the text: a match starts where its token starts, so a long token is scanned once)
    (re.compile(r"(?<![\w./-])[\w./-]+\.mlir:\d+:\d+:"), "<LOC>:"),
    (re.compile(r"%[A-Za-z_]*\d+\b"), "%<N>"),
)
_TYPES_AT = re.compile(r"(?<=}>) : \(")  # `}> : (…) -> type`: the op's function type, up to the line's first `) -> type`
_TYPES_END = re.compile(r"\) -> \S+")


def _function_types(text: str) -> str:
    """`(?<=}>) : \\(.*?\\) -> \\S+` replaced by `` : <TYPES>``, in one pass (the regex itself is quadratic on a line
    of many `}> : (` with no end: each start scanned the rest of the line)."""
    out: list[str] = []
    for line in text.split("\n"):
        start = 0
        while (m := _TYPES_AT.search(line, start)) is not None:
            end = _TYPES_END.search(line, m.end())
            if end is None:
                break  # no later start on this line can end either
            out.append(line[start:m.start()] + " : <TYPES>")
            start = end.end()
        out.append(line[start:] + "\n")
    return "".join(out)[:-1]


_PATH_RE = re.compile(r"(?<![\w.])(?:[A-Za-z]:)?[\\/][^\s'\"()\[\],:]+")
_TMP_PART_RE = re.compile(r"[\\/](?:tmp|temp)[^\\/]*[\\/]|[\\/]var[\\/]folders[\\/]|^(?:[A-Za-z]:)?[\\/]tmp$", re.IGNORECASE)


def _tmp_path(m: re.Match[str]) -> str:
    return "<TMP>" if _TMP_PART_RE.search(m.group(0)) else m.group(0)


def normalize_text(text: str) -> str:
    """`text` with its volatile tokens replaced by placeholders (the rule in the module docstring)."""
    out = _PATH_RE.sub(_tmp_path, str(text))
    for pattern, repl in _RULES:
        out = pattern.sub(repl, out)
    return _function_types(out) if "}> : (" in out else out


# ---------------------------------------------------------------------------- where it was raised

_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')
_CHAIN_RE = re.compile(r"(?<!\s)[^\S\n]*\n\s*+(?:The above exception was the direct cause of the following exception:"
                       r"|During handling of the above exception, another exception occurred:)\s*\n")
# packages never named as "where it was raised": helpers that torch or a backend calls into
_HELPERS = ("sympy", "numpy", "typing_extensions", "contextlib", "functools", "importlib", "threading", "copy",
            "abc", "collections", "inspect", "traceback", "_pytest", "pluggy")
_TORCH_PARTS = (("/torch/_dynamo/", "torch._dynamo"), ("/torch/_inductor/", "torch._inductor"),
                ("/torch/fx/", "torch.fx"), ("/torch/_functorch/", "torch._functorch"),
                ("/torch/export/", "torch.export"), ("/torch/_export/", "torch.export"),
                ("/torch/_subclasses/", "torch._subclasses"), ("/torch/nn/", "torch.nn"))
_MODEL_PACKAGES = ("transformers", "diffusers", "timm", "torchvision")


@dataclass(frozen=True, kw_only=True)
class Frame:
    path: str
    line: int
    function: str

    @property
    def short(self) -> str:
        return f"{short_path(self.path)}:{self.line} in {self.function}"


def short_path(path: str) -> str:
    p = path.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in p:
            return p.rsplit(marker, 1)[1]
    for marker in ("/ci_runner/", "/torch/", "/transformers/"):
        if marker in p:
            return marker.strip("/") + "/" + p.rsplit(marker, 1)[1]
    return p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1] if p.count("/") >= 2 else p


def package_of(path: str) -> str:
    """The package a source file belongs to: ``torch._dynamo``, ``openvino``, ``transformers``, ``ci_runner.sim``,
    or ``model`` for a file outside any installed package (the user's own code)."""
    p = "/" + path.replace("\\", "/").lstrip("/")
    for marker, name in _TORCH_PARTS:
        if marker in p:
            return name
    if "/ci_runner/sim/" in p:
        return "ci_runner.sim"
    if "/ci_runner/" in p:
        return "ci_runner"
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in p:
            top = p.rsplit(marker, 1)[1].split("/", 1)[0]
            return top[:-3] if top.endswith(".py") else top
    if "/torch/" in p:
        return "torch"
    if re.search(r"/lib/python3\.\d+/", p):
        return re.split(r"/lib/python3\.\d+/", p, maxsplit=1)[1].split("/", 1)[0].removesuffix(".py")
    return "model"


def role_of(package: str) -> str:
    """backend | torch | model | deepview-ci, for the reader: who has to fix it."""
    if package == "torch" or package.startswith("torch."):
        return "torch"
    if package == "ci_runner":
        return "deepview-ci"
    if package == "model" or package in _MODEL_PACKAGES:
        return "model"
    return "backend"  # the backend's plugin package (ci_runner.sim for the self-test backends)


def frames(traceback_text: str) -> list[Frame]:
    """The frames of the root exception (the first section of a chained traceback), outermost first."""
    for section in _CHAIN_RE.split(traceback_text or ""):
        found = [Frame(path=m.group(1), line=int(m.group(2)), function=m.group(3))
                 for m in _FRAME_RE.finditer(section)]
        if found:
            return found
    return []


@dataclass(frozen=True, kw_only=True)
class RaisedIn:
    package: str  # "torch.fx", "openvino", "transformers", "model", "" (unknown)
    role: str  # backend | torch | model | deepview-ci | unknown
    frame: str  # "torch/fx/experimental/symbolic_shapes.py:6557 in produce_guards_verbose"
    backend_frame: str  # the innermost frame in a non-torch, non-model package, when the raiser is elsewhere

    def words(self) -> str:
        if not self.package:
            return "unknown (no traceback)"
        text = f"{self.package} ({self.role}) at {self.frame}"
        if self.backend_frame:
            text += f"; the deepest backend frame: {self.backend_frame}"
        return text


def raised_in(traceback_text: str) -> RaisedIn:
    """Where the root exception of `traceback_text` was raised: its innermost frame outside helper packages."""
    fr = frames(traceback_text)
    meaningful = [f for f in fr if package_of(f.path) not in _HELPERS]
    if not meaningful:
        return RaisedIn(package="", role="unknown", frame="", backend_frame="")
    inner = meaningful[-1]
    pkg = package_of(inner.path)
    role = role_of(pkg)
    backend = ""
    if role != "backend":
        deeper = [f for f in meaningful if role_of(package_of(f.path)) == "backend"]
        backend = deeper[-1].short if deeper else ""
    return RaisedIn(package=pkg, role=role, frame=inner.short, backend_frame=backend)


# ---------------------------------------------------------------------------- signatures

def _error_text(f: Finding) -> str:
    return str(f.details.get("message_full") or f.details.get("error_message") or f.message or "")


def without_type(text: str, error_type: str | None) -> str:
    """`text` without a leading ``Type: `` (ops messages carry it, layers messages do not): one cause, one key."""
    text = text.lstrip()
    return text[len(error_type) + 2:] if error_type and text.startswith(f"{error_type}: ") else text


_without_type = without_type


def _traceback_text(f: Finding) -> str:
    for key in ("traceback", "traceback_tail"):
        value = f.details.get(key)
        if isinstance(value, str) and value:
            return value
    return ""


@dataclass(frozen=True, kw_only=True)
class Signature:
    id: str
    error_type: str
    message: str  # normalised first line
    raised: RaisedIn


def cause_line(message: str, boilerplate: Collection[str] = (), limit: int = 240) -> str:
    """The line of `message` a cause is keyed on: its first non-blank line that is not one of a backend's
    `boilerplate` lines (a ``compiler: `` prefix, the layers mode's, dropped), else its first line."""
    skip = {b.strip() for b in boilerplate}
    for ln in str(message or "").splitlines():
        ln = ln.strip().removeprefix("compiler: ").strip()
        if ln and ln not in skip:
            return ln[:limit]
    return first_line(message, limit)


def error_signature(error_type: str, message: str, traceback_text: str = "", *,
                    boilerplate: Collection[str] = ()) -> Signature:
    """The normalised signature of one error (its type, cause line and raising package): what `signature` gives
    a finding with that error, for outcomes that are not findings yet (the layers mode groups its probes by it)."""
    msg = normalize_text(cause_line(message, boilerplate, 1000))[:240]  # an MLIR line's types end past 240
    raised = raised_in(traceback_text)
    key = (error_type, msg, raised.package)
    digest = hashlib.sha256("\x1f".join(key).encode("utf-8", "surrogatepass")).hexdigest()[:12]  # any text: a lone surrogate too
    return Signature(id=digest, error_type=error_type, message=msg, raised=raised)


def signature(f: Finding, *, boilerplate: Collection[str] = ()) -> Signature:
    """The finding's normalised error signature. Findings without an error (numerical ones) are keyed by kind
    and by what they are about (op or module class), and by the backend's own words for it where the finding
    keeps them (`details.cause`: two run-time fallbacks with different errors are two causes): each such group
    is its own cause. The phase a finding was found in is never part of the key: one error failing the forward,
    prefill, decode and long is one cause."""
    if f.error_type:
        return error_signature(f.error_type, _without_type(_error_text(f), f.error_type), _traceback_text(f),
                               boilerplate=boilerplate)
    etype = f.kind
    msg = f"{f.kind} in {f.op or f.module_class or f.module or '?'}"
    cause = f.details.get("cause")  # the backend's own words, where it gave some (a run-time fallback's error)
    if isinstance(cause, str) and cause.strip():
        msg += ": " + normalize_text(cause_line(cause, boilerplate, 1000))[:240]
    digest = hashlib.sha256("\x1f".join((etype, msg, "")).encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return Signature(id=digest, error_type=etype, message=msg,
                     raised=RaisedIn(package="", role="unknown", frame="", backend_frame=""))


def annotate(findings: Iterable[Finding], *, boilerplate: Collection[str] = ()) -> None:
    """Put each finding's signature id into ``details["signature"]`` (and where it was raised, when known)."""
    for f in findings:
        _annotate_one(f, boilerplate)


def _annotate_one(f: Finding, boilerplate: Collection[str]) -> Signature:
    sig = signature(f, boilerplate=boilerplate)
    f.details["signature"] = sig.id
    if sig.raised.package and "raised_in" not in f.details:
        f.details["raised_in"] = sig.raised.words()
    return sig


def joined(sigs: Iterable[Signature]) -> dict[str, Signature]:
    """Signature id -> the signature of its group. An error whose raising frame is unknown (a finding that kept no
    traceback) joins the one group with the same error type and cause line whose frame is known; with none, or
    several (the same words raised in two packages), it stays its own group."""
    sigs = list(sigs)
    known: dict[tuple[str, str], dict[str, Signature]] = {}
    for s in sigs:
        if s.raised.package:
            known.setdefault((s.error_type, s.message), {})[s.id] = s
    out: dict[str, Signature] = {}
    for s in sigs:
        same = known.get((s.error_type, s.message), {})
        out[s.id] = next(iter(same.values())) if not s.raised.package and len(same) == 1 else s
    return out


# ---------------------------------------------------------------------------- one cause in findings of two kinds

# the ops mode's words for a non-finite mismatch (`modes/ops/compare.compare_leaf`; tests/unit/test_rootcause.py
# builds them with it)
_NONFINITE_OP = re.compile(r"\bNaN at \d+ positions\b|\binfinities differ\b")


def _bare_op(name: str | None) -> str:
    """An op's name as both modes can match it: `torch.sym_max` (ops) and `sym_max` (a partitioner's leftover),
    `aten.histc.default` and `torch.ops.aten.histc.default` read the same."""
    text = str(name or "")
    for prefix in ("torch.ops.", "torch.", "_operator.", "operator."):
        text = text.removeprefix(prefix)
    return text.removesuffix(".default")


def _op_modules(f: Finding) -> list[str]:
    mods = f.details.get("modules")
    found = [str(m) for m in mods] if isinstance(mods, list) else []
    return found or ([f.module] if f.module else [])


def _nonfinite_divergence(f: Finding) -> bool:
    m = f.metrics or {}
    try:
        return f.kind == "divergence" and int(m.get("nonfinite_tgt") or 0) > int(m.get("nonfinite_ref") or 0)
    except (TypeError, ValueError):
        return False


def _inside(module: str, scope: str) -> bool:
    return module == scope or module.startswith(scope + ".")


def _culprit_op(f: Finding, boilerplate: Collection[str]) -> tuple[str, tuple[str, str]] | None:
    """A layer finding's culprit when it is one operator that fails alone with a verified repro: (its op, its
    error's (type, cause line) as `error_signature` keys them)."""
    c = f.details.get("culprit")
    if f.kind != "layer_failure" or not isinstance(c, Mapping) or not c.get("found") or c.get("kind") != "single":
        return None
    ops, repro = c.get("ops"), c.get("repro")
    if not (isinstance(ops, list) and len(set(ops)) == 1 and isinstance(repro, Mapping) and repro.get("verified")):
        return None
    etype = str(c.get("error_type") or "")
    sig = error_signature(etype, without_type(str(c.get("message") or ""), etype), boilerplate=boilerplate)
    return str(ops[0]), (sig.error_type, sig.message)


def _link_of(f: Finding, op_findings: list[Finding], boilerplate: Collection[str] = ()) -> tuple[Finding, str] | None:
    """The op finding of the same cell whose cause `f` shows, and why; None unless exactly one cause (one operator,
    one error) fits.

    * a non-finite divergence (the numerics mode's NaN/Inf where the reference is finite) that starts in a module
      where one operator's ops finding gives NaN/Inf where CPU eager does not (OpenVINO's SDPA on a fully masked
      row, and the padded batch's NaN it causes);
    * a partitioner's leftover (`eager_fallback` of an op) whose op fails on the backend in the ops mode
      (OpenVINO's `sym_max`: left outside its partitions in the compile mode, unsupported in the ops mode);
    * a layer failure whose culprit is one operator failing alone (its repro verified) with the very error that
      operator's ops finding has, though the layer's own first error reads otherwise (DeepSeek-V3's MoE gate on
      IREE: the gate fails on "torch.constant.int", its culprit `topk(sorted=False)` on "torch.constant.bool", as
      the ops probe of `topk` does).
    """
    culprit = _culprit_op(f, boilerplate)
    if _nonfinite_divergence(f) and f.module:
        fits = [g for g in op_findings if g.kind == "op_mismatch" and _NONFINITE_OP.search(_error_text(g))
                and any(_inside(m, f.module) for m in _op_modules(g))]
        why = "its NaN/Inf starts in {module}, where the ops mode found {op} giving NaN/Inf that CPU eager does not"
    elif f.kind == "eager_fallback" and f.op:
        fits = [g for g in op_findings if g.error_type and g.kind != "op_mismatch" and _bare_op(g.op) == _bare_op(f.op)]
        why = "{op} is the op the ops mode found failing on this backend"
    elif culprit is not None:
        op, key = culprit
        fits = [g for g in op_findings if g.error_type and _bare_op(g.op) == _bare_op(op)
                and _key(signature(g, boilerplate=boilerplate)) == key]
        why = "its culprit is {op} alone, failing with the error the ops mode found for it"
    else:
        return None
    if len({(g.op, signature(g, boilerplate=boilerplate).id) for g in fits}) != 1:
        return None  # none, or several operators or errors that could each be the cause: no guess
    g = fits[0]
    return g, why.format(module=f.module, op=g.op)


def _key(sig: Signature) -> tuple[str, str]:
    return sig.error_type, sig.message


def links(results: Results, *, boilerplate: Collection[str] = ()) -> dict[int, tuple[Finding, str]]:
    """id(finding) -> (the ops finding whose cause it shares in its cell, why): a finding of another kind that one
    operator's failure explains is counted under that operator's cause (`_link_of`). Decided per finding and per
    cell, never per signature: a divergence in the same layer class elsewhere is not that operator's. An op finding
    of a shared cause (`shared_causes`: one torch error failing several ops) explains nothing about its op."""
    out: dict[int, tuple[Finding, str]] = {}
    for cell in results.cells:
        ops_mode = cell.modes.get("ops")
        op_findings = [g for g in ops_mode.findings if g.op] if ops_mode is not None else []
        if not op_findings:
            continue
        shared = shared_causes(op_findings, boilerplate=boilerplate)  # one torch error failing many ops: not the op's
        op_findings = [g for g in op_findings if not g.error_type or signature(g, boilerplate=boilerplate).id not in shared]
        for mode_name, mode in cell.modes.items():
            if mode_name == "ops":
                continue
            for f in mode.findings:
                link = _link_of(f, op_findings, boilerplate)
                if link is not None:
                    out[id(f)] = link
    return out


def root_causes(results: Results, *, boilerplate: Collection[str] = ()) -> list[dict[str, Any]]:
    """The distinct root causes of `results`, most findings first: ``[{signature, count, cells, raised_in,
    role, frame, error_type, message, example}]``. Also annotates every finding (`annotate`) with its group's
    signature. A cause is counted once across cells, modes and phases: the key is the error (past a backend's
    boilerplate line, `cause_line`), never the words a mode or phase wraps it in (`joined` for findings that
    kept no traceback), and a finding of another kind that an operator's failure in its cell explains is counted
    under that operator's cause (`links`; the finding says so in ``details.same_cause_as``)."""
    found = [(cell, mode_name, f, signature(f, boilerplate=boilerplate))
             for cell in results.cells for mode_name, mode in cell.modes.items() for f in mode.findings]
    group_of = joined(s for *_, s in found)
    own_of = {id(f): own for *_, f, own in found}
    linked = links(results, boilerplate=boilerplate)
    groups: dict[str, dict[str, Any]] = {}
    for cell, mode_name, f, own in found:
        sig = group_of[own.id]
        if id(f) in linked and group_of[own_of[id(linked[id(f)][0])].id].id != sig.id:  # else already one cause
            g, why = linked[id(f)]
            sig = group_of[own_of[id(g)].id]
            f.details["same_cause_as"] = {"mode": "ops", "kind": g.kind, "op": g.op, "fingerprint": g.fingerprint,
                                          "why": why}
        f.details["signature"] = sig.id
        if own.raised.package and "raised_in" not in f.details:
            f.details["raised_in"] = own.raised.words()
        g = groups.get(sig.id)
        if g is None:
            g = groups[sig.id] = {
                "signature": sig.id, "count": 0, "cells": [], "raised_in": sig.raised.words(),
                "role": sig.raised.role, "frame": sig.raised.frame, "error_type": sig.error_type,
                "message": sig.message, "kinds": [],
                "example": {"cell": cell.id, "mode": mode_name, "kind": f.kind, "module": f.module,
                            "op": f.op, "message": first_line(f.message, 300)},
            }
        g["count"] += 1
        if cell.id not in g["cells"]:
            g["cells"].append(cell.id)
        if f.kind not in g["kinds"]:
            g["kinds"].append(f.kind)
    out = list(groups.values())
    out.sort(key=lambda g: (-len(g["cells"]), -g["count"], g["signature"]))
    return out


def example_of(cause: Mapping[str, Any]) -> str:
    ex = cause.get("example") or {}
    what = ex.get("module") or ex.get("op") or ""
    return f"{ex.get('cell', '?')} {ex.get('mode', '')}" + (f" ({what})" if what else "")


# ---------------------------------------------------------------------------- the ops ranking ranks causes

def shared_causes(findings: Iterable[Finding], *, boilerplate: Collection[str] = ()) -> dict[str, Signature]:
    """The signatures of op findings that are not about an operator: one error raised in torch (Dynamo, FX,
    guard building) that fails two or more different ops. Those ops are listed under the cause in the ranking,
    not as missing operators."""
    ops: dict[str, set[str]] = {}
    sigs: dict[str, Signature] = {}
    for f in findings:
        if not (f.op and f.error_type):
            continue
        sig = signature(f, boilerplate=boilerplate)
        if sig.raised.role == "torch":
            ops.setdefault(sig.id, set()).add(f.op)
            sigs[sig.id] = sig
    return {sid: sigs[sid] for sid, names in ops.items() if len(names) > 1}


def cause_row(sig: Signature) -> dict[str, Any]:
    """The fields a ranking row for a shared cause carries besides its counts (`op` is None: no operator)."""
    return {"op": None, "cause": sig.id, "error_type": sig.error_type, "message": sig.message,
            "raised_in": sig.raised.words(), "ops": []}
