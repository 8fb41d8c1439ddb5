"""Strict JSON from files others wrote (results, baselines, diffs, dumps, history records, plans).

`parse_json` turns any malformed input into one `InputError` (exit 3) naming the file: bytes that are not UTF-8,
invalid or truncated JSON, nesting too deep for the parser, and the non-finite numbers Python's `json` accepts
but JSON has not (``NaN``, ``Infinity``, ``1e999``): deepview-ci never writes them (`allow_nan=False`), so a file
that holds them was made or edited elsewhere. Strings with lone surrogates (``"\\ud800"``, valid JSON) come back with
U+FFFD in their place (`fsutil.utf8_text`, which every text write applies too).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from .errors import InputError
from .fsutil import utf8_text

__all__ = ["parse_json", "utf8_text", "scrub"]

MAX_INT_DIGITS = 1000  # Python refuses past 4300 digits with a ValueError; no count deepview-ci writes comes close


class _NotJson(ValueError):
    pass


def _constant(name: str) -> Any:
    raise _NotJson(f"{name}, which is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotJson(f"{text}, a number out of range")
    return value


def _int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:
        raise _NotJson(f"an integer of {len(text)} digits")
    return int(text)


def scrub(obj: Any) -> Any:
    """`obj` (parsed JSON) with `utf8_text` applied to every string, keys included."""
    if isinstance(obj, str):
        return utf8_text(obj)
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    if isinstance(obj, dict):
        return {utf8_text(k): scrub(v) for k, v in obj.items()}
    return obj


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json(data: bytes | str, *, source: str, what: str) -> Any:
    """`data` (a file's bytes or text) as strict JSON; `InputError` naming `source` and `what` it should be."""
    was_text = isinstance(data, str)
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"{source}: {what} is not UTF-8 text (byte {exc.start} is 0x{exc.object[exc.start]:02x})",
                             hint="the file is corrupt, or not the file meant; rerun the step that produced it") from None
    try:
        value = json.loads(data, parse_constant=_constant, parse_float=_float, parse_int=_int)
        if _SURROGATE_ESCAPE.search(data) is not None or (was_text and not data.isascii()):
            value = scrub(value)
    except json.JSONDecodeError as exc:
        raise InputError(f"{source}:{exc.lineno}:{exc.colno}: {what} is not valid JSON ({exc.msg})",
                         hint="the file is corrupt or truncated; rerun the step that produced it") from None
    except _NotJson as exc:
        raise InputError(f"{source}: {what} holds {exc}",
                         hint="deepview-ci never writes one: the file was made or edited elsewhere; regenerate it") from None
    except RecursionError:
        raise InputError(f"{source}: {what} is nested too deep to read",
                         hint="the file is corrupt, or not the file meant; rerun the step that produced it") from None
    return value
