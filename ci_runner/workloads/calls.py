"""Run a phase (`ci_runner/workloads/phases.py`) the way its users run it: one callable, called again and again.

A phase is a list of calls. The prefill writes the prompt into a KV cache (transformers' `StaticCache` by default,
as users compile; `DynamicCache` on request); each decode step feeds one token through the same cache object, with
its position, as a hand-written generation loop does. A padded batch is one call with the attention mask and the
position ids `generate` derives from it (`cumsum(mask) - 1`, 0 on padding), so padded query rows are fully masked.
A long phase is the prompt's length, then one call per long length. The same `fn` (the eager module, or one compiled object) serves every call,
so a compiler sees the shapes change exactly as in generation.

An encoder-decoder whose decoder takes tokens (Whisper, T5, BART) is generated as `generate()` does: its encoder
runs once, eagerly (`get_encoder()`, on the audio features of `models/audio.py` or the prompt's tokens), and every
call is the decoder's: the prefill feeds the decoder prompt `generate()` starts from as `decoder_input_ids` (T5 and
BART: their start token; Whisper: the start token and its language, task and no-timestamps tokens, `_start_ids`),
each decode step one token, with the encoder's output (`encoder_outputs=`, the encoder's `attention_mask` where it
has one) and one `EncoderDecoderCache` (self-attention cache of the phase's kind, cross-attention cache of the
encoder's length). The backend compiles the decoder steps; the reference and the target see the same encoder output. Padded batches and
long prompts are built for decoder-only prompts and skipped for encoder-decoders.

Decode is teacher-forced when `forced` tokens are given (the reference's greedy tokens): both sides see the same
tokens, so one flipped token does not hide the layer that drifts. Every call's returned logits are kept as returned
(`raw`) and as a copy: `overwritten` lists the outputs a later call changed (a runtime that reuses its output
buffers).
"""

from __future__ import annotations

import copy
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch

from ..config import InputSpec
from .phases import Phase
from ..models.audio import is_audio
from ..failures.failure import stage_of, unwrap
from ..watch.hooks import ModuleHooks
from ..models.load import LoadedModel, build_inputs, reads_images, seeded_ids, text_config

__all__ = ["Call", "CallRecord", "Captured", "PhaseRun", "skip_reason", "run_phase", "phase_calls", "cache_kwarg", "logits_of",
           "capture_calls", "replay_calls", "smallest_module", "encoder_decoder", "encoder_run", "cache_recipe",
           "plain_tensors"]


@dataclass
class Call:
    """One call of a phase. `step` is the decode step (1-based), else None; `real` marks the real tokens of a padded
    batch ([batch, seq] bool), None when every token is real."""

    phase: str
    step: int | None
    label: str
    kwargs: dict[str, Any]
    real: torch.Tensor | None = None
    ids_key: str = "input_ids"  # the token ids the call feeds (`decoder_input_ids` for an encoder-decoder's decoder)

    @property
    def ids(self) -> torch.Tensor:
        return self.kwargs[self.ids_key]


@dataclass
class CallRecord:
    """What one call did: its error (None when it returned), its logits (a copy) and what it returned (`raw`)."""

    phase: str
    step: int | None
    label: str
    seconds: float
    error: str | None = None
    error_type: str | None = None
    stage: str | None = None  # compile | run, where the error was raised
    exc: BaseException | None = field(default=None, repr=False)
    logits: torch.Tensor | None = field(default=None, repr=False)
    raw: torch.Tensor | None = field(default=None, repr=False)
    real: torch.Tensor | None = field(default=None, repr=False)
    token: torch.Tensor | None = field(default=None, repr=False)  # the token a decode step was fed
    prompt_ids: torch.Tensor | None = field(default=None, repr=False)  # the ids a prefill/batch/long call was fed


@dataclass
class PhaseRun:
    phase: Phase
    records: list[CallRecord] = field(default_factory=list)
    tokens: list[torch.Tensor] = field(default_factory=list)  # greedy next token after each prefill/decode call
    cache: Any = None
    overwritten: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> CallRecord | None:
        return next((r for r in self.records if r.error is not None), None)


# what a backend is handed beside ATen ops when Dynamo traces with a symbolic length (`torch.sym_max`, …); the
# size queries (`aten.sym_size.int`, …) are ATen ops like any other and stay out
_SIZE_QUERIES = ("sym_size", "sym_numel", "sym_stride", "sym_storage_offset")


def symbolic_functions(gm: torch.fx.GraphModule) -> list[str]:
    """The symbolic-shape functions a graph (and its subgraphs) calls, by name (`sym_max`), in graph order, each
    once: the one rule the ops mode (which probes them) and the layers mode (which names them as a culprit) share."""
    found: list[str] = []
    for sub in gm.modules():
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            if node.op != "call_function" or hasattr(node.target, "_schema"):
                continue
            name = getattr(node.target, "__name__", "")
            if name.startswith("sym_") and not name.startswith(_SIZE_QUERIES) and name not in found:
                found.append(name)
    return found


def _signature(module: torch.nn.Module) -> set[str]:
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


def cache_kwarg(module: torch.nn.Module) -> str | None:
    """The forward's KV-cache keyword (`cache` in transformers >= 5.x, `past_key_values` before), or None."""
    params = _signature(module)
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def _generates(loaded: LoadedModel) -> bool:
    can = getattr(loaded.module, "can_generate", None)
    try:
        return bool(can()) if callable(can) else False
    except Exception:  # a model whose can_generate raises does not generate  # noqa: BLE001
        return False


def _max_positions(loaded: LoadedModel) -> int | None:
    cfg = text_config(loaded.config) if loaded.config is not None else None
    value = getattr(cfg, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def long_lengths(loaded: LoadedModel, phase: Phase) -> tuple[list[int], list[int]]:
    """The long phase's lengths that fit the model's positions, and those that do not."""
    limit = _max_positions(loaded)
    fit = [n for n in phase.lengths if limit is None or n <= limit]
    return fit, [n for n in phase.lengths if n not in fit]


def encoder_decoder(loaded: LoadedModel) -> bool:
    """Whether the model is an encoder-decoder (its config says so, or its task is a seq2seq head)."""
    return loaded.task in ("seq2seq", "speech-seq2seq") or bool(getattr(loaded.config, "is_encoder_decoder", False))


def _decodes_tokens(loaded: LoadedModel) -> bool:
    """An encoder-decoder generated as `generate()` does: a decoder fed `decoder_input_ids`, the encoder's output
    passed back as `encoder_outputs`, and an encoder to compute it."""
    params = _signature(loaded.module)
    return {"decoder_input_ids", "encoder_outputs"} <= params and callable(getattr(loaded.module, "get_encoder", None))


def _decoder_positions(loaded: LoadedModel) -> int | None:
    """The decoder's positions (Whisper's `max_target_positions`, else `max_position_embeddings`), or None."""
    cfg = _decoder_config(loaded)
    for key in ("max_target_positions", "max_position_embeddings"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _encoder_decoder_skip(loaded: LoadedModel, phase: Phase, inputs: InputSpec) -> str | None:
    name = type(loaded.module).__name__
    if phase.name in ("batch", "long"):
        return (f"{phase.name} is built for decoder-only prompts; {name} is an encoder-decoder (its prompt is the "
                f"encoder's input, run once: prefill and decode are its generation)")
    if not _decodes_tokens(loaded) or not _generates(loaded) or cache_kwarg(loaded.module) is None:
        return (f"{phase.name} needs an encoder-decoder that generates through a KV cache with `decoder_input_ids` "
                f"and `encoder_outputs`; {name} does not")
    start = len(_start_ids(loaded))
    limit, total = _decoder_positions(loaded), start + phase.steps
    if limit is not None and total > limit:
        return (f"decoder prompt ({start} token{'s' if start > 1 else ''}) + {phase.steps} steps = {total} tokens > "
                f"the decoder's {limit} positions")
    enc_limit = _max_positions(loaded)
    if not is_audio(loaded.module) and enc_limit is not None and inputs.seq_len > enc_limit:
        return f"prompt {inputs.seq_len} tokens > max_position_embeddings {enc_limit}"
    return None


def skip_reason(loaded: LoadedModel, phase: Phase, inputs: InputSpec) -> str | None:
    """Why `phase` does not apply to this model (None: it applies)."""
    if loaded.example_inputs is not None:
        return "a factory model brings its own inputs; phases are built for token models loaded from a config or folder"
    if loaded.task in ("image-classification",) or loaded.config is None \
            or (loaded.task != "image-text" and reads_images(loaded.module)):
        return f"{phase.name} needs token inputs; the model's task is {loaded.task}"
    if encoder_decoder(loaded):
        return _encoder_decoder_skip(loaded, phase, inputs)
    if is_audio(loaded.module):
        return f"{phase.name} needs token inputs; {type(loaded.module).__name__} reads audio"
    if phase.name in ("prefill", "decode"):
        if not _generates(loaded) or cache_kwarg(loaded.module) is None:
            return f"{phase.name} needs a model that generates through a KV cache; {type(loaded.module).__name__} does not"
        limit = _max_positions(loaded)
        total = inputs.seq_len + phase.steps
        if limit is not None and total > limit:
            return f"prompt {inputs.seq_len} + {phase.steps} steps = {total} tokens > max_position_embeddings {limit}"
    if phase.name in ("batch", "long") and loaded.task == "image-text":
        return f"{phase.name} prompts are built for text models; this is an image-text model"
    if phase.name == "batch" and "attention_mask" not in _signature(loaded.module):
        return f"a padded batch needs an attention mask; {type(loaded.module).__name__}.forward takes none"
    if phase.name == "long":
        fit, over = long_lengths(loaded, phase)
        if not fit:
            return f"every length {over} is over the model's max_position_embeddings {_max_positions(loaded)}"
    return None


def logits_of(out: Any) -> torch.Tensor | None:
    """The logits (or first tensor output) of a model's return value."""
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _ids(loaded: LoadedModel, inputs: InputSpec, length: int, *, batch: int = 1, salt: int = 0) -> torch.Tensor:
    spec = InputSpec(batch=batch, seq_len=length, samples=1, seed=inputs.seed)
    return seeded_ids(loaded.config, spec, 1000 + salt, length)


def _pad_id(loaded: LoadedModel) -> int:
    cfg = text_config(loaded.config)
    pad = getattr(cfg, "pad_token_id", None)
    return int(pad) if isinstance(pad, int) and pad >= 0 else 0


def _decoder_config(loaded: LoadedModel) -> Any:
    """The decoder's config, as `generate()` sizes its caches with (`get_text_config(decoder=True)`)."""
    config = loaded.module.config
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def make_cache(loaded: LoadedModel, phase: Phase, max_len: int, *, cross_len: int | None = None) -> Any:
    """A fresh KV cache of the phase's kind for `max_len` tokens; with `cross_len` (an encoder-decoder), an
    `EncoderDecoderCache` of that self-attention cache and a cross-attention cache of the same kind for the
    encoder's `cross_len` positions, as `generate()` builds them."""
    import transformers  # deferred: only phases with a cache need it

    config = _decoder_config(loaded) if cross_len is not None else loaded.module.config

    def one(length: int) -> Any:
        if phase.cache == "dynamic":
            return transformers.DynamicCache(config=config)
        return transformers.StaticCache(config=config, max_cache_len=length)

    if cross_len is None:
        return one(max_len)
    return transformers.EncoderDecoderCache(one(max_len), one(cross_len))


def cache_recipe(loaded: LoadedModel, phase: Phase, first: Call) -> dict[str, Any]:
    """How a repro script rebuilds the phase's cache: its kind, length and keyword, and `cross_len` (the encoder's
    length) for an encoder-decoder's `EncoderDecoderCache`."""
    key = cache_kwarg(loaded.module) or "past_key_values"
    recipe: dict[str, Any] = {"kind": phase.cache, "max_len": int(first.ids.shape[1]) + phase.steps, "kwarg": key}
    encoded = first.kwargs.get("encoder_outputs")
    if encoded is not None:
        recipe["cross_len"] = int(encoded[0].shape[1])
    return recipe


def plain_tensors(kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A call's tensors by keyword, an encoder's output (`encoder_outputs`) as its last hidden state: what a repro
    script writes out as literals (the cache left out)."""
    out = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    encoded = kwargs.get("encoder_outputs")
    if encoded is not None:
        out["encoder_outputs"] = encoded[0]
    return out


def _image_prefix(loaded: LoadedModel, inputs: InputSpec, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    built = build_inputs(loaded, inputs, sample=0, device="cpu")
    return built["input_ids"], {"pixel_values": built["pixel_values"]}


def generation_calls(loaded: LoadedModel, inputs: InputSpec, phase: Phase, device: str,
                     next_token: Callable[[int], torch.Tensor]) -> Iterator[Call]:
    """Prefill then `phase.steps` decode steps through one cache; `next_token(step)` gives step's input token."""
    ids = _ids(loaded, inputs, inputs.seq_len, batch=inputs.batch)
    extra: dict[str, Any] = {}
    if loaded.task == "image-text":
        ids, extra = _image_prefix(loaded, inputs, ids)
    length = ids.shape[1]
    cache = make_cache(loaded, phase, length + phase.steps)
    key = cache_kwarg(loaded.module) or "past_key_values"
    dtype = loaded.dtype
    extra = {k: v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device) for k, v in extra.items()}
    yield Call("prefill", None, "prefill", {
        "input_ids": ids.to(device), key: cache, "use_cache": True,
        "position_ids": torch.arange(length, device=device).expand(ids.shape[0], -1), **extra})
    for step in range(1, phase.steps + 1):
        tok = next_token(step).to(device)
        pos = torch.full((ids.shape[0], 1), length + step - 1, dtype=torch.long, device=device)
        yield Call("decode", step, f"decode step {step}", {"input_ids": tok, key: cache, "use_cache": True,
                                                           "position_ids": pos})


def _start_ids(loaded: LoadedModel) -> list[int]:
    """The decoder prompt `generate()` begins with: `decoder_start_token_id` (of the generation config, else the
    config), else the decoder's bos or pad id, else 0 (T5, BART: that one token); for a model whose generate()
    builds its own prompt (Whisper's `_retrieve_init_tokens`), the tokens it puts after it (`_prompt_tail`)."""
    sources = (getattr(loaded.module, "generation_config", None), loaded.config, _decoder_config(loaded))
    start = next((value for key in ("decoder_start_token_id", "bos_token_id", "pad_token_id") for source in sources
                  if isinstance(value := getattr(source, key, None), int) and value >= 0), 0)
    if not callable(getattr(loaded.module, "_retrieve_init_tokens", None)):
        return [start]
    return [start, *_prompt_tail(loaded, start)]


PROMPT_STAND_INS = 3  # a config-only Whisper's stand-ins for its language, task and no-timestamps tokens


def _prompt_tail(loaded: LoadedModel, start: int) -> list[int]:
    """What Whisper's generate() (transformers' `_retrieve_init_tokens`, no language or task asked) puts after the
    start token: the `forced_decoder_ids` of its generation config (else its config) at positions 1, 2, …; the
    language where they leave it open and `lang_to_id` lists languages (English where listed: generate() detects it
    with one more decoder call, left out); the no-timestamps token where it has one. A config-only model names
    none of them: the `PROMPT_STAND_INS` ids after the start token (within the vocabulary) stand in for the
    language, task and no-timestamps tokens, so the prefill feeds a prompt as long as generate()'s."""
    gen = getattr(loaded.module, "generation_config", None)
    forced = getattr(gen, "forced_decoder_ids", None) or getattr(loaded.config, "forced_decoder_ids", None) or []
    tail: list[int | None] = []
    for position, token in sorted((int(p), t) for p, t in forced):
        if position != len(tail) + 1:
            break
        tail.append(token)
    languages = getattr(gen, "lang_to_id", None) or {}
    if languages and (not tail or tail[0] is None):
        language = languages.get("<|en|>", next(iter(languages.values())))
        tail[:1] = [int(language)]
    no_timestamps = getattr(gen, "no_timestamps_token_id", None)
    if isinstance(no_timestamps, int) and not getattr(gen, "return_timestamps", False) \
            and (tail[-1:] or [start]) != [no_timestamps]:
        tail.append(no_timestamps)
    named = [int(t) for t in tail if t is not None]
    if named or forced or languages or no_timestamps is not None:
        return named
    vocab = int(getattr(_decoder_config(loaded), "vocab_size", 0) or 0) or start + PROMPT_STAND_INS + 1
    return [(start + k) % vocab for k in range(1, PROMPT_STAND_INS + 1)]


def encoder_run(loaded: LoadedModel, inputs: InputSpec, device: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """The encoder's output on the cell's first sample (audio features or the prompt's tokens, built as the single
    forward builds them), computed once and eagerly as `generate()` does, and the encoder's attention mask
    (`{"attention_mask": ...}` where the inputs have one, else `{}`)."""
    built = build_inputs(loaded, inputs, sample=0, device=device)
    main = str(getattr(loaded.module, "main_input_name", "input_ids") or "input_ids")
    mask = {"attention_mask": built["attention_mask"]} if isinstance(built.get("attention_mask"), torch.Tensor) else {}
    with torch.no_grad():
        encoded = loaded.module.get_encoder()(**{main: built[main]}, **mask, return_dict=True)
    return encoded, mask


def encoder_decoder_calls(loaded: LoadedModel, inputs: InputSpec, phase: Phase, device: str,
                          next_token: Callable[[int], torch.Tensor]) -> Iterator[Call]:
    """An encoder-decoder's generation: the encoder once (`encoder_run`), then the decoder's prefill (the start
    token(s)) and `phase.steps` decode steps through one `EncoderDecoderCache`, each call with the encoder's output
    and the keywords `generate()` passes (`decoder_input_ids`, `encoder_outputs`, the encoder's mask, the cache,
    `use_cache`)."""
    encoded, mask = encoder_run(loaded, inputs, device)
    batch = int(encoded[0].shape[0])
    start = torch.tensor([_start_ids(loaded)], dtype=torch.long).expand(batch, -1).to(device)
    cache = make_cache(loaded, phase, start.shape[1] + phase.steps, cross_len=int(encoded[0].shape[1]))
    key = cache_kwarg(loaded.module) or "past_key_values"
    shared = {"encoder_outputs": encoded, **mask, key: cache, "use_cache": True}
    yield Call("prefill", None, "prefill", {"decoder_input_ids": start, **shared}, ids_key="decoder_input_ids")
    for step in range(1, phase.steps + 1):
        yield Call("decode", step, f"decode step {step}", {"decoder_input_ids": next_token(step).to(device), **shared},
                   ids_key="decoder_input_ids")


def batch_call(loaded: LoadedModel, inputs: InputSpec, phase: Phase, device: str) -> Call:
    """One padded batch of `phase.lengths` prompts, mask and positions as `generate` builds them."""
    lengths = list(phase.lengths)
    width = max(lengths)
    ids = torch.full((len(lengths), width), _pad_id(loaded), dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        cols = slice(width - n, width) if phase.padding == "left" else slice(0, n)
        ids[row, cols] = _ids(loaded, inputs, n, salt=row)[0]
        mask[row, cols] = 1
    kwargs: dict[str, Any] = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    params = _signature(loaded.module)
    if _generates(loaded) and "position_ids" in params:
        kwargs["position_ids"] = ((mask.cumsum(-1) - 1).clamp(min=0) * mask).to(device)
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return Call("batch", None, "batch", kwargs, real=mask.bool())


def long_calls(loaded: LoadedModel, inputs: InputSpec, phase: Phase, device: str) -> Iterator[Call]:
    """The prompt's length first, then each long length, through the same `fn`: the compiled object has seen the
    usual prompt when the long one comes, so its recompile (a dynamic length, or a fallback) is what users hit."""
    params = _signature(loaded.module)
    fit = long_lengths(loaded, phase)[0]
    for n in ([inputs.seq_len] if fit and inputs.seq_len not in fit else []) + fit:
        ids = _ids(loaded, inputs, n, batch=inputs.batch)
        kwargs: dict[str, Any] = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
        if "use_cache" in params:
            kwargs["use_cache"] = False
        yield Call("long", None, f"long {n}", kwargs)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1:].float().argmax(-1)


def phase_calls(loaded: LoadedModel, inputs: InputSpec, phase: Phase, device: str,
                next_token: Callable[[int], torch.Tensor]) -> Iterator[Call]:
    """The calls of `phase`, in order (`next_token(step)`: the token a decode step feeds, asked when it is built):
    the one place a phase's name picks its calls."""
    if phase.name in ("prefill", "decode"):
        calls = encoder_decoder_calls if encoder_decoder(loaded) else generation_calls
        yield from calls(loaded, inputs, phase, device, next_token)
    elif phase.name == "batch":
        yield batch_call(loaded, inputs, phase, device)
    else:
        yield from long_calls(loaded, inputs, phase, device)


def run_phase(fn: Callable[..., Any], loaded: LoadedModel, inputs: InputSpec, phase: Phase, *,
              forced: list[torch.Tensor] | None = None, device: str = "cpu", keep_going: bool = False,
              before_call: Callable[[Call], None] | None = None,
              after_call: Callable[[Call, CallRecord], None] | None = None) -> PhaseRun:
    """Call `fn` for each call of `phase`, under `torch.no_grad()`. Stops at the first failing call unless
    `keep_going` (a decode step cannot follow a failed one: its token and cache are missing)."""
    run = PhaseRun(phase=phase)

    def next_token(step: int) -> torch.Tensor:
        if forced is not None and step - 1 < len(forced):
            return forced[step - 1]
        return run.tokens[step - 1]

    calls = phase_calls(loaded, inputs, phase, device, next_token)
    kept: list[tuple[CallRecord, torch.Tensor]] = []
    with torch.no_grad():
        for call in calls:
            if before_call is not None:
                before_call(call)
            t0 = time.perf_counter()
            rec = CallRecord(call.phase, call.step, call.label, 0.0, real=call.real)
            try:
                out = fn(**call.kwargs)
                raw = logits_of(out)
                rec.raw = raw
                rec.logits = raw.detach().clone() if raw is not None else None
            except Exception as exc:  # the backend's failure is the finding  # noqa: BLE001
                inner = unwrap(exc)  # the backend's own error, not Dynamo's wrapper
                rec.error, rec.error_type, rec.exc = f"{type(inner).__name__}: {inner}", type(inner).__name__, exc
                rec.stage = stage_of(exc)
            rec.seconds = time.perf_counter() - t0
            if call.step is not None:
                rec.token = call.ids.detach().cpu()
            else:
                rec.prompt_ids = call.ids.detach().cpu()
            run.records.append(rec)
            if rec.error is None:
                _check_kept(run, kept, rec)
                if rec.logits is not None:
                    kept.append((rec, rec.logits))
                    if phase.name in ("prefill", "decode"):
                        run.tokens.append(_greedy(rec.logits))
                run.cache = call.kwargs.get(cache_kwarg(loaded.module) or "past_key_values")
            if after_call is not None:
                after_call(call, rec)
            if rec.error is not None and not keep_going:
                break
    return run


def _check_kept(run: PhaseRun, kept: list[tuple[CallRecord, torch.Tensor]], latest: CallRecord) -> None:
    """After `latest` returned: did any earlier call's returned output change? (Each is reported once.)"""
    named = {o["call"] for o in run.overwritten}
    for rec, saved in kept:
        if rec.label in named or rec.raw is None:
            continue
        same = rec.raw.shape == saved.shape and torch.equal(rec.raw.nan_to_num(0.0), saved.nan_to_num(0.0))
        if not same:
            shared = rec.raw.untyped_storage().data_ptr() == (latest.raw.untyped_storage().data_ptr()
                                                             if latest.raw is not None else -1)
            run.overwritten.append({"call": rec.label, "step": rec.step, "changed_after": latest.label,
                                    "shares_storage": bool(shared),
                                    "max_abs_change": float((rec.raw.double() - saved.double()).abs().max())
                                    if rec.raw.shape == saved.shape else None})


# --------------------------------------------------------------------------------------------- one call, module by module

Captured = dict[str, list[tuple[int, tuple[Any, ...], dict[str, Any]]]]  # module -> (call index, args, kwargs)


def capture_calls(loaded: LoadedModel, inputs: InputSpec, phase: Phase, *, forced: list[torch.Tensor] | None,
                  upto: int) -> Captured:
    """Every submodule's calls over the phase's calls 0..upto, run eagerly: inputs deep-copied at the call, so a
    module's KV cache state is the one it saw then."""
    captured: Captured = {}
    current = {"i": -1}

    def pre(name: str) -> Callable[..., None]:
        def hook(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if current["i"] <= upto:
                captured.setdefault(name, []).append((current["i"], copy.deepcopy(args), copy.deepcopy(kwargs)))
        return hook

    def before(call: Call) -> None:
        current["i"] += 1

    with ModuleHooks(loaded.module.named_modules(), pre=pre):
        run_phase(loaded.module, loaded, inputs, phase, forced=forced, before_call=before)
    return captured


def replay_calls(fn: Callable[..., Any], calls: list[tuple[int, tuple[Any, ...], dict[str, Any]]], upto: int,
                 move: Callable[[Any], Any]) -> tuple[int, Any, BaseException | None]:
    """Call `fn` (one compiled object) with a module's captured calls in order, up to the phase's call `upto`, each
    on a copy moved by `move`: the index, output and error of the last call made (an error ends the replay)."""
    last: tuple[int, Any, BaseException | None] = (-1, None, None)
    with torch.no_grad():
        for index, args, kwargs in calls:
            if index > upto:
                break
            a, kw = move(copy.deepcopy((args, kwargs)))
            try:
                last = (index, fn(*a, **kw), None)
            except Exception as exc:  # the backend's failure: the caller judges it  # noqa: BLE001
                return index, None, exc
    return last


def smallest_module(root: torch.nn.Module, captured: Captured, call: int,
                    fails: Callable[[str], bool]) -> tuple[str, list[str]]:
    """Walk down from the model ("") while a child called in `call` `fails` (replayed alone: the caller decides how);
    the smallest such module and its children that passed. Containers that are never called themselves (a
    ModuleList) are looked through."""
    def called_children(name: str) -> list[str]:
        out = []
        for child_name, _ in (root.get_submodule(name) if name else root).named_children():
            child = f"{name}.{child_name}" if name else child_name
            out += [child] if captured.get(child) else called_children(child)
        return out

    current = ""
    while True:
        passed = []
        for child in called_children(current):
            if not any(c[0] == call for c in captured.get(child, [])):
                continue
            if fails(child):
                current = child
                break
            passed.append(child)
        else:
            return current, passed
