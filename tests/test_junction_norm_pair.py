"""A junction's two RMSNorms as one op with a one-pass backward (keel.kernels.norm_pair), against two of the model's
own RMSNorm modules differentiated by autograd, and the compiled model that runs it (keel.scale.fused_junction.NormPair)
against the plain model: numbers, compiled graphs, and the reductions Inductor generates for the backward."""

import re
from dataclasses import replace

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from keel.kernels.norm_pair import rms_norm_pair
from keel.model.architecture import ModelConfig
from keel.model.layers import LayerNorm, RMSNorm
from keel.model.transformer import TransformerLM
from keel.scale.fused_junction import FusedResidual, NormPair, apply_fused_junction, fused_junctions
from keel.scale.parallel import parallelize

CONFIG = ModelConfig(n_blocks=4, d_model=32, n_heads=2, n_kv_heads=1, max_seq_len=16, vocab_size=64)
# (width, eps of LN_in, outputs that receive a gradient); an eps of 0.5 is large enough that misplacing it shows
CASES = [(d, eps, uses) for d in (32, 200) for eps in (1e-5, 0.5) for uses in ("yu", "y", "u")]


def inputs(d: int, seed: int = 0, dtype=torch.float64) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"z": 3 * torch.randn(2, 5, d, generator=g, dtype=dtype),  # (B, T, d): the sum alpha*x + h
            # non-unit, mixed-sign gains, so a swapped or dropped gain cannot pass
            "w_out": 1 + 0.5 * torch.randn(d, generator=g, dtype=dtype),
            "w_in": 1 + 0.5 * torch.randn(d, generator=g, dtype=dtype),
            "dy": torch.randn(2, 5, d, generator=g, dtype=dtype), "du": torch.randn(2, 5, d, generator=g, dtype=dtype)}


def through(pair, t: dict, uses: str = "yu") -> list[torch.Tensor]:
    """y, u and the gradients of z, w_out and w_in, for `pair(z, w_out, w_in) -> (y, u)`."""
    z, w_out, w_in = (t[k].clone().requires_grad_() for k in ("z", "w_out", "w_in"))
    y, u = pair(z, w_out, w_in)
    outs = [(o, t[k].to(o.dtype)) for o, k in ((y, "dy"), (u, "du")) if k[1] in uses]
    grads = torch.autograd.grad([o for o, _ in outs], (z, w_out, w_in), [g for _, g in outs], allow_unused=True)
    return [y.detach(), u.detach(), *(torch.zeros_like(x) if g is None else g for x, g in zip((z, w_out, w_in), grads))]


def modules(eps_in: float):
    """The plain composition: the model's own RMSNorm modules, gains set to the given tensors."""
    def pair(z, w_out, w_in):
        norm_out, norm_in = RMSNorm(z.shape[-1], 1e-5), RMSNorm(z.shape[-1], eps_in)
        y = torch.func.functional_call(norm_out, {"weight": w_out}, (z,))
        return y, torch.func.functional_call(norm_in, {"weight": w_in}, (y,))
    return pair


def one_pass(eps_in: float, u_dtype=None):
    return lambda z, w_out, w_in: rms_norm_pair(z, w_out, w_in, 1e-5, eps_in, u_dtype)


@pytest.mark.parametrize(("d", "eps", "uses"), CASES, ids=[f"d{d}-eps{e:g}-grad_{u}" for d, e, u in CASES])
def test_one_pass_backward_equals_the_two_norms_backwards_in_float64(d, eps, uses):
    t = inputs(d)
    for got, ref, name in zip(through(one_pass(eps), t, uses), through(modules(eps), t, uses),
                              ("y", "u", "dz", "dw_out", "dw_in")):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item(), msg=name)


@pytest.mark.parametrize("eps", [1e-5, 0.5])
def test_one_pass_backward_passes_gradcheck(eps):
    t = inputs(24, seed=1)
    args = tuple(t[k].clone().requires_grad_() for k in ("z", "w_out", "w_in"))
    assert torch.autograd.gradcheck(one_pass(eps), args)


def test_u_in_the_branchs_dtype_is_the_cast_the_branch_would_make():
    """Under FSDP2's bf16 policy (bf16 gains) u is written in bf16, the dtype the next branch computes in: the same
    values as the plain norm's float32 u cast there, and y (the stream) float32 and equal; the gradients, with u's
    arriving in bf16, as the plain composition's to float32 rounding."""
    t = inputs(64, seed=2, dtype=torch.float32)
    t["w_out"], t["w_in"] = t["w_out"].bfloat16(), t["w_in"].bfloat16()
    t["du"] = t["du"].bfloat16()  # what the branch's cast hands back

    def plain(z, w_out, w_in):
        y, u = modules(1e-5)(z, w_out, w_in)
        return y, u.to(torch.bfloat16)

    got, ref = through(one_pass(1e-5, torch.bfloat16), t), through(plain, t)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    for g, r, name in zip(got[2:], ref[2:], ("dz", "dw_out", "dw_in")):
        assert g.dtype == r.dtype, name
        torch.testing.assert_close(g.float(), r.float(), rtol=1e-5, atol=1e-5 * r.abs().max().item(), msg=name)


def test_the_op_keeps_its_input_and_two_numbers_a_row_for_the_backward():
    """What autograd keeps for the one-pass backward: z (float32) and the two reciprocal RMSs per row, the gains
    being parameters; the chained norms keep z, their normalised values and y as well."""
    t = inputs(64, dtype=torch.float32)
    w_out, w_in = (torch.nn.Parameter(t[k]) for k in ("w_out", "w_in"))
    z = t["z"].requires_grad_()
    storages, saved = {}, {}

    def pack(x):
        if not isinstance(x, torch.nn.Parameter):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    for name, pair in (("one pass", one_pass(1e-5)), ("chained", modules(1e-5))):
        storages.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            pair(z, w_out, w_in)
        saved[name] = sum(storages.values())
    rows = z.numel() // z.shape[-1]
    assert saved["one pass"] == z.nbytes + 2 * rows * 4
    assert saved["chained"] >= 3 * z.nbytes


def test_other_norms_compose_the_modules():
    assert NormPair(RMSNorm(8), RMSNorm(8)).one_pass
    assert not NormPair(RMSNorm(8), RMSNorm(8), one_pass=False).one_pass
    assert not NormPair(LayerNorm(8), LayerNorm(8)).one_pass


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.max_seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def loss_and_grads(model) -> list[torch.Tensor]:
    logits, loss = model(*batch())
    loss.backward()
    return [logits.detach(), loss.detach()] + [p.grad for p in model.parameters()]


LAYOUTS = {"sum handed across blocks": {}, "under checkpointing": {"checkpointed": True},
           "looped, pairs handed on": {"config": {"loop_blocks": 2}}}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_handoff_gives_the_plain_models_outputs_and_gradients_in_float64(layout):
    """Eager, so the numbers are the op's, not a compiler's: every junction swapped (`compiled=True` says where a
    compiled model would put them) and run through `NormPair`, the logits, loss and every gradient as the plain
    model's to float64 rounding."""
    options = dict(LAYOUTS[layout])
    config = replace(CONFIG, **options.pop("config", {}))
    out = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = TransformerLM(config).double()
        if fused:
            assert apply_fused_junction(model, "composed", compiled=True, **options) > 0
            pairs = norm_pairs(model)
            assert pairs and all(p.one_pass for p in pairs)
        out.append(loss_and_grads(model))
    for got, ref in zip(*out, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())


def norm_pairs(model) -> list[NormPair]:
    """The `NormPair`s a fused model runs: inside its blocks' junctions, and where a block takes a handed-on sum."""
    found = []
    for m in model.modules():
        if isinstance(m, FusedResidual):
            found += [p for p in (getattr(m.junction, "pair", None), m.incoming) if p is not None]
    return found


@pytest.mark.slow
def test_the_float32_loss_curve_follows_the_plain_models():
    """150 AdamW steps on four batches, learning them (the loss falls from 4.1 to about 3): within 1e-6 of the
    plain model at every step. The two differ in the backward's rounding only; further on, training amplifies
    rounding until any rewrite of a norm drifts by 1e-5 (the plain model against itself with x / sqrt(.) in
    place of x * rsqrt(.) does), so the test stops before that."""
    data = torch.randint(0, CONFIG.vocab_size, (4, 2, 17), generator=torch.Generator().manual_seed(0))
    curves = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = TransformerLM(CONFIG)
        if fused:
            apply_fused_junction(model, "composed", compiled=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        losses = []
        for step in range(150):
            ids = data[step % 4]
            _, loss = model(ids[:, :-1], ids[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        curves.append(torch.tensor(losses, dtype=torch.float64))
    plain, fused = curves
    assert plain[-1] < plain[0] - 0.5  # it learns
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_compiled_handoff_keeps_the_graphs_and_the_plain_numbers():
    """Dynamo traces the op's forward and backward (no graph break, no extra graph: the same counts as with the two
    norm modules), and AOTAutograd's joint graph computes the plain model's numbers in float64."""
    out, frames = {}, {}
    for one_pass in (False, True, None):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = TransformerLM(CONFIG).double()
        backend = CompileCounterWithBackend("aot_eager")
        if one_pass is None:
            model = parallelize(model, fused_junction="off")
        else:
            model = parallelize(model, compile=True, one_pass_norms=one_pass, compile_backend=backend)
            assert fused_junctions(model) == 2 * CONFIG.n_blocks - 2
        out[one_pass] = loss_and_grads(model)
        frames[one_pass] = (backend.frame_count, sum(counters["graph_break"].values()))
    assert frames[True] == frames[False] == (2, 0)  # block 0 and every other block
    for got, ref in zip(out[True], out[None], strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())


# A reduction in Inductor's C++ code: accumulators declared (tmp_acc0 first), then the loop they sum over. A loop
# as long as the width sums along a row (a norm's mean); one as long as the rows sums a column (a gain's gradient).
_LOOP = re.compile(r"for\(int64_t x\d+=static_cast<int64_t>\(0L\); x\d+<static_cast<int64_t>\((\d+)L\)")


def row_reductions(code: str, width: int) -> int:
    """How many passes over the rows of width `width` a generated C++ module makes to reduce them."""
    loops = (_LOOP.search(part) for part in code.split("float tmp_acc0 = 0;")[1:])
    return sum(1 for m in loops if m and int(m.group(1)) == width)


@pytest.mark.slow
def test_inductor_computes_each_junctions_backward_in_one_reduction_pass():
    """Inductor on CPU, compiled blocks: in the backward of a block after the first, which holds two junctions (the
    sum handed in and the one inside), the two chained norm backwards take two passes over each row, the second
    reading the first's result; the one-pass op takes one pass for both row sums. Block 0 (no junction: two
    Pre-LN-like norms) takes two either way. Rows (B*T = 16) and width (32) differ, so a row's loop is told apart
    from a column's (the gains' gradients)."""
    from torch._functorch import config as functorch_config  # noqa: PLC0415
    from torch._inductor import config as inductor_config  # noqa: PLC0415
    from torch._inductor.utils import run_and_get_code  # noqa: PLC0415

    config = replace(CONFIG, n_blocks=2)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    passes = {}
    for one_pass in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = parallelize(TransformerLM(config), compile=True, one_pass_norms=one_pass)
        # generate each graph's code rather than load it (compiled kernels may still come from the disk cache)
        with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            _, codes = run_and_get_code(lambda m=model: m(ids[:, :-1], ids[:, 1:])[1].backward())
        backward = [c for c in codes if "tangents_1" in c]
        assert len(backward) == 2  # block 0 and block 1
        passes[one_pass] = sorted(row_reductions(c, config.d_model) for c in backward)
    assert passes == {False: [2, 4], True: [2, 2]}
