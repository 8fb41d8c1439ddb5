"""A backend's precision policy, as the matrix spells it: the dtype each class of ops computes in (no torch here).

```yaml
backends:
  - {id: ov, compile: openvino, precision: auto}           # default: measured by probes at the cell's start
  - {id: card, compile: "acme:compile", precision: bfloat16}
  - {id: card-fp8, compile: "acme:compile", precision: {default: bfloat16, kv_cache: float8_e4m3fn}}
```

Accelerators follow the mixed-precision convention that `torch.autocast`'s op lists write down: the matmul-class
ops (`matmul`: mm, addmm, bmm, baddbmm, linear; `conv`: convolutions; `attention`: scaled-dot-product attention)
take low-precision inputs and accumulate in float32; `softmax`, `norm`, `reduction` and `elementwise` (exp, log,
pow, rsqrt, activations) stay float32, and so does the KV cache. So:

- `float32`: every class in float32 (what every verdict assumed before policies existed);
- `bfloat16` / `float16`: the convention with that dtype for the matmul classes;
- `float8_e4m3fn` / `float8_e5m2`: the convention with per-tensor scaled fp8 inputs for the matmul classes;
- a table `{default: D, <class>: D, …}`: the convention for `default`, then each named class as given
  (`kv_cache: float8_e4m3fn`, `accumulate: bfloat16`, even `softmax: bfloat16` when a backend documents it);
- `auto` (the default): a few probes at the cell's start measure what the backend does per class, and the cell
  takes the convention whose matmul dtype matches (`workloads/emulate.py`). What was measured is written in
  `results.json` (`data.precision` of the numerics and ops modes). Detection never legalises a class the
  convention keeps in float32: a backend measured to compute norms in bf16 keeps a float32 `norm` class, and the
  numerics and ops modes flag it.

The references then follow the policy: the numerics mode's thresholds widen by the spread of an emulation of the
policy on the CPU (`workloads/emulate.emulate`), and the ops mode judges each probe against the same op under the
emulation. `check_precision` reports spelling mistakes at load; `parse_precision` gives the typed policy.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping

# The op classes a policy names, and what each holds (documentation and validation share this table).
OP_CLASSES: Mapping[str, str] = MappingProxyType({
    "matmul": "mm, addmm, bmm, baddbmm, linear, matmul: inputs rounded, float32 accumulation",
    "conv": "convolutions: inputs rounded, float32 accumulation",
    "attention": "scaled-dot-product attention: q, k, v rounded, softmax inside in float32",
    "accumulate": "the accumulator of the matmul classes (float32 unless a backend says otherwise)",
    "softmax": "softmax and log-softmax",
    "norm": "layer, group, batch and RMS norms",
    "reduction": "sum, mean, var, cumsum and other reductions",
    "elementwise": "exp, log, pow, rsqrt, sqrt, tanh, sigmoid, erf and activations",
    "kv_cache": "the values written into a KV cache",
})
LOW_CLASSES = ("matmul", "conv", "attention")  # the classes the convention runs in the policy's dtype
FLOAT32_CLASSES = ("accumulate", "softmax", "norm", "reduction", "elementwise", "kv_cache")  # float32 by convention
DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
NAMES = ("auto",) + DTYPES
DEFAULT = "auto"
# Unit roundoff of each dtype (half an ulp at 1): what one rounding costs, relative.
UNIT_ROUNDOFF: Mapping[str, float] = MappingProxyType({
    "float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float8_e4m3fn": 2.0 ** -4,
    "float8_e5m2": 2.0 ** -3})


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """A resolved policy: `classes` maps every op class to its dtype; `spelled` is what the matrix said (`auto`,
    a dtype, or `table`); `detected` is True when the classes were measured (`auto`); `storage` is the dtype the
    model's tensors live in between ops (the model's `dtype:` in the matrix: a model loaded in bfloat16 rounds
    every op's output to bfloat16 whatever its class computes in; see `with_storage`)."""

    spelled: str = DEFAULT
    classes: Mapping[str, str] = field(default_factory=lambda: MappingProxyType(convention("float32")))
    detected: bool = False
    storage: str = "float32"

    @property
    def auto(self) -> bool:
        return self.spelled == "auto" and not self.detected

    @property
    def is_float32(self) -> bool:
        """Every class in float32: the policy changes nothing (keys, thresholds, tolerances stay as they were)."""
        return self.storage == "float32" and all(d == "float32" for d in self.classes.values())

    @property
    def low(self) -> str:
        """The matmul classes' dtype (the policy's name when it follows the convention)."""
        return self.classes.get("matmul", "float32")

    def dtype(self, op_class: str) -> str:
        return self.classes.get(op_class, "float32")

    def label(self) -> str:
        base = convention(self.low)
        extra = {c: d for c, d in self.classes.items() if base.get(c) != d}
        text = self.low if not extra else f"{self.low} + " + ", ".join(f"{c}={d}" for c, d in sorted(extra.items()))
        text = f"{text} (detected)" if self.detected else text
        return text if self.storage == "float32" else f"{text}, model in {self.storage}"

    def key(self) -> dict[str, str]:
        """What a threshold file or a probe store is keyed by: the classes that are not float32 (and the model's
        storage dtype when it is not float32)."""
        out = {c: d for c, d in sorted(self.classes.items()) if d != "float32"}
        if self.storage != "float32":
            out["storage"] = self.storage
        return out

    def to_json(self) -> dict[str, Any]:
        out = {"spelled": self.spelled, "classes": dict(self.classes), "detected": self.detected}
        if self.storage != "float32":
            out["storage"] = self.storage
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> "PrecisionPolicy":
        if not data:
            return cls()
        return cls(spelled=str(data.get("spelled", DEFAULT)), detected=bool(data.get("detected", False)),
                   classes=MappingProxyType({**convention("float32"), **dict(data.get("classes") or {})}),
                   storage=str(data.get("storage", "float32")))


def convention(low: str) -> dict[str, str]:
    """The mixed-precision convention for matmul dtype `low`: the matmul classes in `low`, the rest float32."""
    return {c: (low if c in LOW_CLASSES else "float32") for c in OP_CLASSES}


def _choices(word: str, choices: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return (f"did you mean {close[0]!r}? " if close else "") + "one of: " + ", ".join(choices)


def check_precision(raw: Any) -> list[tuple[tuple[str, ...], str, str]]:
    """The problems of one `precision:` value: (path under the key, message, hint)."""
    if isinstance(raw, str):
        if raw not in NAMES:
            return [((), f"precision {raw!r} is not a policy", _choices(raw, NAMES))]
        return []
    if not isinstance(raw, Mapping):
        return [((), f"precision must be a name or a table {{default: dtype, <class>: dtype}}, got {raw!r}",
                 "e.g. precision: bfloat16, or precision: {default: bfloat16, kv_cache: float8_e4m3fn}")]
    problems: list[tuple[tuple[str, ...], str, str]] = []
    for key, value in raw.items():
        if key != "default" and key not in OP_CLASSES:
            problems.append(((str(key),), f"unknown op class {key!r} in precision",
                             _choices(str(key), ["default", *OP_CLASSES])))
        elif value not in DTYPES:
            problems.append(((str(key),), f"precision.{key}: {value!r} is not a dtype", _choices(str(value), DTYPES)))
    return problems


def parse_precision(raw: Any) -> PrecisionPolicy:
    """The policy of a checked `precision:` value (None: the default, `auto`)."""
    if raw is None:
        raw = DEFAULT
    if isinstance(raw, str):
        low = "float32" if raw == "auto" else raw
        return PrecisionPolicy(spelled=raw, classes=MappingProxyType(convention(low)))
    table = dict(raw)
    classes = convention(str(table.pop("default", "float32")))
    classes.update({str(k): str(v) for k, v in table.items()})
    return PrecisionPolicy(spelled="table", classes=MappingProxyType(classes))


STORAGE_DTYPES = ("bfloat16", "float16")  # a model's `dtype:` that makes the tensors between its ops low precision


def storage_dtype(model_dtype: str) -> str | None:
    """The low dtype a model's tensors live in between ops (the matrix's `dtype:` on the model: `bfloat16` or
    `float16`, `torch.` prefix or not), or None for a float32 or float64 model."""
    name = str(model_dtype).removeprefix("torch.")
    return name if name in STORAGE_DTYPES else None


def with_storage(policy: PrecisionPolicy, model_dtype: str) -> PrecisionPolicy:
    """`policy` for a model loaded in `model_dtype` (the matrix's `dtype:` on the model): a bfloat16 or float16
    model keeps every tensor between ops in that dtype, so each op's output is rounded to it (the op itself may
    compute wider: CPU eager and compilers upcast inside a kernel); the op classes keep what the backend's policy
    says. A float32 or float64 model changes nothing."""
    store = storage_dtype(model_dtype)
    return policy if store is None else replace(policy, storage=store)


def detected_policy(spelled: str, measured: Mapping[str, str]) -> PrecisionPolicy:
    """The policy an `auto` cell takes from what the probes measured per class: the convention of the measured
    matmul dtype. Classes the convention keeps in float32 stay float32 whatever was measured there (a norm measured
    in bf16 is a finding of the modes, not a new policy)."""
    low = measured.get("matmul", "float32")
    low = low if low in DTYPES else "float32"
    return PrecisionPolicy(spelled=spelled, classes=MappingProxyType(convention(low)), detected=True)


__all__ = ["DEFAULT", "DTYPES", "FLOAT32_CLASSES", "LOW_CLASSES", "NAMES", "OP_CLASSES", "PrecisionPolicy",
           "STORAGE_DTYPES", "UNIT_ROUNDOFF", "check_precision", "convention", "detected_policy", "parse_precision",
           "storage_dtype", "with_storage"]
