"""The engine's parts against written-out expectations: schedules, decay groups, guard, sampling filters."""

import math

import pytest
import torch

from keel import TransformerLM, tiny
from keel.config import ConfigError, GuardConfig, OptimConfig, load_config
from keel.generate import filter_logits
from keel.train.guard import DivergenceGuard
from keel.train.optim import build_optimizer, lr_at


def test_cosine_schedule_points():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr=0.1)
    assert lr_at(0, 110, cfg) == pytest.approx(0.1)  # linear warm-up from 0: step 0 gets 1/10
    assert lr_at(9, 110, cfg) == pytest.approx(1.0)
    assert lr_at(10, 110, cfg) == pytest.approx(1.0)
    assert lr_at(60, 110, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 50 / 99)))
    assert lr_at(109, 110, cfg) == pytest.approx(0.1)


def test_wsd_and_constant_schedules():
    wsd = OptimConfig(lr=1.0, warmup_steps=0, min_lr=0.0, schedule="wsd", decay_fraction=0.2)
    assert [lr_at(s, 100, wsd) for s in (0, 79)] == [1.0, 1.0]
    assert lr_at(80, 100, wsd) == pytest.approx(1.0) and lr_at(99, 100, wsd) == pytest.approx(0.0)
    assert lr_at(90, 100, wsd) == pytest.approx(1 - 10 / 19)
    const = OptimConfig(lr=0.5, warmup_steps=4, schedule="constant")
    assert lr_at(1, 100, const) == pytest.approx(0.25) and lr_at(99, 100, const) == 0.5


def test_weight_decay_only_on_weight_matrices():
    model = TransformerLM(tiny(tie_embeddings=False))
    decay, no_decay = build_optimizer(model, OptimConfig()).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert {names[id(p)] for p in no_decay["params"]} == {
        n for n, p in model.named_parameters() if p.dim() == 1 or n == "embed.weight"}
    assert "lm_head.weight" in {names[id(p)] for p in decay["params"]}
    everything = build_optimizer(model, OptimConfig(decay_norms_and_embeddings=True)).param_groups
    assert len(everything[1]["params"]) == 0


def test_guard_rules_on_synthetic_losses():
    guard = DivergenceGuard(GuardConfig(spike_factor=3.0, spike_window=10, spike_min_history=5))
    for loss in (4.0, 3.0, 2.5, 2.2, 2.0):
        assert guard.check(loss, 1.0) is None
    assert guard.check(6.0, 1.0) is None  # below 3 x median(2.5) = 7.5
    assert "loss spike" in guard.check(9.0, 1.0)  # above 3 x median(2.75) = 8.25
    assert "non-finite loss" in guard.check(float("nan"), 1.0)
    assert "non-finite gradient" in guard.check(2.0, float("inf"))
    early = DivergenceGuard(GuardConfig(spike_min_history=5))
    assert early.check(100.0, 1.0) is None  # too little history to call a spike


def test_spike_rule_needs_an_absolute_rise_too():
    # a model that memorised its data: median 0.035, one batch at 0.113 is 3.2x the median but 0.08 nats
    guard = DivergenceGuard(GuardConfig(spike_factor=3.0, spike_window=10, spike_min_history=5))
    for _ in range(5):
        assert guard.check(0.035, 1.0) is None
    assert guard.check(0.113, 1.0) is None
    assert guard.check(0.5, 1.0) is None  # 14x the median, but only 0.465 above it (< 0.5)
    assert "loss spike" in guard.check(0.6, 1.0)  # 0.565 above: a real jump at low loss
    strict = DivergenceGuard(GuardConfig(spike_factor=3.0, spike_window=10, spike_min_history=5, spike_min_rise=0))
    for _ in range(5):
        strict.check(0.035, 1.0)
    assert "loss spike" in strict.check(0.113, 1.0)  # the factor alone, as before


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True]]
    # nucleus 0.7: 0.5 alone is below 0.7, 0.5 + 0.3 reaches it -> keep the first two
    assert torch.isinf(filter_logits(logits, top_p=0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.5)).tolist() == [[False, True, True, True]]
    assert not torch.isinf(filter_logits(logits)).any()


def test_config_precedence_yaml_then_overrides(tmp_path):
    yaml = tmp_path / "exp.yaml"
    yaml.write_text("model:\n  n_blocks: 6\n  scheme: pre_ln\nrun:\n  steps: 7\n")
    config = load_config(["run.steps=9"], str(yaml), preset="tiny")
    assert (config.model.n_blocks, config.model.scheme, config.run.steps) == (6, "pre_ln", 9)
    assert config.model.d_model == 64  # from the tiny preset
    with pytest.raises(ConfigError, match="config file"):
        load_config([], str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="model.n_blocks"):
        load_config(["model.n_blocks=many"])


def test_guard_catches_a_blow_up_from_the_first_step():
    """Without history the spike rule is blind; the ceiling (3 x ln V) is not."""
    guard = DivergenceGuard(GuardConfig(), vocab_size=256)  # ceiling 3 x 5.545 = 16.6
    assert guard.check(5.6, 1.0) is None
    assert "loss blow-up" in guard.check(51.0, 1.0)
    assert DivergenceGuard(GuardConfig(loss_ceiling=0), vocab_size=256).check(51.0, 1.0) is None
