"""The junction alone, timed (the GPU campaign's `kernel` section): effective memory bandwidth of the fused
kernel, of the plain PyTorch composition and of torch.compile's version of that composition, against the device's
own copy bandwidth.

Effective bandwidth counts the bytes the op cannot avoid moving (each input read once, each output written once)
over the measured time, the same count for every implementation, so the numbers compare how close each gets to
one pass over memory. The junction is memory-bound (a few FLOPs per byte), so that is the ceiling.
"""

from __future__ import annotations

from functools import partial

import torch
from validate_model import time_call

from keel.kernels.junction import can_fuse, junction_reference, keel_junction


def copy_bandwidth(device: torch.device, n_bytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write), the practical ceiling for a memory-bound op."""
    src = torch.empty(n_bytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * n_bytes / time_call(lambda: dst.copy_(src), device)


def junction_bandwidth(rows: int, width: int, device: torch.device, f_dtype: torch.dtype = torch.bfloat16,
                       alpha: float = 64.0, eps: float = 1e-5, calls: int = 10, repeats: int = 5,
                       compile_backend: str = "inductor") -> dict:
    """Forward and forward+backward time and effective bandwidth of each implementation at (rows, width).

    "fused" only where the kernel can run (`can_fuse`). f is the branch output (bf16 under autocast on GPUs).
    """
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, width, device=device, generator=g)
    f = torch.randn(rows, width, device=device, generator=g).to(f_dtype)
    dy, du = torch.randn_like(x), torch.randn_like(x)
    w_out = torch.rand(width, device=device, generator=g) + 0.5
    w_in = torch.rand(width, device=device, generator=g) + 0.5
    fb = f.element_size()
    # forward: read x, f; write y, u.  backward: read x, f, dy, du; write dx, df (weights and row stats are noise)
    bytes_fwd = rows * width * (4 + fb + 4 + 4)
    bytes_bwd = rows * width * (4 + fb + 4 + 4 + 4 + fb)
    impls = {"unfused": junction_reference,
             "compiled": torch.compile(junction_reference, backend=compile_backend, dynamic=False)}
    if can_fuse(device, width):
        impls = {"fused": partial(keel_junction, impl="triton"), **impls}
    leaves = [t.detach().requires_grad_() for t in (x, f, w_out, w_in)]

    def forward(fn):
        with torch.no_grad():
            fn(x, f, alpha, w_out, w_in, eps)

    def forward_backward(fn):
        y, u = fn(leaves[0], leaves[1], alpha, leaves[2], leaves[3], eps)
        torch.autograd.grad((y, u), leaves, (dy, du))

    out = {"rows": rows, "width": width, "f_dtype": str(f_dtype).removeprefix("torch."),
           "bytes_fwd": bytes_fwd, "bytes_fwd_bwd": bytes_fwd + bytes_bwd}
    for name, fn in impls.items():
        fwd = time_call(partial(forward, fn), device, calls, repeats)
        both = time_call(partial(forward_backward, fn), device, calls, repeats)
        out[name] = {"fwd_s": fwd, "fwd_GBps": bytes_fwd / fwd / 1e9,
                     "fwd_bwd_s": both, "fwd_bwd_GBps": (bytes_fwd + bytes_bwd) / both / 1e9}
    return out
