"""Shapes, causality, determinism, counts, deep stacks and config validation."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from keel import SCHEMES, ModelConfig, TransformerLM, count_params, flops_per_token, paper_512, preset, tiny
from keel.model.sizes import PRESETS


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_shapes_and_loss(scheme):
    torch.manual_seed(0)
    model = TransformerLM(tiny(scheme=scheme))
    idx = torch.randint(0, 256, (3, 20))
    targets = torch.randint(0, 256, (3, 20))
    targets[0, :5] = -100
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 20, 256) and logits.dtype == torch.float32
    keep = targets != -100
    assert loss.item() == pytest.approx(F.cross_entropy(logits[keep], targets[keep]).item(), rel=1e-6)
    assert model(idx)[1] is None
    # untrained: near-uniform predictions over 256 tokens
    assert loss.item() == pytest.approx(math.log(256), abs=0.3)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_causal(scheme):
    torch.manual_seed(0)
    model = TransformerLM(tiny(scheme=scheme)).eval()
    idx = torch.randint(0, 256, (1, 24))
    t = 11
    changed = idx.clone()
    changed[0, t] = (idx[0, t] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_deterministic_under_seed():
    def build():
        torch.manual_seed(123)
        return TransformerLM(tiny())

    m1, m2 = build(), build()
    assert all(torch.equal(p, q) for p, q in zip(m1.state_dict().values(), m2.state_dict().values()))
    idx = torch.randint(0, 256, (2, 16))
    assert torch.equal(m1(idx)[0], m2(idx)[0])
    torch.manual_seed(124)
    assert not torch.equal(TransformerLM(tiny()).lm_head.weight, m1.lm_head.weight)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("variant", [{}, dict(ffn="gelu", tie_embeddings=True), dict(norm="layernorm", n_kv_heads=1)])
def test_param_count_matches_the_model(scheme, variant):
    config = tiny(scheme=scheme, n_blocks=3, **variant)
    model = TransformerLM(config)
    assert count_params(config) == sum(p.numel() for p in model.parameters())
    embed = 0 if config.tie_embeddings else model.embed.weight.numel()
    assert count_params(config, embedding=False) == count_params(config) - embed


def test_paper_512_is_about_3b_and_counts_by_hand():
    config = paper_512()
    assert (config.n_blocks, config.n_sublayers, config.d_model, config.n_heads, config.kv_heads, config.ffn_dim) == (
        256, 512, 1024, 16, 8, 3072)
    d, f, kv = 1024, 3072, 512
    per_block = d * d + 2 * d * kv + d * d + 3 * d * f + 4 * d  # q, k+v, o, SwiGLU, 2 sub-layers x (norm_in, norm_out)
    first_block_saves = d  # v2: the first attention sub-layer has no norm_out
    by_hand = 256 * per_block - first_block_saves + 2 * 32000 * d
    assert count_params(config) == by_hand
    assert 3.0e9 < by_hand < 3.5e9


def test_flops_per_token_formula():
    config = tiny()
    n = count_params(config, embedding=False)
    assert flops_per_token(config, 64) == 6 * n + 12 * 2 * 4 * 16 * 64


def test_presets_build_and_name_blocks_and_sublayers():
    for name, fn in PRESETS.items():
        config = fn()
        assert config.n_sublayers == 2 * config.n_blocks
        assert preset(name) == config
    assert preset("paper-1024").n_sublayers == 1024
    assert preset("cpu-demo", scheme="pre_ln").scheme == "pre_ln"
    with pytest.raises(ValueError, match="preset"):
        preset("huge")


def test_sublayers_are_listed_in_order():
    model = TransformerLM(tiny(n_blocks=3))
    subs = model.sublayers()
    assert model.n_sublayers == 6
    assert [(s.index, s.block, s.kind) for s in subs] == [
        (0, 0, "attn"), (1, 0, "ffn"), (2, 1, "attn"), (3, 1, "ffn"), (4, 2, "attn"), (5, 2, "ffn")]
    assert model.get_submodule(subs[3].path) is model.blocks[1].ffn_res


@pytest.mark.slow  # over a second in tests/durations.json
def test_1024_sublayer_keel_trains_a_step_with_finite_values():
    config = ModelConfig(vocab_size=64, d_model=32, n_blocks=512, n_heads=2, d_ffn=64, max_seq_len=16)
    torch.manual_seed(0)
    model = TransformerLM(config)
    assert model.n_sublayers == 1024 and model.sublayers()[-1].alpha == 1024.0
    idx = torch.randint(0, 64, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    # the bottom block still receives gradient (the paper's point)
    assert model.blocks[0].attn.wq.weight.grad.abs().sum() > 0


BAD = [
    (dict(d_model=65), "d_model"),
    (dict(n_heads=3, d_model=63), "n_kv_heads|d_model"),
    (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
    (dict(scheme="pre_norm"), "scheme.*keel"),
    (dict(alpha=0), "alpha"),
    (dict(alpha=-2.0), "alpha"),
    (dict(alpha="L2"), "alpha"),
    (dict(n_blocks=0), "n_blocks"),
    (dict(first_layer="v3"), "first_layer.*v2"),
    (dict(scheme="pre_ln", alpha="L"), "alpha.*keel"),
    (dict(scheme="keel", mix_ln_fraction=0.5), "mix_ln_fraction.*mix_ln"),
    (dict(scheme="mix_ln", mix_ln_fraction=1.5), "mix_ln_fraction"),
    (dict(scheme="deepnorm", deepnorm_beta="x"), "deepnorm_beta"),
    (dict(ffn="relu"), "ffn.*swiglu"),
    (dict(norm="batchnorm"), "norm.*rmsnorm"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(dropout=1.0), "dropout"),
    (dict(vocab_size=2.5), "vocab_size"),
    (dict(d_ffn=0), "d_ffn"),
]


@pytest.mark.parametrize("fields,message", BAD, ids=[str(b[0]) for b in BAD])
def test_impossible_config_names_the_field(fields, message):
    with pytest.raises(ValueError, match=f"ModelConfig.({message})"):
        replace(tiny(), **fields)
