"""Fused kernels for hot spots of the model, each with a plain-PyTorch reference it is tested against and falls back
to; triton is optional and loads on first use."""

from keel._lazy import lazy_names

__getattr__, __dir__, __all__ = lazy_names(__name__, {
    "junction": ("available", "can_fuse", "junction_reference", "keel_junction"),
    "norm_pair": ("rms_norm_pair",),
})
