"""Every scheme against its written-out equation (tests/reference.py), in float64 and float32."""

import math

import pytest
import torch

import reference
from keel import SCHEMES, TransformerLM, tiny

CASES = [
    dict(scheme="pre_ln"),
    dict(scheme="post_ln"),
    dict(scheme="deepnorm"),
    dict(scheme="deepnorm", deepnorm_beta="paper"),
    dict(scheme="mix_ln"),
    dict(scheme="mix_ln", mix_ln_fraction=0.5),
    dict(scheme="peri_ln"),
    dict(scheme="hybrid_norm"),
    dict(scheme="keel"),
    dict(scheme="keel", first_layer="v1"),
    dict(scheme="keel", first_layer="none"),
    dict(scheme="keel", alpha="sqrtL"),
    dict(scheme="keel", alpha=2.5),
    dict(scheme="keel", alpha="7"),
    dict(scheme="keel", norm="layernorm"),
    dict(scheme="pre_ln", ffn="gelu", tie_embeddings=True),
    dict(scheme="keel", ffn="gelu", n_kv_heads=4),
]


def randomised(config, seed=0):
    """A model whose norm gains are random too, so a gain in the wrong place shows."""
    torch.manual_seed(seed)
    model = TransformerLM(config)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def test_every_scheme_is_covered():
    assert {c["scheme"] for c in CASES} == set(SCHEMES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_scheme_matches_its_equation(case):
    config = tiny(n_blocks=4, **case)
    model = randomised(config)
    idx = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = reference.forward(model, idx)
    got64, _ = model.double()(idx)  # exact but for the RoPE tables, which are computed in float32
    torch.testing.assert_close(got64, expected, rtol=1e-6, atol=1e-7)
    got32, _ = model.float()(idx)
    torch.testing.assert_close(got32.double(), expected, rtol=1e-4, atol=1e-4)


def test_keel_alpha_and_first_layer_layout():
    config = tiny(n_blocks=8, scheme="keel")
    subs = TransformerLM(config).sublayers()
    assert [s.alpha for s in subs[:3]] == [1.0, 1.0, 16.0]
    assert (subs[0].norm_in, subs[0].norm_out) == (True, False)
    assert (subs[1].norm_in, subs[1].norm_out) == (True, True)
    assert all(s.alpha == 16.0 and s.norm_in and s.norm_out for s in subs[2:])
    sqrt = TransformerLM(tiny(n_blocks=8, alpha="sqrtL", first_layer="none")).sublayers()
    assert all(s.alpha == pytest.approx(4.0) for s in sqrt)


def test_deepnorm_init_scales_the_projections_deepnet_names():
    n_blocks = 8  # M = 8 decoder layers: a = 16^(1/4) = 2, b = 64^(-1/4)
    torch.manual_seed(0)
    model = TransformerLM(tiny(n_blocks=n_blocks, d_model=128, d_ffn=512, scheme="deepnorm"))
    beta = (8 * n_blocks) ** -0.25
    assert model.sublayers()[0].alpha == pytest.approx((2 * n_blocks) ** 0.25)
    std = {}
    for name, p in model.named_parameters():
        key = name.split(".")[-2]
        if name.startswith("blocks."):
            std.setdefault(key, []).append(p.std().item())
    for key, expect in dict(wq=0.02, wk=0.02, wv=0.02 * beta, wo=0.02 * beta,
                            w_gate=0.02 * beta, w_up=0.02 * beta, w_down=0.02 * beta).items():
        assert sum(std[key]) / len(std[key]) == pytest.approx(expect, rel=0.05), key
    paper = TransformerLM(tiny(n_blocks=n_blocks, scheme="deepnorm", deepnorm_beta="paper")).scheme
    assert paper.b == pytest.approx((2 * n_blocks) ** -0.25) and paper.b / beta == pytest.approx(math.sqrt(2))


def test_mix_ln_splits_by_blocks():
    subs = TransformerLM(tiny(n_blocks=8, scheme="mix_ln")).sublayers()
    post = [s.block for s in subs if s.norm_out]
    assert post == [0, 0, 1, 1]  # floor(0.25 * 8) = 2 blocks
    assert all(s.norm_in and not s.norm_out for s in subs[4:])


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_final_norm_exactly_where_the_stack_does_not_end_in_one(scheme):
    model = TransformerLM(tiny(scheme=scheme))
    ends_in_norm = model.sublayers()[-1].norm_out
    assert isinstance(model.final_norm, torch.nn.Identity) == ends_in_norm
