"""Looped (weight-shared) Keel: k blocks applied n_blocks/k times equal the unrolled model with those blocks'
weights copied into every pass; alpha counts the unrolled sub-layers; the first-layer rule acts once; counts,
KV cache and the Hugging Face export carry the loop."""

from dataclasses import replace

import pytest
import torch

from keel.model import ModelConfig, TransformerLM, count_params, flops_per_token
from keel.model.layers import KVCache

BASE = ModelConfig(vocab_size=64, d_model=32, n_blocks=6, n_heads=4, n_kv_heads=2, max_seq_len=24, init_std=0.2)
CASES = {
    "keel-v2": dict(loop_blocks=2),
    "keel-v1": dict(loop_blocks=3, first_layer="v1"),
    "keel-none": dict(loop_blocks=1, first_layer="none"),
    "pre_ln": dict(loop_blocks=2, scheme="pre_ln"),
    "mix_ln": dict(loop_blocks=3, scheme="mix_ln"),  # Post-LN block 0 on the first pass only
}


def looped_and_unrolled(options: dict) -> tuple[TransformerLM, TransformerLM]:
    """A looped model with non-trivial norm gains, and its unrolled twin holding the same weights in every pass."""
    config = replace(BASE, **options)
    torch.manual_seed(0)
    looped = TransformerLM(config)
    with torch.no_grad():
        for p in looped.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    unrolled = TransformerLM(replace(config, loop_blocks=None))
    state = {name: looped.state_dict()[name] for name in ("embed.weight", "lm_head.weight")}
    state |= {n: t for n, t in looped.state_dict().items() if n.startswith("final_norm")}
    for i in range(config.n_blocks):
        k = config.loop_blocks
        block = looped.blocks[i % k]
        for prefix, module in (("attn", block.attn), ("ffn", block.ffn)):
            state |= {f"blocks.{i}.{prefix}.{n}": t for n, t in module.state_dict().items()}
        for kind, res in zip(("attn_res", "ffn_res"), block.residuals(later=i >= k)):
            state |= {f"blocks.{i}.{kind}.{n}": t for n, t in res.state_dict().items()}
    unrolled.load_state_dict(state, strict=True)  # every tensor of the twin is set
    return looped, unrolled


@pytest.mark.parametrize("case", CASES)
def test_a_looped_model_equals_its_unrolled_twin(case):
    looped, unrolled = looped_and_unrolled(CASES[case])
    k, n = looped.config.loop_blocks, looped.config.n_blocks
    idx = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    logits, loss = looped(idx, idx)
    twin_logits, twin_loss = unrolled(idx, idx)
    torch.testing.assert_close(logits, twin_logits, rtol=1e-5, atol=1e-5)
    assert logits.abs().max() > 1
    loss.backward()
    twin_loss.backward()
    grads = {name: p.grad for name, p in unrolled.named_parameters()}
    for b, block in enumerate(looped.blocks):
        for name, p in block.named_parameters():
            if name.startswith("later_"):  # the later passes' norms: their gradients add up over those passes
                expected = sum(grads[f"blocks.{i}.{name.removeprefix('later_')}"] for i in range(b + k, n, k))
            elif name.startswith(("attn_res", "ffn_res")) and hasattr(block, "later_attn_res"):
                expected = grads[f"blocks.{b}.{name}"]  # the first pass's own norms
            else:  # shared weights: the sum over every pass
                expected = sum(grads[f"blocks.{i}.{name}"] for i in range(b, n, k))
            torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-6, msg=f"blocks.{b}.{name}")
    for name in ("embed.weight", "lm_head.weight"):
        torch.testing.assert_close(looped.get_parameter(name).grad, grads[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_alpha_counts_the_unrolled_sublayers_and_the_first_layer_rule_acts_once(case):
    looped, unrolled = looped_and_unrolled(CASES[case])
    subs, twin = looped.sublayers(), unrolled.sublayers()
    assert len(subs) == 2 * looped.config.n_blocks == 12
    for a, b in zip(subs, twin):
        assert (a.index, a.kind, a.alpha, a.norm_in, a.norm_out) == (b.index, b.kind, b.alpha, b.norm_in, b.norm_out)
        assert looped.get_submodule(a.path).alpha == a.alpha  # the path names the module that computes it
    if looped.config.scheme == "keel" and looped.config.first_layer in (None, "v2"):
        assert [s.alpha for s in subs] == [1, 1] + [12] * 10  # alpha = L of the unrolled depth
        assert [s.norm_out for s in subs[:3]] == [False, True, True]
        assert hasattr(looped.blocks[0], "later_attn_res") and not hasattr(looped.blocks[1], "later_attn_res")
    if case in ("keel-none", "pre_ln"):  # nothing differs on the first pass: no extra norms
        assert not any(hasattr(b, "later_attn_res") for b in looped.blocks)


@pytest.mark.parametrize("case", CASES)
def test_counts_share_parameters_and_flops_follow_the_unrolled_depth(case):
    looped, unrolled = looped_and_unrolled(CASES[case])
    config = looped.config
    assert count_params(config) == sum(p.numel() for p in looped.parameters())
    assert len(looped.blocks) == config.loop_blocks
    per_block = sum(p.numel() for n, p in unrolled.blocks[1].named_parameters() if p.dim() > 1)
    assert count_params(config) <= count_params(unrolled.config) - (config.n_blocks - config.loop_blocks) * per_block
    assert flops_per_token(config, 16) == flops_per_token(unrolled.config, 16)


def test_the_kv_cache_gives_every_pass_its_own_slot():
    looped, _ = looped_and_unrolled(CASES["keel-v2"])
    looped.eval()
    idx = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _ = looped(idx)
        cache = KVCache()
        steps = [looped(idx[:, :5], cache=cache)[0]] + [looped(idx[:, t:t + 1], cache=cache)[0] for t in range(5, 12)]
    assert len(cache.layers) == looped.config.n_blocks  # one slot per unrolled attention sub-layer
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options, allowed", [
    (dict(loop_blocks=4), "a divisor of n_blocks"),
    (dict(loop_blocks=0), "a divisor of n_blocks"),
    (dict(loop_blocks=1, scheme="mix_ln", mix_ln_fraction=0.5), "a scheme whose layout repeats"),
])
def test_invalid_loops_are_refused(options, allowed):
    with pytest.raises(ValueError, match=allowed):
        replace(BASE, **options)


def test_the_hugging_face_export_carries_the_loop(tmp_path, make_run):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from keel.generate import generate
    from keel.hf import register
    from keel.hf.export import export_run

    register()  # KeelConfig / KeelForCausalLM with the Auto classes, as `keel.hf.register()` documents

    model = make_run(tmp_path / "run", loop_blocks=1)  # 3 passes of one block
    out = export_run(tmp_path / "run", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.loop_blocks == 1 and len(hf.model.blocks) == 1
    idx = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, _ = model(idx)
        got = hf(idx).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    prompt = torch.tensor([list(b"def ")])
    assert torch.equal(hf.generate(prompt, max_new_tokens=12, do_sample=False),
                       generate(model, prompt, 12, temperature=0))  # through transformers' own cache
