"""Two RMSNorms in a row, one sub-layer's `LN_out` and the next one's `LN_in`, as one autograd op whose backward
reads two independent row sums, a = mean(dy * y) and b = mean(du * w_in * m), in one pass (why and the derivation:
docs/internals.md#keelkernelsnorm_pair).

    y = w_out * z * r_z,   r_z = rsqrt(mean(z^2) + eps_out)      the new residual stream
    u = w_in  * y * r_y,   r_y = rsqrt(mean(y^2) + eps_in)       the next branch's input
    gy = dy + r_y * (w_in * du - m * b)        dz = r_z * (w_out * gy - n * (a + eps_in * r_y^2 * b))
    dw_in = sum_rows(du * m)                   dw_out = sum_rows(gy * n)          (m = y * r_y, n = z * r_z)
"""

from __future__ import annotations

import torch


class _RMSNormPair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, w_out: torch.Tensor, w_in: torch.Tensor, eps_out: float, eps_in: float,
                u_dtype: torch.dtype | None):
        # the plain RMSNorm's ops in its order (keel.model.layers.RMSNorm), so the outputs are the same numbers
        r_z = torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps_out)  # (..., 1)
        y = w_out * (z * r_z)  # float32 (or float64) whatever the gain's dtype: the stream
        r_y = torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps_in)  # (..., 1)
        u = w_in * (y * r_y)
        ctx.save_for_backward(z, w_out, w_in, r_z, r_y)
        ctx.eps_in = eps_in
        # u feeds only the next branch, which computes in u_dtype: rounding here is the cast the branch would do
        return y, u if u_dtype is None else u.to(u_dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor, du: torch.Tensor):
        z, w_out, w_in, r_z, r_y = ctx.saved_tensors
        dtype = z.dtype
        du = du.to(dtype)
        n = z * r_z
        y = w_out.to(dtype) * n
        m = y * r_y
        dm = w_in.to(dtype) * du
        a = (dy * y).mean(-1, keepdim=True)  # the two row sums: neither reads the other
        b = (dm * m).mean(-1, keepdim=True)
        gy = dy + r_y * (dm - m * b)
        dz = r_z * (w_out.to(dtype) * gy - n * (a + ctx.eps_in * r_y.square() * b))
        rows = tuple(range(z.dim() - 1))
        dw_out = (gy * n).sum(rows).to(w_out.dtype) if ctx.needs_input_grad[1] else None
        dw_in = (du * m).sum(rows).to(w_in.dtype) if ctx.needs_input_grad[2] else None
        return dz, dw_out, dw_in, None, None, None


def rms_norm_pair(z: torch.Tensor, w_out: torch.Tensor, w_in: torch.Tensor, eps_out: float, eps_in: float,
                  u_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(y, u)`: `y = RMSNorm(z) * w_out` and `u = RMSNorm(y) * w_in` (see the module docstring), differentiable
    in z and both gains, the backward in one pass of two independent row sums.

    z: the residual stream's sum, shape (..., d), float32 (float64 in reference tests); the gains: shape (d,), any
    floating dtype (bf16 under FSDP2's mixed precision): y and u are computed in z's dtype, as keel's RMSNorm does
    for a float32 stream. `u_dtype`: the dtype the next branch computes in, which u only feeds (its gradient then
    arrives in it too); None keeps z's.
    """
    return _RMSNormPair.apply(z, w_out, w_in, eps_out, eps_in, u_dtype)

