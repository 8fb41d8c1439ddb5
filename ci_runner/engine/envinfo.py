"""The environment stamp carried by every cell result, and `deepview-ci env`."""

from __future__ import annotations

import json
import platform
import re
import sys
import sysconfig
from importlib import metadata, util
from pathlib import Path
from typing import Any, Callable, Iterable
from urllib.parse import unquote, urlparse

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


def _git_head(folder: Path) -> str | None:
    """The commit checked out in the git work tree holding `folder`, read from its files (no git process)."""
    for top in (folder, *folder.parents):
        dot = top / ".git"
        if dot.is_file():  # a linked worktree or submodule: "gitdir: PATH"
            text = dot.read_text(encoding="utf-8", errors="replace").strip()
            dot = (top / text[len("gitdir:"):].strip()) if text.startswith("gitdir:") else dot
        if dot.is_dir():
            return _read_head(dot)
    return None


def _read_head(git_dir: Path) -> str | None:
    head = (git_dir / "HEAD").read_text(encoding="utf-8", errors="replace").strip()
    if not head.startswith("ref:"):
        return head if re.fullmatch(r"[0-9a-f]{40,64}", head) else None
    ref = head[4:].strip()
    common = git_dir / (git_dir / "commondir").read_text().strip() if (git_dir / "commondir").is_file() else git_dir
    for base in (git_dir, common):
        loose = base / ref
        if loose.is_file():
            return loose.read_text(encoding="utf-8", errors="replace").strip() or None
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text(encoding="utf-8", errors="replace").splitlines():
            sha, _, name = line.partition(" ")
            if name.strip() == ref:
                return sha
    return None


def _installed_roots() -> set[Path]:
    paths = sysconfig.get_paths()
    return {Path(p).resolve() for p in (paths.get("purelib"), paths.get("platlib")) if p}


def source_stamp(module: str) -> dict[str, Any] | None:
    """Where backend plugin `module` comes from: the package that provides it, its version, and its commit when it was
    installed from git (PEP 610 ``direct_url.json`` ``vcs_info.commit_id``), from a local folder or editable
    (``git rev-parse HEAD`` there), or is imported straight from a git checkout (``from``: vcs | editable | dir | checkout)."""
    top = module.split(".")[0]
    out: dict[str, Any] = {}
    for dist_name in metadata.packages_distributions().get(top, []):
        dist = metadata.distribution(dist_name)
        out.update(package=dist.metadata["Name"], version=dist.version)
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        url = str(direct.get("url") or "")
        vcs = direct.get("vcs_info") or {}
        if vcs.get("commit_id"):
            out.update(commit=vcs["commit_id"], url=url, **{"from": "vcs"})
        elif url.startswith("file://"):
            head = _git_head(Path(unquote(urlparse(url).path)))
            kind = "editable" if (direct.get("dir_info") or {}).get("editable") else "dir"
            if head:
                out.update(commit=head, **{"from": kind})
        break
    if "commit" not in out:
        spec = util.find_spec(top)
        where = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else (spec.origin if spec else None)
        if where and where not in ("built-in", "frozen"):
            folder = Path(where).resolve()
            folder = folder if folder.is_dir() else folder.parent
            if not any(r == folder or r in folder.parents for r in _installed_roots()):
                head = _git_head(folder)
                if head:
                    out.update(commit=head, **{"from": "checkout"})
    return {"module": top, **out} if out else None


def plugin_modules(compile_target: str | None, imports: Iterable[str]) -> list[str]:
    """The plugin modules of a backend spec: its ``import`` list and the module of a ``module:function`` compile."""
    mods = [m.split(".")[0] for m in imports]
    if compile_target and ":" in compile_target:
        mods.append(compile_target.split(":", 1)[0].split(".")[0])
    return [m for i, m in enumerate(mods) if m not in mods[:i] and m != "ci_runner"]


def cell_stamp(device: str, backend_versions: dict[str, str] | None = None,
               plugins: Iterable[str] = ()) -> dict[str, Any]:
    """The cell's env; `plugins` (module names) get their source under ``backend_source`` (`source_stamp`)."""
    import torch  # deferred: torch

    stamp = base_stamp()
    stamp["torch"] = torch.__version__
    stamp["device"] = device
    stamp["backend"] = dict(backend_versions or {})
    sources = {m: s for m in plugins if (s := _safe_source(m))}
    if sources:
        stamp["backend_source"] = sources
    if device.startswith("cuda") and torch.cuda.is_available():
        stamp["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return stamp


def _safe_source(module: str) -> dict[str, Any] | None:
    try:
        return source_stamp(module)
    except (ImportError, ValueError, OSError, KeyError):  # a stamp never fails the cell
        return None


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
