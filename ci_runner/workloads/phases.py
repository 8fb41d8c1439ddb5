"""The workloads users run, as the matrix spells them: `inputs.phases` (no torch here).

```yaml
inputs:
  phases: [prefill, {decode: {steps: 8}}, {batch: {lengths: [16, 11, 7, 3], padding: left}}, {long: {seq_len: [512]}}]
```

- `prefill`: the prompt (`inputs.seq_len` tokens) into a KV cache, one call of the compiled model.
- `decode`: the prefill, then `steps` one-token calls through the same cache and the same compiled object
  (`cache: static` by default, as users compile; `dynamic` for transformers' DynamicCache).
- `batch`: prompts of `lengths` in one batch, padded on the `padding` side, with the attention mask and position ids
  `generate` builds from it (padded query rows are fully masked).
- `long`: the prompt's length (`inputs.seq_len`), then one call per length in `seq_len`, through the same compiled
  object (the recompile a longer prompt causes is tested as users hit it).

No `phases` key: the single unpadded forward every mode ran before (nothing here is used). `parse_phases` turns the
raw list into `Phase` records; the matrix schema checks the shape, `check_phases` the values, at load.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

PHASE_NAMES = ("prefill", "decode", "batch", "long")
CACHE_KINDS = ("static", "dynamic")
PADDING_SIDES = ("left", "right")
DEFAULT_DECODE_STEPS = 8
DEFAULT_LONG_LENGTHS = (512, 2048)

# What each phase takes, with defaults (documentation and validation share this table).
PHASE_OPTIONS: Mapping[str, Mapping[str, str]] = {
    "prefill": {"cache": "`static` (default: transformers' StaticCache, as users compile) or `dynamic`"},
    "decode": {"steps": f"one-token decode steps after the prefill (default {DEFAULT_DECODE_STEPS})",
               "cache": "`static` (default) or `dynamic`"},
    "batch": {"lengths": "prompt lengths in one padded batch (default: seq_len, 2/3, 1/3 of it and 2)",
              "padding": "`left` (default, as `generate` pads decoders) or `right`"},
    "long": {"seq_len": f"prompt lengths, each one call of the same compiled object (default {list(DEFAULT_LONG_LENGTHS)})"},
}


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One resolved phase. `steps` is the decode steps (0 for a prefill alone); `lengths` the batch's prompt
    lengths or the long phase's lengths."""

    name: str
    steps: int = 0
    cache: str = "static"
    lengths: tuple[int, ...] = ()
    padding: str = "left"
    options: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def label(self) -> str:
        if self.name == "decode":
            return f"decode ({self.steps} steps, {self.cache} cache)"
        if self.name == "batch":
            return f"batch (lengths {list(self.lengths)}, {self.padding}-padded)"
        if self.name == "long":
            return f"long (lengths {list(self.lengths)})"
        return f"prefill ({self.cache} cache)"


def _name_and_options(item: Any) -> tuple[str, Mapping[str, Any]]:
    if isinstance(item, str):
        return item, {}
    if isinstance(item, Mapping) and len(item) == 1:
        (name, opts), = item.items()
        return str(name), dict(opts or {})
    raise ValueError(f"a phase is a name or a one-key mapping {{name: {{options}}}}, got {item!r}")


def default_batch_lengths(seq_len: int) -> tuple[int, ...]:
    seen: list[int] = []
    for n in (seq_len, (2 * seq_len) // 3, seq_len // 3, 2):
        if n >= 1 and n not in seen:
            seen.append(n)
    return tuple(seen)


def check_phases(raw: Sequence[Any]) -> list[tuple[int, str, str]]:
    """Problems in a raw `phases` list: (index, message, hint) for each; empty when it is valid."""
    problems: list[tuple[int, str, str]] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        try:
            name, opts = _name_and_options(item)
        except ValueError as exc:
            problems.append((i, str(exc), "write e.g. `decode` or `{decode: {steps: 8}}`"))
            continue
        if name not in PHASE_NAMES:
            problems.append((i, f"unknown phase {name!r}", _choices(name, PHASE_NAMES)))
            continue
        if name in seen:
            problems.append((i, f"phase {name!r} is listed twice", "list each phase once"))
        seen.add(name)
        known = PHASE_OPTIONS[name]
        for key, value in opts.items():
            if key not in known:
                problems.append((i, f"{name}: unknown option {key!r}", _choices(key, tuple(known))))
                continue
            bad = _bad_value(key, value)
            if bad:
                problems.append((i, f"{name}.{key}: {bad}", f"{key}: {known[key]}"))
    return problems


def _bad_value(key: str, value: Any) -> str | None:
    if key == "steps":
        return None if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 4096 else \
            f"{value!r} is not a whole number of steps in 1..4096"
    if key == "cache":
        return None if value in CACHE_KINDS else f"{value!r} is not one of {', '.join(CACHE_KINDS)}"
    if key == "padding":
        return None if value in PADDING_SIDES else f"{value!r} is not one of {', '.join(PADDING_SIDES)}"
    if key in ("lengths", "seq_len"):
        ok = isinstance(value, list) and value and all(isinstance(n, int) and not isinstance(n, bool)
                                                       and 1 <= n <= 1_000_000 for n in value)
        return None if ok else f"{value!r} is not a non-empty list of lengths (whole numbers >= 1)"
    return None


def _choices(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    known = ", ".join(choices)
    return f"did you mean {close[0]!r}? known: {known}" if close else f"known: {known}"


def parse_phases(raw: Sequence[Any], *, seq_len: int) -> tuple[Phase, ...]:
    """The `Phase` records of a raw list that `check_phases` accepted, defaults filled in from `seq_len`."""
    out = []
    for item in raw:
        name, opts = _name_and_options(item)
        if name == "decode":
            out.append(Phase(name=name, steps=int(opts.get("steps", DEFAULT_DECODE_STEPS)),
                             cache=opts.get("cache", "static"), options=opts))
        elif name == "prefill":
            out.append(Phase(name=name, cache=opts.get("cache", "static"), options=opts))
        elif name == "batch":
            lengths = tuple(opts.get("lengths") or default_batch_lengths(seq_len))
            out.append(Phase(name=name, lengths=lengths, padding=opts.get("padding", "left"), options=opts))
        else:
            out.append(Phase(name=name, lengths=tuple(opts.get("seq_len") or DEFAULT_LONG_LENGTHS), options=opts))
    return tuple(out)
