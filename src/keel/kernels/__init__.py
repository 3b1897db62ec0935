"""Fused kernels for hot spots of the model, each with a plain-PyTorch reference it is tested against.

Triton is optional: every kernel falls back to its reference where triton or a GPU is missing.
"""

from keel.kernels.junction import available, can_fuse, junction_reference, keel_junction

__all__ = ["available", "can_fuse", "junction_reference", "keel_junction"]
