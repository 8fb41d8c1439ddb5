"""Quoting for generated code: every value that reaches a repro script or a printed command goes through here.

One function per language, so no template or f-string invents its own escaping:

- `pyrepr`: a Python literal (strings, numbers, None, bools, lists, tuples, dicts, sets); non-finite floats as
  ``float('nan')``; anything else is refused (`TypeError`), never written through its `repr`.
- `comment`: any text made safe inside a ``#`` comment: one line, printable, no encoding cookie.
- `dotted`, `identifier`: a dotted Python name (``import {{ mod|dotted }}``), a keyword argument's name; refused
  (`ValueError`) unless it is one.
- `shell_quote` / `shell_command`: a printed shell command, every word through `shlex.quote`.

`TEMPLATE_FILTERS` is what the repro templates' Jinja environment registers (`engine.repro`).
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["pyrepr", "comment", "dotted", "identifier", "shell_quote", "shell_command", "TEMPLATE_FILTERS"]


def pyrepr(value: Any) -> str:
    """A Python literal that evaluates to `value`; a `TypeError` for a value that has none."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return int.__repr__(value)  # an IntEnum's repr is not a literal
    if isinstance(value, float):
        text = float.__repr__(value)
        return text if math.isfinite(value) else f"float({text!r})"
    if isinstance(value, str):
        return str.__repr__(value)  # escapes quotes, backslashes, controls, surrogates, U+2028
    if isinstance(value, (bytes, bytearray)):
        return bytes.__repr__(bytes(value))
    if isinstance(value, os.PathLike):
        return pyrepr(os.fspath(value))
    if isinstance(value, list):
        return "[" + ", ".join(pyrepr(v) for v in value) + "]"
    if isinstance(value, tuple):
        items = [pyrepr(v) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{pyrepr(k)}: {pyrepr(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (set, frozenset)):
        if not value:
            return "set()"
        return "{" + ", ".join(sorted(pyrepr(v) for v in value)) + "}"
    raise TypeError(f"no Python literal for a {type(value).__name__} value in a generated script")


_NOT_PLAIN = re.compile(r"[^ -~]")  # anything but printable ASCII is looked at
_COOKIE = re.compile(r"coding(?=[:=])")  # PEP 263: `coding:` in a script's first two lines picks its encoding


def _escape(match: re.Match[str]) -> str:
    c = match.group()
    if c.isprintable():
        return c
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def comment(text: Any) -> str:
    """`text` safe inside a ``#`` comment: line breaks (CR, LF, U+2028…), NUL, surrogates, bidi and other
    invisible characters written as escapes, and an encoding cookie broken up."""
    return _COOKIE.sub("coding ", _NOT_PLAIN.sub(_escape, str(text)))


_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def dotted(name: Any) -> str:
    """`name` when it is a dotted Python name (``pkg.mod``), for an ``import`` line; a `ValueError` otherwise."""
    text = str(name)
    if not _DOTTED.fullmatch(text) or any(part in _KEYWORDS for part in text.split(".")):
        raise ValueError(f"not a Python module name: {text!r}")
    return text


_KEYWORDS = frozenset(__import__("keyword").kwlist)


def identifier(name: Any) -> str:
    """`name` when it is one Python identifier (a keyword argument's name); a `ValueError` otherwise."""
    text = dotted(name)
    if "." in text:
        raise ValueError(f"not a Python identifier: {text!r}")
    return text


def shell_quote(word: Any) -> str:
    """One word of a printed POSIX shell command."""
    return shlex.quote(str(word))


def shell_command(words: Iterable[Any], env: Mapping[str, str] | None = None) -> str:
    """A printed command line: ``NAME=value`` assignments first, then the words, each quoted."""
    assigns = [f"{k}={shell_quote(v)}" for k, v in (env or {}).items() if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
    return " ".join([*assigns, *(shell_quote(w) for w in words)])


TEMPLATE_FILTERS: dict[str, Callable[[Any], str]] = {
    "pyrepr": pyrepr, "comment": comment, "dotted": dotted, "identifier": identifier, "shq": shell_quote,
}
