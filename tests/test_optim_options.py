"""Optimizer options for depth on one GPU, checked on a CPU: the fused AdamW, torchao's 8-bit
AdamW and bf16 weights with stochastically rounded updates (alone and with 8-bit moments) each train a small model
for 200 steps to within a stated tolerance of plain float32 foreach AdamW on the same batches."""

import pytest

from keel.config import DataConfig, GuardConfig, OptimConfig, RunConfig, TrainConfig
from keel.experiments.common import train_curve
from keel.model import ModelConfig

MODEL = ModelConfig(vocab_size=256, d_model=64, n_blocks=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
# mean training loss over the last 50 of 200 steps: how far an option may sit from float32 foreach AdamW
# (bf16 weights: bf16 compute too, so the same bound as 8-bit moments, stated before the first run)
TOLERANCE = {"fused": 1e-3, "8bit": 0.05, "bf16-weights": 0.05, "bf16-weights-8bit": 0.05}
BF16 = {"weights": "bfloat16", "dtype": "bfloat16"}  # run fields: bf16 weights need bf16 compute on a CPU


def curve(run=None, **optim):
    config = TrainConfig(model=MODEL, data=DataConfig(), optim=OptimConfig(lr=3e-3, warmup_steps=20, **optim),
                         guard=GuardConfig(spike_min_history=0, loss_ceiling=0),
                         run=RunConfig(steps=200, batch_size=4, seq_len=32, seed=0, compile=False, **(run or {})))
    result, model = train_curve(config, eval_batches=0)
    assert result.stopped_at is None
    return sum(result.losses[-50:]) / 50, result, model


@pytest.fixture(scope="module")
def plain():
    return curve(implementation="foreach")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "option"), [("fused", {"implementation": "fused"}), ("8bit", {"state": "8bit"}),
                                             ("bf16-weights", {"run": BF16}),
                                             ("bf16-weights-8bit", {"run": BF16, "state": "8bit"})])
def test_each_option_trains_within_its_tolerance_of_float32_adamw(plain, name, option):
    if name != "fused":
        pytest.importorskip("torchao")
    got, _, model = curve(**option)
    assert plain[0] < plain[1].losses[0] - 1.0  # the reference learned: the comparison means something
    assert got == pytest.approx(plain[0], abs=TOLERANCE[name])
    if "run" in option:  # the weights really were bf16 all along, and the moments as configured
        import torch
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


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
    from keel.runs.untrusted import Damaged, check_optimizer
    from keel.train.optim import build_optimizer

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


def test_bf16_weights_refuse_float32_compute_and_fsdp_in_one_line(tmp_path, capsys):
    """run.weights=bfloat16 computes in bf16: float32 compute (run.dtype=float32, or auto on a CPU) and FSDP2
    (which has its own bf16 policy over float32 shards) are refused naming the field, before any run directory."""
    import torch

    from keel.cli import main
    from keel.errors import ConfigError
    from keel.model import TransformerLM
    from keel.train.step import hold_bf16_weights

    out = tmp_path / "runs"
    for extra, said in ((["run.dtype=float32"], "run.weights=bfloat16 computes in bf16: set run.dtype"),
                        ([], "run.dtype=auto on cpu computes in float32: set run.dtype=bfloat16"),
                        (["run.weights=bf16"], "run.weights: got 'bf16'; allowed: float32, bfloat16")):
        weights = [] if extra == ["run.weights=bf16"] else ["run.weights=bfloat16"]
        assert main(["train", "--preset", "tiny", *weights, *extra, f"run.out_dir={out}", "run.progress=false"]) == 2
        assert said in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())
    with pytest.raises(ConfigError, match="FSDP2"):
        hold_bf16_weights(TransformerLM(MODEL), RunConfig(weights="bfloat16", dtype="bfloat16"), torch.device("cpu"),
                          fsdp=True)


def test_dry_run_names_bf16_weights_where_only_they_make_a_model_fit():
    """A shape that 8-bit moments and checkpointing do not fit on an 80 GB GPU but bf16 weights do (by the plan):
    `--dry-run`'s fit line names run.weights=bfloat16."""
    from keel.reporting.plan import gpu_fit_lines
    from keel.scale.memory import estimate_memory

    config = TrainConfig(model=ModelConfig(d_model=1024, n_blocks=704, n_heads=16, max_seq_len=4096),
                         run=RunConfig(batch_size=1, seq_len=4096))
    need = {w: estimate_memory(config.model, 1, 4096, ac_every=1, bf16_autocast=True, optim_impl="fused",
                               state="8bit", weights=w)["total"] for w in ("float32", "bfloat16")}
    assert need["bfloat16"] < 79 * 2**30 < need["float32"]  # the premise, by the plan
    h100 = next(line for line in gpu_fit_lines(config) if "H100" in line)
    assert "fits with run.weights=bfloat16 optim.state=8bit run.ac_every=1" in h100
