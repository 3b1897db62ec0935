"""The fused Keel junction (keel.kernels.junction) against its equations, float64 as the independent reference.

The Triton kernels run on CPU under Triton's interpreter, which must be chosen before triton is first imported
(triton builds its own library functions, tl.sum among them, at import), and any earlier test in the session may
have imported triton already (torch.compile does). So the kernels run in one child process started with
TRITON_INTERPRET=1 (this file run as a script), and this process only builds the inputs and compares numbers.
"""

import os
import subprocess
import sys

import pytest
import torch

from keel.kernels.junction import available, keel_junction

# (width, alpha, f dtype, eps, outputs that receive a gradient, u's dtype: None = float32); 200 is not a power of
# two.
CASES = [(d, alpha, dtype, 1e-5, "yu", None) for d in (64, 96, 200) for alpha in (1.0, 32.0, 1024.0)
         for dtype in (torch.float32, torch.bfloat16)]
CASES += [(96, 32.0, torch.float32, 1e-5, "y", None), (96, 32.0, torch.float32, 1e-5, "u", None),
          (200, 1.0, torch.float32, 0.5, "yu", None),  # an eps large enough that misplacing it shows
          # u written in the branch's compute dtype, its gradient arriving in it
          (200, 32.0, torch.bfloat16, 1e-5, "yu", torch.bfloat16),
          (96, 1024.0, torch.bfloat16, 1e-5, "u", torch.bfloat16)]
IDS = [f"d{d}-alpha{alpha:g}-{str(dtype)[6:]}-eps{eps:g}-grad_{uses}" + (f"-u_{str(u)[6:]}" if u else "")
       for d, alpha, dtype, eps, uses, u in CASES]
N_ROWS = 7  # uneven over the backward kernel's 4 programs on CPU, so one program gets a short run
GRAD_NAMES = ("x", "f", "w_out", "w_in")


def make_inputs(index: int) -> dict:
    d, alpha, dtype, eps, uses, u_dtype = CASES[index]
    g = torch.Generator().manual_seed(index)
    shape = (1, N_ROWS, d)  # a leading batch dim, as the model passes (batch, seq, d)
    return {
        "x": torch.randn(shape, generator=g), "f": (3 * torch.randn(shape, generator=g)).to(dtype),
        # Non-unit, mixed-sign gains, so a swapped or dropped weight cannot pass.
        "w_out": 1 + 0.5 * torch.randn(d, generator=g), "w_in": 1 + 0.5 * torch.randn(d, generator=g),
        "dy": torch.randn(shape, generator=g) if "y" in uses else None,
        # a du already in u's dtype, so the float64 reference sees the very values the kernel reads
        "du": torch.randn(shape, generator=g).to(u_dtype or torch.float32).float() if "u" in uses else None,
        "alpha": alpha, "eps": eps, "u_dtype": u_dtype,
    }


def run_junction(inputs: dict, impl: str, dtype: torch.dtype | None = None) -> dict:
    """Outputs and the gradients of x, f, w_out, w_in (None where none flows) for one case; `dtype` (the float64
    reference) computes everything, u too, in that dtype."""
    leaves = [inputs[k].detach().to(dtype or inputs[k].dtype).requires_grad_() for k in GRAD_NAMES]
    x, f, w_out, w_in = leaves
    y, u = keel_junction(x, f, inputs["alpha"], w_out, w_in, inputs["eps"], impl=impl,
                         u_dtype=None if dtype else inputs["u_dtype"])
    upstream = [(out, inputs[k].to(out.dtype)) for out, k in ((y, "dy"), (u, "du")) if inputs[k] is not None]
    grads = torch.autograd.grad([o for o, _ in upstream], leaves, [g for _, g in upstream], allow_unused=True)
    return {"y": y.detach(), "u": u.detach(), **{f"d{k}": g for k, g in zip(GRAD_NAMES, grads)}}


def interpreted_child(inputs_path: str, results_path: str) -> None:
    results = []
    for inputs in torch.load(inputs_path):
        fused = run_junction(inputs, "triton")
        auto = run_junction(inputs, "auto")
        fused["auto_is_fused"] = available(inputs["x"]) and all(
            (a is None and b is None) or torch.equal(a, b) for a, b in zip(auto.values(), fused.values()))
        results.append(fused)
    torch.save(results, results_path)


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    pytest.importorskip("triton")
    tmp = tmp_path_factory.mktemp("junction")
    torch.save([make_inputs(i) for i in range(len(CASES))], tmp / "inputs.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, str(tmp / "inputs.pt"), str(tmp / "results.pt")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(tmp / "results.pt")


def assert_close_to(got: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5):
    """Close relative to the tensor's scale: float32 rounding, summed over a row, lands near 1e-7 of it."""
    scale = ref.abs().max().item()
    torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=rtol * scale)


@pytest.mark.slow  # the fixture runs the kernels in a child process under triton's interpreter (up to 600 s)
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_fused_matches_float64_reference(fused, index):
    assert fused[index]["auto_is_fused"], "impl='auto' did not take the fused path under the interpreter"
    check_against_float64(fused[index], make_inputs(index))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_fused_on_cuda_matches_float64_reference(index):
    pytest.importorskip("triton")
    inputs = make_inputs(index)
    on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    assert available(on_gpu["x"])
    got = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in run_junction(on_gpu, "auto").items()}
    check_against_float64(got, inputs)


def check_against_float64(got: dict, inputs: dict) -> None:
    ref = run_junction(inputs, "torch", dtype=torch.float64)
    assert got["y"].dtype == torch.float32
    assert got["u"].dtype == (inputs["u_dtype"] or torch.float32)
    if inputs["u_dtype"] is not None:  # rounded once, at the store: one bf16 step (see df below)
        assert_close_to(got["u"], ref["u"], rtol=2**-7)
    for name in ("y", "dx", "dw_out", "dw_in") + (("u",) if inputs["u_dtype"] is None else ()):
        if ref[name] is None:
            assert got[name] is None, name
        else:
            assert_close_to(got[name], ref[name])
    assert got["df"].dtype == inputs["f"].dtype
    # df is stored in f's dtype; the interpreter truncates float32 to bf16 where GPUs round to nearest,
    # so a bf16 df is allowed one bf16 step (2^-7 relative) instead of half of one.
    assert_close_to(got["df"], ref["df"], rtol=1e-5 if inputs["f"].dtype == torch.float32 else 2**-7)


def test_torch_impl_is_the_written_out_equation():
    d, alpha, eps = 96, 32.0, 1e-5
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, d, generator=g)
    f = (3 * torch.randn(3, 5, d, generator=g)).to(torch.bfloat16)
    w_out, w_in = 1 + 0.5 * torch.randn(d, generator=g), 1 + 0.5 * torch.randn(d, generator=g)
    y, u = keel_junction(x, f, alpha, w_out, w_in, eps, impl="torch")
    assert y.dtype == u.dtype == torch.float32
    _, u_bf16 = keel_junction(x, f, alpha, w_out, w_in, eps, impl="torch", u_dtype=torch.bfloat16)
    assert torch.equal(u_bf16, u.to(torch.bfloat16))

    def rms_norm(v, w):  # v / sqrt(mean(v^2) + eps) * w, spelled with a vector norm
        return v / torch.sqrt(torch.linalg.vector_norm(v, dim=-1, keepdim=True) ** 2 / d + eps) * w

    y_eq = rms_norm(alpha * x.double() + f.double(), w_out.double())
    u_eq = rms_norm(y_eq, w_in.double())
    assert_close_to(y, y_eq)
    assert_close_to(u, u_eq)


def test_triton_impl_refuses_where_it_cannot_run():
    x = torch.randn(2, 8)
    w = torch.ones(8)
    with pytest.raises(ValueError, match="impl"):
        keel_junction(x, x, 1.0, w, w, 1e-5, impl="cuda")
    with pytest.raises(ValueError, match="shape"):
        keel_junction(x, x[:, :4], 1.0, w, w, 1e-5)
    if available(x):
        pytest.skip("triton's interpreter is on in this process: the fused path can run on CPU")
    with pytest.raises(ValueError, match="cannot run"):
        keel_junction(x, x, 1.0, w, w, 1e-5, impl="triton")


if __name__ == "__main__":
    interpreted_child(*sys.argv[1:])
