"""Random weights for big config models in seconds, the same for the same seed (`fast_init`).

Building a transformers model from a config spent nearly all its time drawing random numbers twice: torch's own
construction-time init (`nn.Linear.reset_parameters`: `kaiming_uniform_`), then transformers' `_init_weights`,
which overwrites it (`normal_`). A 0.5B Qwen2 shape took 36 s on 2 cores, 29 s of them in those two draws.

Under `fast_init()`, a construction-time init (`torch.nn.init.*` while modules are built) of a floating CPU tensor of
at least `BIG` elements is deferred, and so is every later one of any size once such a big tensor was seen (a big
model's sub-`BIG` attention projections were drawn twice too: 44M uniform values at 0.5B, single-threaded). A later
init of the same tensor (transformers' `_init_weights`, or a direct write) supersedes it; the deferred ones still
pending when the build ends run then, with torch's own function, on the tensors the model still holds (a tied-away
`lm_head.weight` is skipped). transformers' own `normal_` (>= 5,
through its `TORCH_INIT_FUNCTIONS` table) fills such a tensor on every intra-op thread (`parallel_normal_`:
fixed chunks, each with a generator seeded from one draw of the seeded global RNG). The distributions are exactly
transformers', and the same seed gives the same weights on any number of threads. In a model with no tensor of
`BIG` elements, every tensor is initialised as before, so a tiny config's weights are bit-identical to a plain
`from_config` under the same seed (the bundled example's numbers do not move).
"""

from __future__ import annotations

import contextlib
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch

BIG = 1 << 20  # elements: smaller tensors take the construction-time init at once, as without fast_init
CHUNK = 1 << 22  # elements per generator in `parallel_normal_`
_RANDOM = ("uniform_", "normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
           "trunc_normal_", "orthogonal_", "sparse_")
_TORCH_MODULES = ("torch.nn.init", "torch.nn.modules.activation", "torch.nn.modules.transformer",
                  "torch.nn.modules.linear", "torch.nn.modules.loss", "torch.nn.modules.batchnorm",
                  "torch.nn.modules.conv", "torch.nn.modules.normalization", "torch.nn.modules.rnn",
                  "torch.nn.modules.sparse")

Deferred = tuple[torch.Tensor, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _deferrable(tensor: Any) -> bool:
    return (isinstance(tensor, torch.Tensor) and not tensor.is_meta and tensor.device.type == "cpu"
            and tensor.is_floating_point() and tensor.is_contiguous() and tensor.numel() > 0)


def _big(tensor: Any) -> bool:
    return _deferrable(tensor) and tensor.numel() >= BIG


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
    """`fn` that defers a big random init while `active[0]` (and any random init once `active[1]`: a big one was
    deferred); a copy kept past the build (a table that captured it) is plain `fn` again."""
    def init_fn(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if (active[0] and random and kwargs.get("generator") is None
                and (_big(tensor) or (active[1] and _deferrable(tensor)))):
            active[1] = True  # from now on a big model: smaller tensors are deferred too
            _mark(tensor)
            pending[id(tensor)] = (tensor, fn, args, kwargs)
            return tensor
        pending.pop(id(tensor), None)
        return fn(tensor, *args, **kwargs)

    init_fn.__name__ = getattr(fn, "__name__", "init_fn")
    init_fn.__doc__ = getattr(fn, "__doc__", None)
    return init_fn


def parallel_normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """`tensor.normal_(mean, std)` on all intra-op threads: fixed chunks of `CHUNK` elements, chunk i drawn from its
    own generator seeded `base + i`, `base` drawn from the global RNG. The values depend on the seed only, not on
    the number of threads."""
    base = int(torch.randint(0, 2**62, (1,)).item())
    flat = tensor.detach().view(-1)
    n = flat.numel()

    def fill(i: int) -> None:
        gen = torch.Generator().manual_seed(base + i)
        flat[i * CHUNK: (i + 1) * CHUNK].normal_(mean, std, generator=gen)

    chunks = range(-(-n // CHUNK))
    with torch.no_grad(), ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
        list(pool.map(fill, chunks))  # torch releases the GIL while it draws
    return tensor


def _drawing(active: list[bool], fn: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' `normal_` (its table entry): big tensors drawn by `parallel_normal_` while `active[0]`."""
    def normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, generator: Any = None) -> Any:
        if active[0] and generator is None and _big(tensor):
            return parallel_normal_(tensor, float(mean), float(std))
        return fn(tensor, mean=mean, std=std, generator=generator)

    return normal_


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
    table = _transformers_table()
    pending: dict[int, Deferred] = {}
    active = [True, False]  # building; a big tensor was deferred
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
        if table is not None and "normal_" in table:
            saved.append((table, "normal_", table["normal_"]))
            table["normal_"] = _drawing(active, table["normal_"])
        yield lambda module: _finish(pending, module)
    finally:
        active[0] = False
        for mod, name, fn in reversed(saved):
            if isinstance(mod, dict):
                mod[name] = fn
            else:
                setattr(mod, name, fn)


def _transformers_table() -> dict[str, Any] | None:
    """transformers >= 5: the table through which its init functions call torch's (`TORCH_INIT_FUNCTIONS`),
    recorded when `transformers.initialization` is first imported: imported here before the torch functions are
    patched, so it never records the deferring copies. None for older transformers (they call torch directly)."""
    try:
        from transformers import initialization  # deferred: transformers is heavy (seconds)
    except ImportError:
        return None
    table = getattr(initialization, "TORCH_INIT_FUNCTIONS", None)
    return table if isinstance(table, dict) else None
