"""Fused kernels for hot spots of the model, each with a plain-PyTorch reference it is tested against.

Triton is optional: every kernel falls back to its reference where triton or a GPU is missing. The names below
load from their module on first use (PEP 562), so importing `norm_pair` (plain torch) does not import triton.
"""

from keel._lazy import lazy_names

__getattr__, __dir__, __all__ = lazy_names(__name__, {
    "junction": ("available", "can_fuse", "junction_reference", "keel_junction"),
    "norm_pair": ("rms_norm_pair",),
})
