"""The settings of `deepview-ci file-issues` (`FilingOptions`), shared by the filer and the issue renderer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .client import ClientOptions

ISSUE_BODY_LIMIT = 65536  # characters; GitHub answers 422 above it


@dataclass(frozen=True, kw_only=True)
class FilingOptions:
    """Resolved `file-issues` settings (CLI flags; tests lower the waits to 0)."""

    label: str = "deepview-ci"
    opt_out_label: str = "deepview-ci:ignore"
    close_fixed: bool = True
    layers: bool = False
    min_interval: float = 1.0  # seconds between writes; GitHub asks for ≥ 1
    max_wait: float = 300.0  # longest single rate-limit wait; longer → stop and keep drafts
    max_retries: int = 4
    backoff: float = 2.0  # first wait after a 5xx/timeout, doubled each retry
    timeout: float = 30.0  # seconds per request
    body_limit: int = ISSUE_BODY_LIMIT
    drafts_dir: Path | None = None  # default: <diff folder>/issue-drafts
    extra_labels: tuple[str, ...] = ()
    max_new: int = 30  # new issues per run; the rest are drafted and said (a broken compiler must not file 500)
    write_budget: int = 400  # content-creating requests an hour (GitHub allows 500): this run's, plus the labelled
    # issues created in the hour before it (an estimate: earlier runs' comments are not counted); the rest drafted
    artifact_days: int | None = None  # the run's artifact retention, said where an issue names an artifact
    recheck_window: float = 600.0  # seconds back the re-check before each create looks (a clock skew margin)

    def __post_init__(self) -> None:
        named = [("label", self.label), ("opt-out-label", self.opt_out_label)]
        named += [("extra label", x) for x in self.extra_labels]
        for flag, value in named:
            if not value or len(value) > 50 or value != value.strip() or "," in value:
                raise ConfigError(
                    f"--{flag} {value!r} is not a usable GitHub label",
                    hint="a label is 1 to 50 characters, without commas or surrounding spaces",
                )
        if self.label.lower() == self.opt_out_label.lower():
            raise ConfigError("--label and --opt-out-label are the same label",
                              hint="the opt-out label must differ from the dedicated label")
        for name in ("min_interval", "max_wait", "backoff", "timeout"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be ≥ 0, not {getattr(self, name)}")
        if self.max_new < 0 or self.write_budget < 0:
            raise ConfigError("--max-new-issues and --write-budget must be ≥ 0")
        if self.body_limit < 2000:
            raise ConfigError(f"body limit {self.body_limit} is too small to hold an issue", hint="keep the default 65536")

    @classmethod
    def from_args(cls, args: Any) -> "FilingOptions":
        """From the `file-issues` argparse namespace; absent attributes keep their defaults."""
        kw: dict[str, Any] = {}
        for name in ("label", "opt_out_label", "close_fixed", "layers", "min_interval", "max_wait",
                     "max_retries", "backoff", "timeout", "max_new", "write_budget", "artifact_days"):
            value = getattr(args, name, None)
            if value is not None:
                kw[name] = value
        drafts = getattr(args, "drafts_dir", None)
        if drafts:
            kw["drafts_dir"] = Path(drafts)
        return cls(**kw)

    def client_options(self) -> ClientOptions:
        return ClientOptions(timeout=self.timeout, max_retries=self.max_retries, backoff=self.backoff,
                             max_wait=self.max_wait, min_write_interval=self.min_interval)
