"""Text from compilers and children of any size: every parse over it is linear (one long token, a run of blank lines,
many unended MLIR types), so a 1 MB message takes well under a second, never minutes."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from ci_runner.backends.errortext import named_op_from_error, unsupported_op_from_error
from ci_runner.failures.diagnostics import compiler_diagnostics
from ci_runner.watch.dynamotrace import changed_input
from ci_runner.failures.failure import first_line, headline, tail
from ci_runner.results.rootcause import cause_line, error_signature, frames, normalize_text, raised_in

N = 200_000
TOKENS = {
    "word": "H" * N, "hex": "a" * N + "G", "digits": "1" * N, "dots": "." * N, "slashes": "/" * N, "blank": "\n" * N,
    "spaces": " " * N, "us": "_1" * (N // 2), "pct": "%a" * (N // 2), "types": "}> : (" * (N // 5),
    "tmp": "/tmp" + "a" * N, "pid": "pid" + " " * N, "frames": 'File "' * (N // 6), "colons": "x.mlir:1:" * (N // 9),
    "quotes": '"' * N, "parens": "(" * N, "lt": "<" * N, "ops": "aten." * (N // 5),
}
PARSERS: dict[str, Callable[[str], object]] = {
    "normalize_text": normalize_text, "frames": frames, "raised_in": raised_in, "cause_line": cause_line,
    "error_signature": lambda t: error_signature("RuntimeError", t, t), "unsupported_op": unsupported_op_from_error,
    "named_op": named_op_from_error, "compiler_diagnostics": compiler_diagnostics, "changed_input": changed_input,
    "first_line": first_line, "headline": headline, "tail": tail,
}


def test_normalize_text_of_one_megabyte_token_is_fast() -> None:
    t0 = time.perf_counter()
    normalize_text("RuntimeError: " + "H" * 1_000_000)
    assert time.perf_counter() - t0 < 2.0  # about 0.2 s here; 7.5 s at 20 kB before


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_every_parser_is_linear_on_long_tokens(parser: str) -> None:
    fn = PARSERS[parser]
    slow = {}
    for name, token in TOKENS.items():
        t0 = time.perf_counter()
        fn("RuntimeError: " + token)
        took = time.perf_counter() - t0
        if took > 1.5:
            slow[name] = round(took, 2)
    assert not slow, slow


def test_function_types_rule_unchanged() -> None:
    text = ("loc.mlir:3:7: error: 'torch.aten.add' op failed %12 = torch.aten.add %a1 {x = 1 : i64}> : "
            "(!torch.vtensor<[8],f32>) -> !torch.vtensor<[8],f32>\n}> : (no end")
    assert normalize_text(text) == ("<LOC>: error: 'torch.aten.add' op failed %<N> = torch.aten.add %<N> {x = 1 : i64}>"
                                    " : <TYPES>\n}> : (no end")
