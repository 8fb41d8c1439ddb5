"""What a backend's error text says: the op it names as unsupported or missing.

The patterns every mode and every repro agree on: the sims' and many vendor compilers' ``unsupported operator X``
(`UNSUPPORTED_RE`), PyTorch's dispatcher ``Could not run 'aten::X' with arguments from the 'dev' backend``
(`COULD_NOT_RUN_RE`, simdev and real PrivateUse1 plugins) and, as the last resort, any ATen/prims name
(`ATEN_NAME_RE`).
"""

from __future__ import annotations

import re

__all__ = ["UNSUPPORTED_RE", "COULD_NOT_RUN_RE", "ATEN_NAME_RE", "unsupported_op_from_error", "named_op_from_error"]

# `unsupported operator aten.softplus.default` (the sims' and many vendor compilers' wording)
UNSUPPORTED_RE = re.compile(r"unsupported operator (?P<op>[A-Za-z_](?:[\w.]*\w)?)")
# PyTorch's dispatcher error for an eager device without the kernel (simdev, real PrivateUse1 plugins)
COULD_NOT_RUN_RE = re.compile(r"Could not run '(?P<op>[\w:.]+)' with arguments from the '(?P<backend>[^']+)' backend")
# any ATen/prims name in an error text (`aten::softplus`, `aten.rsqrt.default`): the last resort
ATEN_NAME_RE = re.compile(r"\b(?P<op>(?:aten|prims)(?:::|\.)[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")


def unsupported_op_from_error(text: str) -> str | None:
    """The overload (`aten.rsqrt.out`) an error text says is unsupported (the sims' `unsupported operator X` or
    PyTorch's `Could not run 'aten::X'` format), else None."""
    m = UNSUPPORTED_RE.search(text)
    if m:
        return m.group("op")
    m = COULD_NOT_RUN_RE.search(text)
    if m:
        return _overload(m.group("op"))
    return None


def named_op_from_error(text: str) -> tuple[str | None, str | None]:
    """(op overload, the phrase naming it) from a backend's error text, also from any ATen name in it;
    (None, None) when none is named."""
    for pattern in (UNSUPPORTED_RE, COULD_NOT_RUN_RE, ATEN_NAME_RE):
        m = pattern.search(text)
        if m:
            op = m.group("op")
            return (op if pattern is UNSUPPORTED_RE else _overload(op)), m.group(0)
    return None, None


def _overload(name: str) -> str:
    name = name.replace("::", ".")
    return name if name.count(".") >= 2 else f"{name}.default"
