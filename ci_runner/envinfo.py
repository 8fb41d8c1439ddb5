"""The environment stamp carried by every cell result, and `deepview-ci env`."""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from typing import Any


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def tool_version() -> str:
    from . import __version__

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
    import torch

    out: dict[str, Any] = {"cpu": {"threads": torch.get_num_threads()}}
    if torch.cuda.is_available():
        out["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    priv = torch._C._get_privateuse1_backend_name()
    if priv != "privateuseone":
        out["privateuse1"] = priv
    return out


def cell_stamp(device: str, backend_versions: dict[str, str] | None = None) -> dict[str, Any]:
    import torch

    stamp = base_stamp()
    stamp["torch"] = torch.__version__
    stamp["device"] = device
    stamp["backend"] = dict(backend_versions or {})
    if device.startswith("cuda") and torch.cuda.is_available():
        stamp["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return stamp


def env_report() -> dict[str, Any]:
    """Versions, devices and available backends, for a bug report."""
    report: dict[str, Any] = base_stamp()
    for dist in ("safetensors", "jinja2", "pyyaml", "jsonschema", "numpy", "tokenizers", "huggingface-hub"):
        report[dist] = _version(dist)
    report["executable"] = sys.executable
    try:
        report["devices"] = devices()
    except Exception as exc:  # a broken torch install is exactly what this report must show
        report["devices"] = f"unavailable: {type(exc).__name__}: {exc}"
    try:
        from .backends import available_backends

        report["backends"] = available_backends()
    except ImportError:
        report["backends"] = "unavailable in this installation"
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
