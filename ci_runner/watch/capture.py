"""One hook mechanism for every mode: forward (pre-)hooks on every submodule, always removed.

The hooks are registered and removed by `watch/hooks.py` (`ModuleHooks`, the package's one place that hooks a
module). Two ways to use them here, one per kind of run:

* **eager** (`ModuleCapture`): pre and post hooks with callbacks, or recorded calls. Every call of every
  submodule is seen separately (modules called several times per forward exist), under its qualified name, with
  its inputs. Callbacks never break the run they observe: an exception inside one is recorded in `errors` and the
  forward goes on.
* **compiled** (`OutputHooks`): forward hooks that only append `(name, flat output tensors)` to one process-wide
  list. Dynamo traces such hooks into the compiled graph without a graph break, so the tensors are the backend's
  own outputs (fusions and all). The same hooks work eagerly too.

**In-place rule.** A capture holds what the module returned, not what later code made of it: ResNet's basic layer
does `hidden_state += residual` on its BatchNorm's output after the hook ran, Falcon's parallel block
`mlp_output += attention_output` on its MLP's. Eager captures copy at the hook (`detach_tree`, the dump writer) and
`VersionWatch` says which outputs were changed later (version counters, checked until no one can write them). Compiled
hooks cannot read version counters while Dynamo traces them, so `OutputHooks(clone=…)` copies inside the graph the
outputs of the modules named (those an eager pass saw changed in place later: `VersionWatch.moved`), or all.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator

import torch
from torch import nn

from .hooks import ModuleHooks

PreCallback = Callable[["CallInfo", tuple[Any, ...], dict[str, Any]], None]
PostCallback = Callable[["CallInfo", tuple[Any, ...], dict[str, Any], Any], None]


@dataclass(frozen=True)
class CallInfo:
    name: str  # qualified module name; "" is the root
    module_class: str
    call_index: int  # 0 for the first call of this module in this capture
    order: int  # global position of the call's start among all captured calls
    depth: int


@dataclass
class CallRecord:
    info: CallInfo
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    output: Any = None


def detach_tree(obj: Any, *, clone: bool = True) -> Any:
    """Detached (cloned) copy of nested tensors, for recording without aliasing later in-place updates."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.clone() if clone else t
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(detach_tree(v, clone=clone) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(detach_tree(v, clone=clone) for v in obj)
    if isinstance(obj, dict):
        return {k: detach_tree(v, clone=clone) for k, v in obj.items()}
    if hasattr(obj, "to_tuple") and hasattr(obj, "keys"):  # transformers ModelOutput
        return {k: detach_tree(obj[k], clone=clone) for k in obj.keys()}
    return obj


class ModuleCapture:
    """Context manager: hooks on `model` and every submodule (or those `include` accepts).

    Either pass callbacks (`pre`, `post`) to act on the fly, or `record_inputs` / `record_outputs`
    to keep `CallRecord`s (detached clones) in `records`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        pre: PreCallback | None = None,
        post: PostCallback | None = None,
        record_inputs: bool = False,
        record_outputs: bool = False,
        include: Callable[[str, nn.Module], bool] | None = None,
    ) -> None:
        self._model_ref = weakref.ref(model)
        self._pre = pre
        self._post = post
        self._record_inputs = record_inputs
        self._record_outputs = record_outputs
        self._include = include
        self._hooks: ModuleHooks | None = None
        self._names: dict[int, tuple[str, int]] = {}
        self._counts: dict[str, int] = {}
        self._stack: list[CallRecord] = []
        self._order = 0
        self.records: list[CallRecord] = []
        self.errors: list[tuple[str, BaseException]] = []
        self.entered: list[str] = []  # names in call order, for journals

    def __enter__(self) -> "ModuleCapture":
        model = self._model_ref()
        if model is None:
            raise RuntimeError("model was garbage-collected before capture")
        modules = [(n, m) for n, m in model.named_modules() if self._include is None or self._include(n, m)]
        for name, module in modules:
            self._names[id(module)] = (name, 0 if name == "" else name.count(".") + 1)
        self._hooks = ModuleHooks(modules, pre=lambda name: self._on_pre, post=lambda name: self._on_post,
                                  post_kwargs=True, always_call=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._hooks is not None:
            self._hooks.remove()
        self._stack.clear()

    # hooks ------------------------------------------------------------------------------
    def _on_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name, depth = self._names.get(id(module), ("?", 0))
        idx = self._counts.get(name, 0)
        self._counts[name] = idx + 1
        info = CallInfo(name=name, module_class=type(module).__name__, call_index=idx, order=self._order, depth=depth)
        self._order += 1
        rec = CallRecord(info=info)
        if self._record_inputs:
            rec.args = detach_tree(args)
            rec.kwargs = detach_tree(kwargs)
        self._stack.append(rec)
        self.entered.append(name)
        if self._pre is not None:
            try:
                self._pre(info, args, kwargs)
            except Exception as exc:  # never break the observed run
                self.errors.append((name, exc))

    def _on_post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not self._stack:
            return
        rec = self._stack.pop()
        if self._record_outputs:
            rec.output = detach_tree(output)
        if self._record_inputs or self._record_outputs:
            self.records.append(rec)
        if self._post is not None:
            try:
                self._post(rec.info, args, kwargs, output)
            except Exception as exc:
                self.errors.append((rec.info.name, exc))

    def by_name(self) -> dict[str, list[CallRecord]]:
        out: dict[str, list[CallRecord]] = {}
        for r in sorted(self.records, key=lambda r: r.info.order):
            out.setdefault(r.info.name, []).append(r)
        return out


class VersionWatch:
    """Which captured tensors are changed in place after their hook: (key, tensor, version) per tensor.

    It does not depend on a later hook: a tensor is held (a strong reference) for as long as anyone else may still
    write it, and let go (its version checked first) once the watch is its only holder, with no view of it left
    (`check()`, from every hook, keeps that short; no memory is kept beyond what the model itself keeps). What is
    still held at the end is checked by `moved()`, once after the forward. So Falcon's parallel block, which does
    `mlp_output += attention_output` after the MLP's hook and frees that tensor before any later hook fires, is
    seen; with weak references it was lost with the tensor (issue 38)."""

    def __init__(self) -> None:
        self._watched: list[list[Any]] = []  # [key, tensor, version]
        self._moved: set[str] = set()

    def watch(self, key: str, tensors: Any) -> None:
        for t in tensors:
            try:
                self._watched.append([key, t, t._version])
            except (TypeError, RuntimeError):  # a tensor kind without a version counter
                continue

    def check(self) -> None:
        """Note the moved tensors (each is then no longer watched); let go of those only the watch holds."""
        keep = []
        for entry in self._watched:
            if entry[1]._version != entry[2]:
                self._moved.add(entry[0])
            elif not _only_held_by(entry):
                keep.append(entry)
        self._watched = keep

    def held(self) -> int:
        """How many tensors the watch holds now."""
        return len(self._watched)

    def moved(self) -> set[str]:
        for entry in self._watched:
            if entry[1]._version != entry[2]:
                self._moved.add(entry[0])
        out, self._moved, self._watched = self._moved, set(), []
        return out


def _only_held_by(entry: list[Any]) -> bool:
    """Whether `entry[1]` is referenced by `entry` alone: no Python reference elsewhere and no view of it (a view
    holds its base's TensorImpl, `_use_count`); such a tensor can no longer be written. Unsure: False (kept)."""
    try:
        return sys.getrefcount(entry[1]) <= _SOLE_REFS and entry[1]._use_count() <= 1
    except (AttributeError, RuntimeError):
        return False


def _sole_refs() -> int:
    probe = [None, torch.empty(0), 0]
    return sys.getrefcount(probe[1])


_SOLE_REFS = _sole_refs()  # what getrefcount says of a tensor held by one list only (the interpreter's own count)


def iter_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Flatten tensors out of tensors/tuples/lists/dicts/ModelOutput, with stable sub-names; caches skipped."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict) or (hasattr(obj, "keys") and hasattr(obj, "__getitem__") and not isinstance(obj, (str, bytes))):
        for k in obj.keys():
            if k in ("past_key_values", "cache_params") or "cache" in str(k):
                continue
            yield from iter_tensors(obj[k], f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{prefix}.{i}" if prefix else str(i))


def primary_tensor(obj: Any) -> torch.Tensor | None:
    """The module's main output: the tensor itself, or the first floating tensor in it."""
    for _, t in iter_tensors(obj):
        if t.is_floating_point() or t.is_complex():
            return t
    for _, t in iter_tensors(obj):
        return t
    return None


def flatten_traceable(obj: Any, prefix: str, acc: list[tuple[str, torch.Tensor]]) -> None:
    """`iter_tensors` in a form Dynamo traces without a graph break (same sub-names, caches skipped)."""
    if isinstance(obj, torch.Tensor):
        acc.append((prefix, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("past_key_values", "cache_params") or "cache" in str(k):
                continue
            flatten_traceable(v, prefix + "." + str(k) if prefix else str(k), acc)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            flatten_traceable(v, prefix + "." + str(i) if prefix else str(i), acc)


def _signature_leaves(obj: Any, prefix: str, parts: list[str]) -> None:
    if isinstance(obj, torch.Tensor):
        return  # tensors: their shapes are checked and their values compared, not keyed on
    if obj is None or isinstance(obj, (bool, str)):
        parts.append(prefix + "=" + type(obj).__name__ + ":" + str(obj))
    elif isinstance(obj, (int, float)):
        parts.append(prefix + "=" + type(obj).__name__)  # a size may be symbolic when compiled: its type only
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("past_key_values", "cache_params") or "cache" in str(k):
                continue
            _signature_leaves(v, prefix + "." + str(k), parts)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _signature_leaves(v, prefix + "." + str(i), parts)
    else:
        parts.append(prefix + "=" + type(obj).__name__)


def call_signature(args: Any, kwargs: Any) -> str:
    """What a module call is, besides its tensors' values: its non-tensor inputs (strings, flags and None by value,
    numbers and other objects by type) with their places. ModernBERT calls its rotary embedding once per
    `layer_type`, in an order that depends on the process's hash seed (issue 45): the calls' signatures
    (`args.2=str:full_attention`, `args.2=str:sliding_attention`) tell them apart where their index does not.
    Traceable by Dynamo (constants only), so a stub or hook inside a compiled graph can compute it."""
    parts: list[str] = []
    _signature_leaves(args, "args", parts)
    _signature_leaves(kwargs, "kwargs", parts)
    return ";".join(parts)


def call_key(name: str, call_index: int) -> str:
    """`name` for the first call of a module, `name#k` for its k-th later call."""
    return name if call_index == 0 else f"{name}#{call_index}"


FlatOutput = tuple[tuple[str, torch.Tensor], ...]

# One module-level list that every output hook appends to. Dynamo does not guard on hooks by default
# (`skip_nnmodule_hook_guards`): a graph traced with an earlier set of hooks is reused for a same-shaped model and
# replays ITS appends. Appending to this one list, never replaced, keeps that replay pointed at the current capture.
_OUTPUT_SINK: list[tuple[str, FlatOutput, str]] = []  # (module name, flat output, `call_signature`)
_OUTPUT_HOOKS: dict[tuple[str, bool], Callable[..., None]] = {}


def _output_hook(name: str, clone: bool) -> Callable[..., None]:
    """The hook for module `name`: one function object per (name, clone) for the whole process, so that guards on
    hooks (`skip_nnmodule_hook_guards=False` while capturing) hold from one capture to the next. With `clone` the
    tensors are copied at the hook (in the graph, when compiled): later in-place updates do not reach them."""
    hook = _OUTPUT_HOOKS.get((name, clone))
    if hook is None:
        def hook(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            acc: list[tuple[str, torch.Tensor]] = []
            flatten_traceable(output, "", acc)  # now: the model may mutate a returned ModelOutput later
            if clone:
                acc = [(k, t.clone()) for k, t in acc]
            # what the call is (constants at trace time): calls are matched by it, not by order (`CallMatcher`)
            _OUTPUT_SINK.append((name, tuple(acc), call_signature(args, kwargs)))

        _OUTPUT_HOOKS[(name, clone)] = hook
    return hook


class OutputHooks:
    """Forward hooks on every submodule of `module` that only append `(name, flat output)`; traceable by Dynamo.

    Use as a context manager (the hooks are always removed), or call `remove()`. The output is flattened inside
    the hook (the sub-names of `iter_tensors`, caches skipped) because a model may mutate a returned ModelOutput
    afterwards. `take()` returns and clears what was recorded; only one capture runs at a time per process.

    `clone`: the modules whose output tensors are copied at the hook (True: all; see the in-place rule in the
    module docstring). Copying costs one extra tensor per captured output, so compiled captures copy only the
    outputs an eager pass saw changed in place later, when such a pass exists.
    """

    def __init__(self, module: nn.Module, *, clone: bool | Collection[str] = ()) -> None:
        self.records = _OUTPUT_SINK
        self.records.clear()
        self.hooks = ModuleHooks(module.named_modules(), post_kwargs=True, post=lambda name: _output_hook(
            name, clone is True or (clone is not False and name in clone)))
        self.signatures: dict[str, tuple[str, str]] = {}  # call key -> (module name, `call_signature`), last `take`

    def __enter__(self) -> "OutputHooks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        self.hooks.remove()
        self.records.clear()

    def take(self) -> list[tuple[str, FlatOutput]]:
        """The recorded calls as `(call key, flat output)` in completion order (the k-th call of a module is
        `name#k`). Empties the record (the same list object, always: compiled graphs append to it)."""
        records = list(self.records)
        self.records.clear()
        counts: dict[str, int] = {}
        out = []
        self.signatures = {}
        for name, flat, sig in records:
            k = counts.get(name, 0)
            counts[name] = k + 1
            out.append((call_key(name, k), flat))
            self.signatures[out[-1][0]] = (name, sig)
        return out
