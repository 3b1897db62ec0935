"""The memory model (keel.scale.memory) against what the model, AdamW and autograd actually hold."""

import pytest
import torch

from keel.model.config import ModelConfig
from keel.model.transformer import TransformerLM
from keel.scale.memory import activation_bytes, estimate_memory, measured_bytes, saved_activation_bytes
from keel.scale.parallel import apply_ac
from keel.train.config import OptimConfig
from keel.train.optim import build_optimizer

SCHEMES = [{}, {"scheme": "pre_ln"}, {"scheme": "hybrid_norm"}, {"scheme": "peri_ln", "ffn": "gelu"},
           {"scheme": "deepnorm", "n_kv_heads": 2}, {"scheme": "mix_ln", "tie_embeddings": True}]


@pytest.mark.parametrize("kw", SCHEMES)
def test_parameter_and_optimizer_bytes_are_exact(kw):
    cfg = ModelConfig(n_blocks=3, d_model=32, n_heads=4, max_seq_len=16, **kw)
    model = TransformerLM(cfg)
    optimizer = build_optimizer(model, OptimConfig())
    ids = torch.randint(0, 256, (2, 16))
    model(ids, ids)[1].backward()
    optimizer.step()
    estimate, measured = estimate_memory(cfg, 2, 16), measured_bytes(model, optimizer)
    assert estimate["params"] == estimate["grads"] == measured["params"]
    assert estimate["optimizer"] == measured["optimizer"]


@pytest.mark.parametrize("ac_every", [0, 1, 3])
@pytest.mark.parametrize("kw", SCHEMES)
def test_activation_bytes_match_what_autograd_saves(kw, ac_every):
    cfg = ModelConfig(n_blocks=4, d_model=64, n_heads=4, max_seq_len=32, **kw)
    model = TransformerLM(cfg)
    apply_ac(model, ac_every)
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    measured = saved_activation_bytes(model, x, y)
    assert activation_bytes(cfg, 2, 32, ac_every, recompute=False) == pytest.approx(measured, rel=0.02)
    if ac_every:  # checkpointing keeps far less, and adds back one block while it is recomputed
        assert activation_bytes(cfg, 2, 32, ac_every) > measured
        assert activation_bytes(cfg, 2, 32, ac_every) < activation_bytes(cfg, 2, 32)


def test_sharding_divides_the_states_by_the_world_size():
    cfg = ModelConfig(n_blocks=8, d_model=64, n_heads=4, max_seq_len=32)
    one, four = estimate_memory(cfg, 2, 32), estimate_memory(cfg, 2, 32, world_size=4, fsdp_group=1)
    assert four["grads"] == one["grads"] // 4
    assert four["optimizer"] < one["optimizer"] / 3
