"""Per-sub-layer telemetry against an independent measurement: gradient norms and stream RMS as gradflow's own
hooks measure them, |F| / |alpha x| by hand; the stream read through a fused junction."""

import pytest
import torch

from keel.model import ModelConfig, TransformerLM
from keel.scale.distributed import World
from keel.train import telemetry as telemetry_module
from keel.train.telemetry import Telemetry
from keel_studies.gradflow import measure


def test_telemetry_equals_an_independent_measurement():
    """Per-sub-layer gradient norms and stream RMS as gradflow's own hooks measure them; |F| / |alpha x| by hand."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(d_model=32, n_blocks=3, n_heads=2, max_seq_len=16))
    x = torch.randint(0, 256, (2, 16))
    expected = measure(model, x, x)
    telemetry = Telemetry(model, World())
    telemetry.start()
    model.zero_grad()
    _, loss = model(x, x)
    loss.backward()
    telemetry.after_backward(model)
    record = telemetry.finish(step=1)
    assert record["grad_norm"] == pytest.approx(expected["grad_params"], rel=1e-5)
    assert record["stream_rms"] == pytest.approx(expected["rms"], rel=1e-5)
    # sub-layer 3 (block 1, ffn) by hand: rms of the FFN's output over alpha * rms of its residual input
    seen = {}
    block = model.blocks[1]
    hooks = [block.ffn_res.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0])),
             block.ffn.register_forward_hook(lambda m, a, o: seen.__setitem__("f", o))]
    model(x)
    for h in hooks:
        h.remove()
    by_hand = seen["f"].pow(2).mean().sqrt() / (block.ffn_res.alpha * seen["x"].pow(2).mean().sqrt())
    assert record["update_ratio"][3] == pytest.approx(by_hand.item(), rel=1e-5)
    assert not model.blocks[0].attn._forward_hooks  # hooks removed after the step


def test_telemetry_reads_the_stream_through_a_fused_junction():
    """With the fused junction a Residual passes (stream, next branch input) on; telemetry measures the stream."""
    y = torch.full((2, 3), 2.0)
    assert telemetry_module._rms((y, torch.zeros(2, 3))) == telemetry_module._rms(y) == 2.0
