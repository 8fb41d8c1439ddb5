"""Random weights for big config models in seconds, the same for the same seed (`fast_init`).

Building a transformers model from a config spent nearly all its time drawing random numbers twice: torch's own
construction-time init (`nn.Linear.reset_parameters`: `kaiming_uniform_`), then transformers' `_init_weights`,
which overwrites it (`normal_`). A 0.5B Qwen2 shape took 36 s on 2 cores, 29 s of them in those two draws.

Under `fast_init()`, a construction-time init (`torch.nn.init.*` while modules are built) of a floating CPU tensor of
at least `BIG` elements is deferred. A later init of the same tensor (transformers' `_init_weights`, or a direct
write) supersedes it; the deferred ones still pending when the build ends run then, with torch's own function, on
the tensors the model still holds (a tied-away `lm_head.weight` is skipped). Every value is still drawn by torch's
own init functions from the seeded global RNG, so the distributions are exactly transformers', and the same seed
gives the same weights. Smaller tensors are initialised as before, so a tiny config's weights are bit-identical to
a plain `from_config` under the same seed (the bundled example's numbers do not move).
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Any, Callable, Iterator

import torch

BIG = 1 << 20  # elements: smaller tensors take the construction-time init at once, as without fast_init
_RANDOM = ("uniform_", "normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
           "trunc_normal_", "orthogonal_", "sparse_")
_TORCH_MODULES = ("torch.nn.init", "torch.nn.modules.activation", "torch.nn.modules.transformer",
                  "torch.nn.modules.linear", "torch.nn.modules.loss", "torch.nn.modules.batchnorm",
                  "torch.nn.modules.conv", "torch.nn.modules.normalization", "torch.nn.modules.rnn",
                  "torch.nn.modules.sparse")

Deferred = tuple[torch.Tensor, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _big(tensor: Any) -> bool:
    return (isinstance(tensor, torch.Tensor) and not tensor.is_meta and tensor.device.type == "cpu"
            and tensor.is_floating_point() and tensor.is_contiguous() and tensor.numel() >= BIG)


def _marks(tensor: torch.Tensor) -> list[int]:
    n = tensor.numel()
    return [0, n // 2, n - 1]


def _mark(tensor: torch.Tensor) -> None:
    """NaN at a few places: any later write of the whole tensor (an init, `weight.data.normal_()`) clears them."""
    with torch.no_grad():
        flat = tensor.detach().view(-1)
        for i in _marks(tensor):
            flat[i] = math.nan


def _still_marked(tensor: torch.Tensor) -> bool:
    flat = tensor.detach().view(-1)
    return all(math.isnan(float(flat[i])) for i in _marks(tensor))


def _deferring(pending: dict[int, Deferred], active: list[bool], fn: Callable[..., Any],
               random: bool) -> Callable[..., Any]:
    """`fn` that defers a big random init while `active[0]`; a copy kept past the build (a table that captured
    it) is plain `fn` again."""
    def init_fn(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if active[0] and random and _big(tensor) and kwargs.get("generator") is None:
            _mark(tensor)
            pending[id(tensor)] = (tensor, fn, args, kwargs)
            return tensor
        pending.pop(id(tensor), None)
        return fn(tensor, *args, **kwargs)

    init_fn.__name__ = getattr(fn, "__name__", "init_fn")
    init_fn.__doc__ = getattr(fn, "__doc__", None)
    return init_fn


def _finish(pending: dict[int, Deferred], module: torch.nn.Module) -> None:
    """Run the deferred inits of the tensors `module` still holds that nothing has written since."""
    held = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    for key, (tensor, fn, args, kwargs) in list(pending.items()):
        if key in held and _still_marked(tensor):
            fn(tensor, *args, **kwargs)
    pending.clear()


@contextlib.contextmanager
def fast_init() -> Iterator[Callable[[torch.nn.Module], None]]:
    """Build a model inside, then call the yielded `finish(model)` on it before leaving: it runs the construction-
    time inits nothing superseded. The torch init functions are restored on every exit path."""
    _import_transformers_init()
    pending: dict[int, Deferred] = {}
    active = [True]
    originals = {name: getattr(torch.nn.init, name) for name in dir(torch.nn.init)
                 if name.endswith("_") and not name.startswith("_") and callable(getattr(torch.nn.init, name))}
    saved: list[tuple[Any, str, Any]] = []
    try:
        for mod_name in _TORCH_MODULES:
            mod = sys.modules.get(mod_name)
            for name, fn in originals.items():
                if mod is not None and getattr(mod, name, None) is fn:
                    saved.append((mod, name, fn))
                    setattr(mod, name, _deferring(pending, active, fn, name in _RANDOM))
        yield lambda module: _finish(pending, module)
    finally:
        active[0] = False
        for mod, name, fn in reversed(saved):
            setattr(mod, name, fn)


def _import_transformers_init() -> None:
    """transformers >= 5 records the torch init functions in a table when `transformers.initialization` is first
    imported: import it before they are patched, so it never records the deferring copies."""
    with contextlib.suppress(ImportError):
        import transformers.initialization  # noqa: F401  (deferred: transformers is heavy, seconds)
