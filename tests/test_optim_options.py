"""Optimizer options for depth on one GPU (issue 37 item 4), checked on a CPU: the fused AdamW and torchao's 8-bit
AdamW each train a small model for 200 steps to within a stated tolerance of plain float32 foreach AdamW on the
same batches."""

import pytest

from keel.experiments.common import train_curve
from keel.model import ModelConfig
from keel.train.config import DataConfig, GuardConfig, OptimConfig, RunConfig, TrainConfig

MODEL = ModelConfig(vocab_size=256, d_model=64, n_blocks=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
# mean training loss over the last 50 of 200 steps: how far an option may sit from float32 foreach AdamW
TOLERANCE = {"fused": 1e-3, "8bit": 0.05}


def curve(**optim):
    config = TrainConfig(model=MODEL, data=DataConfig(), optim=OptimConfig(lr=3e-3, warmup_steps=20, **optim),
                         guard=GuardConfig(spike_min_history=0, loss_ceiling=0),
                         run=RunConfig(steps=200, batch_size=4, seq_len=32, seed=0, compile=False))
    result, model = train_curve(config, eval_batches=0)
    assert result.stopped_at is None
    return sum(result.losses[-50:]) / 50, result, model


@pytest.fixture(scope="module")
def plain():
    return curve(implementation="foreach")


@pytest.mark.slow
@pytest.mark.parametrize("option", [{"implementation": "fused"}, {"state": "8bit"}], ids=["fused", "8bit"])
def test_each_option_trains_within_its_tolerance_of_float32_adamw(plain, option):
    if option.get("state") == "8bit":
        pytest.importorskip("torchao")
    got, _, model = curve(**option)
    assert plain[0] < plain[1].losses[0] - 1.0  # the reference learned: the comparison means something
    assert got == pytest.approx(plain[0], abs=TOLERANCE[next(iter(option.values()))])


@pytest.mark.slow
def test_8bit_moments_are_quantised_and_a_reloaded_optimizer_steps_exactly_as_the_original(tmp_path):
    pytest.importorskip("torchao")
    import torch
    from torchao.optim.subclass_8bit import OptimState8bit

    from keel.model import TransformerLM
    from keel.train.optim import build_optimizer

    torch.manual_seed(0)
    model = TransformerLM(MODEL)
    opt = build_optimizer(model, OptimConfig(state="8bit"))
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))

    def step(optimizer):
        model(ids[:, :-1], ids[:, 1:])[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    step(opt)
    largest = max(model.parameters(), key=lambda p: p.numel())
    assert isinstance(opt.state[largest]["exp_avg"], OptimState8bit)
    torch.save(opt.state_dict(), tmp_path / "optim.pt")
    saved = torch.load(tmp_path / "optim.pt", weights_only=True)  # plain tensors: no torchao class to allow
    assert saved["state"][0]["exp_avg"].dtype == torch.uint8  # 1 byte a moment on disk, as on the device
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    step(opt)
    after = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(weights)
    reloaded = build_optimizer(model, OptimConfig(state="8bit"))
    reloaded.load_state_dict(saved)
    step(reloaded)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, after[k], rtol=0, atol=0)


@pytest.mark.slow
def test_a_tampered_8bit_moment_is_damage_not_a_traceback():
    pytest.importorskip("torchao")
    import torch

    from keel.model import TransformerLM
    from keel.train.optim import build_optimizer
    from keel.train.untrusted import Damaged, check_optimizer

    model = TransformerLM(MODEL)
    opt = build_optimizer(model, OptimConfig(state="8bit"))
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    model(ids[:, :-1], ids[:, 1:])[1].backward()
    opt.step()
    good = opt.state_dict()
    check_optimizer(good, model)  # as saved: accepted
    for name, bad in (("exp_avg", torch.zeros(3)), ("exp_avg.scale", torch.zeros(2, 2)),
                      ("exp_avg.qmap", torch.zeros(7)), ("exp_avg.codes", torch.zeros(1))):
        state = {k: dict(v) for k, v in good["state"].items()}
        state[0][name] = bad
        with pytest.raises(Damaged, match="optimizer exp_avg"):
            check_optimizer(dict(good, state=state), model)
