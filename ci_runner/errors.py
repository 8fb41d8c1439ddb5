"""One error root for the whole tool, with one documented exit code per class.

`cli.main()` (and the cell worker's own entry, `run.execute.worker_main`) catches `DeepviewError` once and
prints it with `report_error`; nothing else in the package prints tracebacks for expected failures.

Exit codes (also in the README):

==== ============================================================================
code meaning
==== ============================================================================
0    success: everything ran and nothing failed the chosen policy
1    findings: a cell failed, or `diff` found regressions under `--fail-on`
2    usage or configuration error (bad CLI arguments, malformed/unknown matrix keys)
3    input error: a results/baseline/dump file is missing, corrupt or of another schema
4    environment error: a model, backend or plugin could not be loaded (`run`/`cell`: every cell that did not
     pass failed to load its model or backend)
5    execution error: the runner itself failed (cannot write output, cannot spawn)
6    GitHub API error: issues could not be filed (drafts were kept), or the PR comment could not be posted
7    busy: another run is writing the same output folder (its lock, `OUT/.deepview-ci.lock`, is held)
130  interrupted (Ctrl-C); everything finished so far is on disk
==== ============================================================================
"""

from __future__ import annotations

import sys

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_INPUT = 3
EXIT_ENVIRONMENT = 4
EXIT_EXECUTION = 5
EXIT_GITHUB = 6
EXIT_BUSY = 7
EXIT_INTERRUPTED = 130


class DeepviewError(Exception):
    """Root of every expected failure. `hint` says what to do about it."""

    exit_code: int = EXIT_EXECUTION

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\n  hint: {self.hint}"
        return self.message


class ConfigError(DeepviewError):
    """A matrix file or a CLI argument is wrong."""

    exit_code = EXIT_USAGE


class OptionError(ConfigError):
    """A mode option (`options.<mode>.<key>`) is unknown or has a bad value; `key` names it."""

    def __init__(self, message: str, *, hint: str | None = None, key: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.key = key


class UsageError(ConfigError):
    """The command line is wrong."""


class InputError(DeepviewError):
    """A results, baseline, thresholds or dump file is missing or corrupt."""

    exit_code = EXIT_INPUT


class NewerFileError(InputError):
    """A file written by a newer deepview-ci (a history database or record): readable by that version, so a writer
    of this one leaves it alone."""


class EnvironmentSetupError(DeepviewError):
    """A model, backend, device or plugin cannot be loaded."""

    exit_code = EXIT_ENVIRONMENT


class ModelLoadError(EnvironmentSetupError):
    """A model source cannot be built."""


class BackendError(EnvironmentSetupError):
    """A backend spec cannot be resolved (unknown compiler, device or plugin)."""


class TorchTooOldError(EnvironmentSetupError):
    """A feature needs a newer torch than the installed one; in a cell, its mode is `skipped` with this reason."""

    def __init__(self, message: str, *, needs: str) -> None:
        super().__init__(message, hint=f"install torch>={needs} to use it")
        self.needs = needs


class ExecutionError(DeepviewError):
    """The runner itself failed."""

    exit_code = EXIT_EXECUTION


class RunBusyError(ExecutionError):
    """Another live run holds the output folder's lock (`run/resume.run_lock`): this one refuses, touching nothing."""

    exit_code = EXIT_BUSY


class GitHubError(DeepviewError):
    """The GitHub API refused or failed; drafts are kept on disk."""

    exit_code = EXIT_GITHUB


def report_error(exc: DeepviewError) -> int:
    """Print `exc` as the tool's one error line on stderr; its exit code."""
    print(f"deepview-ci: error: {exc}", file=sys.stderr)
    return exc.exit_code
