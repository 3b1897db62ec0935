"""Under bf16 autocast the residual stream and Keel's shortcut sum stay float32 and keep every update."""

import pytest
import torch

from keel import ModelConfig, TransformerLM


@pytest.mark.slow  # over a second in tests/durations.json
def test_bf16_autocast_keeps_the_stream_and_the_sum_in_float32():
    config = ModelConfig(vocab_size=64, d_model=32, n_blocks=256, n_heads=2, d_ffn=64, max_seq_len=16)
    torch.manual_seed(0)
    model = TransformerLM(config)
    block = model.blocks[100]  # a full Keel sub-layer: alpha = L = 512
    seen = {}
    hooks = [
        block.ffn_res.register_forward_pre_hook(lambda m, args: seen.update(x=args[0])),
        block.ffn.register_forward_hook(lambda m, args, out: seen.update(h=out)),
        block.ffn_res.norm_out.register_forward_pre_hook(lambda m, args: seen.update(s=args[0])),
    ]
    dtypes = []
    for res in [b.attn_res for b in model.blocks] + [b.ffn_res for b in model.blocks]:
        hooks.append(res.register_forward_hook(lambda m, args, out: dtypes.append(out.dtype)))
    idx = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, idx)
    for h in hooks:
        h.remove()

    assert seen["h"].dtype == torch.bfloat16  # the branch really ran in bf16
    assert seen["x"].dtype == seen["s"].dtype == torch.float32
    assert set(dtypes) == {torch.float32} and len(dtypes) == 512
    alpha = block.ffn_res.alpha
    assert alpha == 512.0
    x, h, s = seen["x"], seen["h"].float(), seen["s"]
    # the float32 sum keeps the branch's update, up to float32 rounding of alpha*x ...
    update = s - alpha * x
    ulp32 = torch.finfo(torch.float32).eps * (alpha * x).abs().max().item()
    assert torch.allclose(update, h, rtol=0, atol=2 * ulp32)
    assert (update - h).abs().mean() < 0.05 * h.abs().mean()
    # ... whereas a bf16 sum would lose most of it: the update is below bf16 resolution of alpha*x
    bf16_update = ((alpha * x).bfloat16() + h.bfloat16()).float() - alpha * x
    assert (bf16_update - h).abs().mean() > 0.5 * h.abs().mean()
    assert torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_under_autocast_a_branch_casts_its_input_once_with_the_values_autocast_would_make(monkeypatch):
    """Each branch casts the float32 stream to autocast's dtype once (keel.model.layers.compute_dtype) instead of
    leaving autocast to cast it again for each of its matmuls (q, k, v; up and gate): the same logits bit for
    bit as the per-matmul casts, and fewer float32 -> bf16 copies of activations."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from keel.model import layers

    config = ModelConfig(vocab_size=64, d_model=32, n_blocks=4, n_heads=2, d_ffn=64, max_seq_len=16)
    torch.manual_seed(0)
    model = TransformerLM(config)
    idx = torch.randint(0, 64, (2, 16))

    class Casts(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32 \
                    and kwargs.get("dtype") == torch.bfloat16 and args[0].dim() == 3:  # activations, not weights
                Casts.n += 1
            return func(*args, **kwargs)

    def run():
        Casts.n = 0
        with torch.autocast("cpu", dtype=torch.bfloat16), Casts():
            logits, _ = model(idx)
        return logits, Casts.n

    once, n_once = run()
    monkeypatch.setattr(layers, "compute_dtype", lambda x, weight: x.to(weight.dtype))  # the per-matmul casts
    each, n_each = run()
    assert torch.equal(once, each)
    # one per branch against 3 + 2, and one for the head, whose input is the float32 stream either way
    assert (n_once, n_each) == (2 * config.n_blocks + 1, 5 * config.n_blocks + 1)
