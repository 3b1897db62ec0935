"""Fused kernels for hot spots of the model, each with a plain-PyTorch reference it is tested against.

Triton is optional: every kernel falls back to its reference where triton or a GPU is missing. The names below
load from their module on first use (PEP 562), so importing `norm_pair` (plain torch) does not import triton.
(Not keel._lazy: this layer imports torch and triton only.)
"""

import importlib

_HOMES = {"available": "junction", "can_fuse": "junction", "junction_reference": "junction",
          "keel_junction": "junction", "rms_norm_pair": "norm_pair", "rms_norm_pair_reference": "norm_pair"}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
