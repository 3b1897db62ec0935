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
