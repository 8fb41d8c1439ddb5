"""`python -m ci_runner.procs.script FOLDER SCRIPT`: run SCRIPT as `cd FOLDER && python SCRIPT` would.

The entry a warm server (`procs/warm.py`) forks to verify a repro script without importing torch again: the
child changes to FOLDER, sees the `sys.path` a fresh `python SCRIPT` would (the script's folder, the PYTHONPATH of
its own environment, then the interpreter's own entries: never the folders the server was given), and runs the
script as `__main__`. Only what the server imported before the fork (torch, Dynamo, transformers, this package's
engine) is already imported; a plugin or a model module is imported by the script, from its own path.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

from . import warm


def script_path(script: str, pythonpath: str | None, base: list[str]) -> list[str]:
    """`sys.path` for `python SCRIPT` run from the current folder with PYTHONPATH `pythonpath`."""
    return list(dict.fromkeys([os.path.dirname(os.path.abspath(script)), *warm.pythonpath_entries(pythonpath), *base]))


def main(argv: list[str]) -> None:
    folder, script = argv
    os.chdir(folder)
    sys.path[:] = script_path(script, os.environ.get("PYTHONPATH"), warm.BASE_PATH or sys.path[1:])
    sys.argv = [script]
    target = os.path.abspath(script)
    try:
        runpy.run_path(target, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # the traceback `python SCRIPT` prints: from the script's frame on, status 1
        tb = exc.__traceback__
        while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != target:
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb or exc.__traceback__)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
