"""Mode `memory`: per-layer, per-phase memory, predicted on meta tensors and measured on the device."""
