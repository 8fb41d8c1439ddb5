"""The environment stamp carried by every cell result, and `deepview-ci env`."""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from typing import Any, Callable

from .. import __version__


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def tool_version() -> str:
    return _version("deepview-ci") or __version__


def base_stamp() -> dict[str, Any]:
    """Cheap stamp without importing torch (for the parent process)."""
    return {
        "deepview_ci": tool_version(),
        "python": platform.python_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "torch": _version("torch"),
        "transformers": _version("transformers"),
    }


def devices() -> dict[str, Any]:
    import torch  # deferred: the parent process and `deepview-ci env` on a broken torch must not need it

    out: dict[str, Any] = {"cpu": {"threads": torch.get_num_threads()}}
    if torch.cuda.is_available():
        out["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    priv = torch._C._get_privateuse1_backend_name()
    if priv != "privateuseone":
        out["privateuse1"] = priv
    return out


def cell_stamp(device: str, backend_versions: dict[str, str] | None = None) -> dict[str, Any]:
    import torch  # deferred: torch

    stamp = base_stamp()
    stamp["torch"] = torch.__version__
    stamp["device"] = device
    stamp["backend"] = dict(backend_versions or {})
    if device.startswith("cuda") and torch.cuda.is_available():
        stamp["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return stamp


def env_report(list_backends: Callable[[], list[dict[str, str]]]) -> dict[str, Any]:
    """Versions, devices and the backends `list_backends()` finds (`backends.available_backends`), for a bug report."""
    report: dict[str, Any] = base_stamp()
    for dist in ("safetensors", "jinja2", "pyyaml", "jsonschema", "numpy", "tokenizers", "huggingface-hub"):
        report[dist] = _version(dist)
    report["executable"] = sys.executable
    try:
        report["devices"] = devices()
    except Exception as exc:  # a broken torch install is exactly what this report must show
        report["devices"] = f"unavailable: {type(exc).__name__}: {exc}"
    try:
        report["backends"] = list_backends()
    except Exception as exc:  # a broken torch or plugin install: show what broke
        report["backends"] = f"unavailable: {type(exc).__name__}: {exc}"
    return report


def format_env(report: dict[str, Any]) -> str:
    lines = []
    for key, value in report.items():
        if key == "backends" and isinstance(value, list):
            lines.append("backends:")
            for b in value:
                lines.append(f"  - {b.get('name')} ({b.get('kind')}): {b.get('description', '')}")
        else:
            lines.append(f"{key}: {value}")
    return "\n".join(lines)
