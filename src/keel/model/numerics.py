"""Precision rules for the residual stream."""

import torch


def stream_dtype(t: torch.Tensor) -> torch.dtype:
    """float32, or the tensor's own dtype where that is wider (float64 in reference tests).

    The residual stream and every shortcut sum live here, never in bf16/fp16: with Keel's alpha in the
    hundreds, one sub-layer changes the normalised stream by about |F| / (alpha |x|), below bf16's
    resolution (2^-8), so a low-precision stream would drop the updates.
    """
    return torch.promote_types(t.dtype, torch.float32)


def upcast(t: torch.Tensor) -> torch.Tensor:
    return t.to(stream_dtype(t))
