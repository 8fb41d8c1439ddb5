"""Synthetic inputs for a zoo architecture: `models.load.build_inputs` on the model the zoo built, as for a
`config:` model (one input builder for both paths: `models/synth.py` picks the inputs from the forward's names).

A forward argument that is required and not made there is a `ZooInputError` (`models.synth.MissingInputError`)
naming it: the scan lists the architecture with that reason.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..config import InputSpec, ModelSpec
from ..models.load import LoadedModel, build_inputs
from ..models.synth import MissingInputError

ZooInputError = MissingInputError  # the scan's name for it

__all__ = ["ZooInputError", "scan_inputs", "zoo_inputs"]


def zoo_inputs(module: torch.nn.Module, config: Any, *, model_type: str, task: str | None, inputs: InputSpec,
               sample: int = 0) -> dict[str, Any]:
    """Keyword arguments for `module(**kwargs)` (CPU tensors; the inventory fakes them on its device): the zoo's
    model as a `config:` model of its model_type and head (no tokenizer: seeded ids within the vocabulary)."""
    spec = ModelSpec(id=model_type, config=model_type, task=task or "base")
    loaded = LoadedModel(spec=spec, module=module, task=task or "base", config=config, tokenizer=None,
                         revision=None, dtype=torch.float32, device="cpu")
    return build_inputs(loaded, inputs, sample=sample)


def scan_inputs(inputs: InputSpec | None = None) -> InputSpec:
    """The input spec of the scan: one short sample (shapes only matter on `meta`)."""
    return replace(inputs or InputSpec(), samples=1, seq_len=min((inputs or InputSpec()).seq_len, 16))
