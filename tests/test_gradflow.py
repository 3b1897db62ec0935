"""gradflow's backward factors against independent numbers: the hook-measured stream gradients against autograd
from a leaf tensor (the blocks run by hand), and the shortcut-only factor against the Jacobian of
norm_out(alpha x + F) written out (RMSNorm, F held fixed)."""

import math

import pytest
import torch

from keel import TransformerLM, tiny
from keel.errors import ConfigError
from keel.evals.surgery import branches_off
from keel.experiments import store
from keel.model import lm_loss
from keel_studies.gradflow import _refuse_points_without_backward_factors, measure, predicted_factor, summary

D = 32


def model_for(scheme: str, n_blocks: int = 3) -> TransformerLM:
    """Float64, matched init (|F| ~ |x|, so neighbouring sub-layers' gradients differ visibly), every norm gain
    drawn from U(0.5, 1.5) so that gamma enters the numbers."""
    torch.manual_seed(0)
    config = tiny(scheme=scheme, n_blocks=n_blocks, d_model=D, n_heads=2, n_kv_heads=1, d_ffn=96,
                  init_std=1 / math.sqrt(D))
    model = TransformerLM(config).double()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def sublayer(model, i: int, x: torch.Tensor) -> torch.Tensor:
    """Sub-layer i applied to the stream x, called directly (not through Block.forward)."""
    block, T = model.blocks[i // 2], x.shape[1]
    if i % 2 == 0:
        return block.attn_res(x, block.attn, model.rope_cos[:T], model.rope_sin[:T], None)
    return block.ffn_res(x, block.ffn)


def streams(model, idx) -> list[torch.Tensor]:
    """x_0 .. x_L by hand, without gradients."""
    with torch.no_grad():
        xs = [model.embed_tokens(idx)]
        for i in range(model.n_sublayers):
            xs.append(sublayer(model, i, xs[-1]))
    return xs


def grad_from_leaf(model, i: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
    """dL/dx_i with x_i a fresh leaf: sub-layers i..L-1 and the head run from it, then torch.autograd.grad."""
    leaf = x.clone().requires_grad_(True)
    h = leaf
    for j in range(i, model.n_sublayers):
        h = sublayer(model, j, h)
    loss = lm_loss(model.head(h), y)
    (g,) = torch.autograd.grad(loss, leaf)
    return g, loss.item()


def batch():
    torch.manual_seed(1)
    idx = torch.randint(0, 256, (2, 16))
    return idx, torch.roll(idx, -1, dims=1)


@pytest.mark.parametrize("scheme", ["post_ln", "pre_ln", "keel", "deepnorm", "peri_ln"])
def test_hook_stream_gradients_equal_autograd_from_a_leaf(scheme):
    model = model_for(scheme)
    idx, y = batch()
    m = measure(model, idx, y)
    xs = streams(model, idx)
    L = model.n_sublayers
    by_leaf = []
    for i in range(L + 1):
        g, loss = grad_from_leaf(model, i, xs[i], y)
        by_leaf.append(g.norm().item())
        assert loss == pytest.approx(m["loss"], rel=1e-9)
    assert m["grad_stream"] == pytest.approx(by_leaf[:L], rel=1e-6)
    assert m["grad_out"] == pytest.approx(by_leaf[1:], rel=1e-6)
    assert m["jacobian"] == pytest.approx([by_leaf[i] / by_leaf[i + 1] for i in range(L)], rel=1e-6)
    # the comparison can tell neighbouring sub-layers apart: an off-by-one would fail it
    assert max(abs(by_leaf[i] / by_leaf[i + 1] - 1) for i in range(L)) > 1e-3
    # the product of Jacobian factors over 2..L-1 telescopes to |g_2| / |g_L|
    assert summary(m, L)["product_jacobian"] == pytest.approx(by_leaf[2] / by_leaf[L], rel=1e-6)


def rmsnorm_vjp(s: torch.Tensor, gamma: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """g^T d(gamma * s / r)/ds, r = sqrt(mean(s^2) + eps) per token:
    (gamma g) / r - s * sum(gamma g s) / (d r^3)."""
    d = s.shape[-1]
    r = (s.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    gg = gamma * g
    return gg / r - s * (gg * s).sum(-1, keepdim=True) / (d * r**3)


@pytest.mark.parametrize("scheme,index,branch_on", [
    ("keel", 3, False), ("keel", 4, False), ("keel", 3, True), ("keel", 1, True), ("post_ln", 3, True),
    ("post_ln", 2, False)])
def test_shortcut_factor_equals_the_written_out_norm_jacobian(scheme, index, branch_on):
    """Shortcut-only factor of sub-layer `index` = |alpha * VJP_RMSNorm(alpha x + F; g)| / |g|, with F held fixed
    (F = 0 when the branch is switched off, then the sub-layer is norm_out(alpha x) and the shortcut is all of
    its Jacobian)."""
    model = model_for(scheme)
    idx, y = batch()
    off = [] if branch_on else [index]
    with branches_off(model, off):
        m = measure(model, idx, y)
        xs = streams(model, idx)
        g, _ = grad_from_leaf(model, index + 1, xs[index + 1], y)  # dL/dx_(index+1), independent of measure
        block = model.blocks[index // 2]
        res = block.attn_res if index % 2 == 0 else block.ffn_res
        x = xs[index]
        with torch.no_grad():
            if branch_on:
                u = x if res.norm_in is None else res.norm_in(x)
                T = x.shape[1]
                f = block.attn(u, model.rope_cos[:T], model.rope_sin[:T]) if index % 2 == 0 else block.ffn(u)
            else:
                f = torch.zeros_like(x)
    alpha = res.alpha
    assert alpha == (model.n_sublayers if scheme == "keel" and index >= 2 else 1.0)
    gx = alpha * rmsnorm_vjp(alpha * x + f, res.norm_out.weight.detach(), g, res.norm_out.eps)
    want = (gx.norm() / g.norm()).item()
    assert m["shortcut"][index] == pytest.approx(want, rel=1e-6)
    if branch_on:  # the branch's gradient is excluded from the shortcut factor, included in the Jacobian factor
        assert abs(m["jacobian"][index] / m["shortcut"][index] - 1) > 1e-3
    else:
        assert m["jacobian"][index] == pytest.approx(want, rel=1e-6)


def test_a_shortcut_without_norm_passes_the_gradient_unchanged():
    model = model_for("pre_ln")
    m = measure(model, *batch())
    assert m["shortcut"] == pytest.approx([1.0] * model.n_sublayers, rel=1e-12)


def test_predicted_factor_is_eq15_and_eq19():
    for scheme, want in (("post_ln", 1 / math.sqrt(2)), ("keel", 8 / math.sqrt(65)), ("pre_ln", 1.0),
                         ("deepnorm", 8**0.25 / math.sqrt(8**0.5 + 1))):
        subs = TransformerLM(tiny(scheme=scheme, n_blocks=4)).sublayers()
        assert predicted_factor(subs[5]) == pytest.approx(want, rel=1e-12)


def test_points_measured_before_the_backward_factors_are_refused(tmp_path):
    (tmp_path / "points").mkdir()
    store.write(tmp_path / "points", "keel-4-default-seed0", {"at_init": {"factor": [1.0]}})
    with pytest.raises(ConfigError, match="backward factors"):
        _refuse_points_without_backward_factors(tmp_path, {"keel-4-default-seed0": None})
