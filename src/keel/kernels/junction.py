"""The Keel junction between two sub-layers as one fused operation, forward and backward.

    z = alpha * x + f                               the shortcut sum, in float32
    y = z * rsqrt(mean(z^2) + eps) * w_out          LN_out: the new residual stream
    u = y * rsqrt(mean(y^2) + eps) * w_in           LN_in of the next sub-layer: its branch input

Unfused, every op is its own pass over the (..., d) tensors and autograd keeps several of them (z, y and
the normalised intermediates); fused, each row is read once into registers, and backward keeps only x, f
and two scalars per row (the reciprocal RMS of z and of y), recomputing the rest.

Triton is optional. Without it, or for tensors the kernels cannot take, `keel_junction(impl="auto")`
runs `junction_reference`, the same equations in PyTorch.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

IMPLS = ("auto", "triton", "torch")
# A whole row lives in registers; past this width it spills to local memory and fusing stops paying.
MAX_FUSED_WIDTH = 16384


def junction_reference(x: torch.Tensor, f: torch.Tensor, alpha: float, w_out: torch.Tensor, w_in: torch.Tensor,
                       eps: float, u_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(y, u)` for `z = alpha*x + f`, `y = RMSNorm(z) * w_out`, `u = RMSNorm(y) * w_in`, in plain PyTorch.

    z, y and u are computed in float32, or float64 for float64 inputs: with alpha in the hundreds one sub-layer
    moves the normalised stream by about |f| / (alpha |x|), below bf16's resolution, so the sum must
    never happen in f's (possibly bf16) precision. u is then rounded to `u_dtype` where given.
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    z = alpha * x.to(dtype) + f.to(dtype)
    y = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * w_out.to(dtype)
    u = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * w_in.to(dtype)
    return y, u if u_dtype is None else u.to(u_dtype)


def available(x: torch.Tensor) -> bool:
    """Whether the fused Triton path can run for the residual stream `x`: a float32 `x` that `can_fuse`."""
    return x.dtype == torch.float32 and can_fuse(x.device, x.shape[-1])


def can_fuse(device: torch.device, width: int) -> bool:
    """Whether the fused path can run for a float32 stream of `width` on `device`.

    It needs triton, a width no larger than `MAX_FUSED_WIDTH`, and CUDA, or triton's CPU interpreter
    (TRITON_INTERPRET=1 when triton was first imported; slow, for tests).
    """
    on_device = torch.device(device).type == "cuda" or _INTERPRETED
    return triton is not None and on_device and 0 < width <= MAX_FUSED_WIDTH


def keel_junction(x: torch.Tensor, f: torch.Tensor, alpha: float, w_out: torch.Tensor, w_in: torch.Tensor,
                  eps: float, impl: str = "auto",
                  u_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The junction `(y, u)` (see the module docstring): y is the new stream, u the next branch's input.

    x: the float32 residual stream, shape (..., d); f: the branch output, same shape, float32 or bf16/fp16;
    w_out, w_in: shape (d,). y is float32. u is float32 (as keel's own RMSNorm returns for a float32 stream), or
    `u_dtype`: the dtype the next branch computes in, which u only feeds (bf16 halves its bytes and those of its
    gradient, which then arrives in bf16 too).
    impl: "triton" (fused; fails where `available(x)` is False), "torch" (`junction_reference`), or
    "auto" (triton where available, else torch). Differentiable in x, f, w_out and w_in.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if f.shape != x.shape or w_out.shape != x.shape[-1:] or w_in.shape != x.shape[-1:]:
        raise ValueError(f"junction needs f of x's shape {tuple(x.shape)} and weights of shape ({x.shape[-1]},); "
                         f"got f {tuple(f.shape)}, w_out {tuple(w_out.shape)}, w_in {tuple(w_in.shape)}")
    if impl == "torch" or (impl == "auto" and not available(x)):
        return junction_reference(x, f, alpha, w_out, w_in, eps, u_dtype)
    if not available(x):
        raise ValueError(f"the triton junction cannot run here (triton installed: {triton is not None}, "
                         f"device {x.device}, dtype {x.dtype}, width {x.shape[-1]}); use impl='auto' or 'torch'")
    y, u, _, _ = _junction(x, f, float(alpha), w_out, w_in, float(eps), u_dtype or x.dtype)
    return y, u


# A pair of opaque custom operators with an autograd formula, not an autograd.Function nor a triton_op (why:
# docs/internals.md#keelkernelsjunction): a compiled block keeps each as one node, with `register_fake` shapes
@torch.library.custom_op("keel::junction", mutates_args=())
def _junction(x: torch.Tensor, f: torch.Tensor, alpha: float, w_out: torch.Tensor, w_in: torch.Tensor,
              eps: float, u_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, u, rstd_z, rstd_y), u in `u_dtype`; the reciprocal RMSs have x's shape without its last dimension."""
    d = x.shape[-1]
    x2, f2 = x.reshape(-1, d).contiguous(), f.reshape(-1, d).contiguous()
    n_rows = x2.shape[0]
    y, u = torch.empty_like(x2), torch.empty_like(x2, dtype=u_dtype)
    rstd_z = torch.empty(n_rows, device=x.device, dtype=torch.float32)
    rstd_y = torch.empty_like(rstd_z)
    if n_rows:
        block = triton.next_power_of_2(d)
        _junction_fwd[(n_rows,)](x2, f2, w_out.contiguous(), w_in.contiguous(), y, u, rstd_z, rstd_y, alpha, eps, d,
                                 BLOCK=block, num_warps=_num_warps(block))
    return y.view(x.shape), u.view(x.shape), rstd_z.view(x.shape[:-1]), rstd_y.view(x.shape[:-1])


# new_empty, not empty_like: the real outputs are contiguous whatever x's strides, and the compiler plans
# its buffers by these
@_junction.register_fake
def _(x, f, alpha, w_out, w_in, eps, u_dtype):
    return (x.new_empty(x.shape), x.new_empty(x.shape, dtype=u_dtype), x.new_empty(x.shape[:-1]),
            x.new_empty(x.shape[:-1]))


@torch.library.custom_op("keel::junction_backward", mutates_args=())
def _junction_backward(x: torch.Tensor, f: torch.Tensor, w_out: torch.Tensor, w_in: torch.Tensor,
                       rstd_z: torch.Tensor, rstd_y: torch.Tensor, dy: torch.Tensor | None, du: torch.Tensor | None,
                       alpha: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, df, dw_out, dw_in); dw_in is zero when `du` is None (w_in only reaches u)."""
    d = x.shape[-1]
    x2, f2 = x.reshape(-1, d).contiguous(), f.reshape(-1, d).contiguous()
    n_rows = x2.shape[0]
    dx, df = torch.empty_like(x2), torch.empty_like(f2)
    # Each program owns a contiguous run of rows and sums its weight gradients in registers; the
    # (n_programs, d) partials are then added here, which avoids atomics and stays deterministic.
    n_programs = max(1, min(n_rows, _bwd_programs(x2.device)))
    rows_per_program = triton.cdiv(n_rows, n_programs) if n_rows else 0
    dw_out_part = torch.zeros(n_programs, d, device=x2.device, dtype=torch.float32)
    dw_in_part = torch.zeros_like(dw_out_part)
    if n_rows:
        dy2 = x2 if dy is None else dy.reshape(-1, d).contiguous()  # x2: a placeholder the kernel never reads
        du2 = x2 if du is None else du.reshape(-1, d).contiguous()
        block = triton.next_power_of_2(d)
        _junction_bwd[(n_programs,)](x2, f2, w_out.contiguous(), w_in.contiguous(), rstd_z.reshape(-1),
                                     rstd_y.reshape(-1), dy2, du2, dx, df, dw_out_part, dw_in_part, alpha, d, n_rows,
                                     rows_per_program, HAS_DY=dy is not None, HAS_DU=du is not None, BLOCK=block,
                                     num_warps=_num_warps(block))
    return dx.view(x.shape), df.view(f.shape), dw_out_part.sum(0).to(w_out.dtype), dw_in_part.sum(0).to(w_in.dtype)


@_junction_backward.register_fake
def _(x, f, w_out, w_in, rstd_z, rstd_y, dy, du, alpha):
    return x.new_empty(x.shape), f.new_empty(f.shape), w_out.new_empty(w_out.shape), w_in.new_empty(w_in.shape)


def _setup_context(ctx, inputs, output):
    x, f, alpha, w_out, w_in, _, _ = inputs
    _, _, rstd_z, rstd_y = output
    ctx.save_for_backward(x, f, w_out, w_in, rstd_z, rstd_y)
    ctx.alpha = alpha
    ctx.mark_non_differentiable(rstd_z, rstd_y)
    # An output nobody differentiates through arrives as None, so its kernel loads can be skipped.
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, du, _drstd_z, _drstd_y):
    if dy is None and du is None:
        return None, None, None, None, None, None, None
    x, f, w_out, w_in, rstd_z, rstd_y = ctx.saved_tensors
    dx, df, dw_out, dw_in = _junction_backward(x, f, w_out, w_in, rstd_z, rstd_y, dy, du, ctx.alpha)
    return dx, df, None, dw_out, None if du is None else dw_in, None, None


_junction.register_autograd(_backward, setup_context=_setup_context)


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


def _bwd_programs(device: torch.device) -> int:
    # Enough programs to fill the GPU a few times over; few on the interpreter, where each is slow.
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


if triton is None:
    _INTERPRETED = False
else:

    @triton.jit
    def _junction_fwd(x_ptr, f_ptr, w_out_ptr, w_in_ptr, y_ptr, u_ptr, rstd_z_ptr, rstd_y_ptr, alpha, eps, d,
                      BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < d  # padded lanes load 0, so they add nothing to the sums of squares
        offs = row.to(tl.int64) * d + cols  # int64: n_rows * d passes 2^31 at long context
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        f = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w_out = tl.load(w_out_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        w_in = tl.load(w_in_ptr + cols, mask=mask, other=0.0).to(tl.float32)

        z = alpha * x + f
        rstd_z = tl.rsqrt(tl.sum(z * z, axis=0) / d + eps)
        y = z * rstd_z * w_out
        rstd_y = tl.rsqrt(tl.sum(y * y, axis=0) / d + eps)
        u = y * rstd_y * w_in

        tl.store(y_ptr + offs, y, mask=mask)
        tl.store(u_ptr + offs, u.to(u_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_z_ptr + row, rstd_z)
        tl.store(rstd_y_ptr + row, rstd_y)

    @triton.jit
    def _junction_bwd(x_ptr, f_ptr, w_out_ptr, w_in_ptr, rstd_z_ptr, rstd_y_ptr, dy_ptr, du_ptr, dx_ptr, df_ptr,
                      dw_out_part_ptr, dw_in_part_ptr, alpha, d, n_rows, rows_per_program,
                      HAS_DY: tl.constexpr, HAS_DU: tl.constexpr, BLOCK: tl.constexpr):
        # RMSNorm backward, for m = v * r with r = rsqrt(mean(v^2) + eps):  dv = r * (dm - m * mean(dm * m)).
        # Applied twice: through LN_in (v = y) then through LN_out (v = z), adding the stream's own dy between.
        program = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        w_out = tl.load(w_out_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        w_in = tl.load(w_in_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw_out = tl.zeros((BLOCK,), dtype=tl.float32)
        dw_in = tl.zeros((BLOCK,), dtype=tl.float32)

        first = program.to(tl.int64) * rows_per_program  # int64, so row * d below is too
        for row in range(first, tl.minimum(first + rows_per_program, n_rows)):
            offs = row * d + cols
            x = tl.load(x_ptr + offs, mask=mask, other=0.0)
            f = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            rstd_z = tl.load(rstd_z_ptr + row)
            n = (alpha * x + f) * rstd_z  # z normalised, before its gain
            y = n * w_out

            if HAS_DY:
                grad_y = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                grad_y = tl.zeros((BLOCK,), dtype=tl.float32)
            if HAS_DU:
                du = tl.load(du_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                rstd_y = tl.load(rstd_y_ptr + row)
                m = y * rstd_y
                dw_in += du * m
                dm = du * w_in
                grad_y += rstd_y * (dm - m * (tl.sum(dm * m, axis=0) / d))

            dw_out += grad_y * n
            dn = grad_y * w_out
            dz = rstd_z * (dn - n * (tl.sum(dn * n, axis=0) / d))
            tl.store(dx_ptr + offs, alpha * dz, mask=mask)
            tl.store(df_ptr + offs, dz.to(df_ptr.dtype.element_ty), mask=mask)

        tl.store(dw_out_part_ptr + program * d + cols, dw_out, mask=mask)
        tl.store(dw_in_part_ptr + program * d + cols, dw_in, mask=mask)

    # Triton decides interpreter or compiler per kernel when it is defined, and builds its own
    # library functions (tl.sum among them) when it is imported: setting TRITON_INTERPRET later does nothing.
    _INTERPRETED = not isinstance(_junction_fwd, triton.runtime.JITFunction)
