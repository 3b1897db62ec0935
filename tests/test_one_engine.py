"""One engine: `keel train`, the experiments and the bench share one step, one config merge, one run directory."""

import json
from pathlib import Path

import pytest
import torch

from keel.cli import main
from keel.data import DataConfig
from keel.errors import ConfigError, KeelError
from keel.experiments.bench import Bench
from keel.experiments.cli import build
from keel.experiments.common import Engine, Shape, point_config, train_curve
from keel.model import ModelConfig
from keel.train import step as step_module
from keel.train.config import PRESETS, OptimConfig, Runtime, load_config, to_yaml
from keel.train.run_dir import RunDir
from keel.train.trainer import Trainer


def experiment_point(corpus, tmp_path, **runtime):
    shape = Shape(d_model=32, n_heads=2, n_kv_heads=1, seq_len=32, batch_size=4)
    data = DataConfig(source=str(corpus), cache_dir=str(tmp_path / "cache"))
    engine = Engine(run=Runtime(**runtime))
    return point_config(shape.model("keel", 8), OptimConfig(lr=3e-3, warmup_steps=3), 12, shape, data, 7, engine)


@pytest.mark.slow
def test_an_experiment_point_and_keel_train_log_the_same_losses(corpus, tmp_path):
    config = experiment_point(corpus, tmp_path, grad_accum=2)
    curve, _ = train_curve(config, eval_batches=0)
    (tmp_path / "point.yaml").write_text(to_yaml(config))
    assert main(["train", "--config", str(tmp_path / "point.yaml"), f"run.out_dir={tmp_path / 'runs'}",
                 "run.name=point"]) == 0
    logged = [r["loss"] for r in RunDir(tmp_path / "runs" / "point").metrics() if "loss" in r]
    assert len(curve.losses) == 12 and logged == curve.losses  # bit for bit


def test_every_path_trains_through_the_one_step(corpus, tmp_path, args, monkeypatch):
    calls = []
    real = step_module.TrainStep.__call__

    def counted(self, next_batch, lr):
        calls.append(type(self.model).__name__)
        return real(self, next_batch, lr)
    monkeypatch.setattr(step_module.TrainStep, "__call__", counted)
    train_curve(experiment_point(corpus, tmp_path), eval_batches=0)
    assert len(calls) == 12
    Bench(ModelConfig(n_blocks=1, d_model=32, n_heads=2, max_seq_len=16), 2, 16, torch.device("cpu")).step()
    assert len(calls) == 13
    Trainer(load_config(args("run.steps=3", "run.eval_every=0"), preset="tiny")).run()
    assert len(calls) == 16


def test_experiment_overrides_reach_the_engine(corpus, tmp_path, monkeypatch):
    """run.device / run.dtype / run.compile / run.grad_accum given to an experiment reach build_model and the step."""
    seen = {}
    real_build = step_module.build_model

    def spy(config, run, device, fsdp=False, model=None):
        seen.update(device=str(device), dtype=run.dtype, compile=run.compile)
        return real_build(config, run, device, fsdp, model)
    monkeypatch.setattr("keel.experiments.common.build_model", spy)
    cfg = build("depth", True, ["run.device=cpu", "run.dtype=bfloat16", "run.compile=false", "depths=[4]",
                                f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}"])
    assert cfg.run.dtype == "bfloat16" and cfg.run.device == "cpu"
    config = point_config(cfg.shape.model("keel", 4), OptimConfig(lr=1e-3, warmup_steps=1), 2, cfg.shape, cfg.data,
                          0, cfg)
    dtypes = []
    _, model = train_curve(config, eval_batches=1)
    assert seen == {"device": "cpu", "dtype": "bfloat16", "compile": False}
    # bf16 autocast was on: the head's matmul ran in bf16 while the residual stream stayed float32
    hooks = [model.lm_head.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype)),
             model.blocks[0].register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))]
    from keel.runtime import autocast_for

    with autocast_for(torch.device("cpu"), "bfloat16")():
        model(torch.zeros(1, 8, dtype=torch.long))
    for h in hooks:
        h.remove()
    assert dtypes == [torch.float32, torch.bfloat16]
    if not torch.cuda.is_available():  # run.device=cuda reaches the engine, which refuses it here
        with pytest.raises(ConfigError, match="run.device"):
            train_curve(point_config(cfg.shape.model("keel", 4), OptimConfig(), 1, cfg.shape, cfg.data, 0,
                                     build("depth", True, ["run.device=cuda"])))


@pytest.mark.slow
def test_compile_true_runs_the_compiled_step(corpus, tmp_path):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    config = experiment_point(corpus, tmp_path, compile=True)
    curve, model = train_curve(config, eval_batches=0)
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo traced the blocks during training
    eager, _ = train_curve(experiment_point(corpus, tmp_path), eval_batches=0)
    assert curve.losses == pytest.approx(eager.losses, rel=1e-4, abs=1e-4)


def test_every_model_preset_is_a_training_preset():
    for name in PRESETS:
        config = load_config([], preset=name)
        assert config.model.n_blocks >= 1
    assert load_config([], preset="paper-512").model.n_sublayers == 512


def test_dry_run_prints_the_model_and_memory_plan_and_writes_nothing(tmp_path, capsys):
    assert main(["train", "--preset", "paper-512", "--dry-run", f"run.out_dir={tmp_path / 'runs'}"]) == 0
    out = capsys.readouterr().out
    assert "blocks: 256   sub-layers (the paper's L): 512" in out and "parameters: 3,287,809,024" in out
    assert "memory per process" in out and "GiB" in out
    assert not (tmp_path / "runs").exists()


def test_summary_of_a_run_directory_describes_its_model(tmp_path, capsys, make_run):
    make_run(tmp_path / "run", "pre_ln")
    assert main(["summary", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "blocks: 3   sub-layers (the paper's L): 6" in out and "scheme = 'pre_ln'" in out
    assert main(["summary", str(tmp_path / "nothing")]) == 2
    assert "not a Keel run directory" in capsys.readouterr().err


def test_section_less_keys_are_model_fields_or_get_a_suggestion(capsys):
    assert load_config(["scheme=pre_ln"], preset="tiny").model.scheme == "pre_ln"
    assert main(["train", "--preset", "tiny", "steps=10"]) == 2
    assert "did you mean run.steps?" in capsys.readouterr().err


def test_run_names_never_collide(tmp_path):
    config = load_config([f"run.out_dir={tmp_path}"], preset="tiny")
    made = {RunDir.create(config).path for _ in range(3)}  # within one second: same clock name
    assert len(made) == 3 and all(p.is_dir() for p in made)
    named = load_config([f"run.out_dir={tmp_path}", "run.name=mine"], preset="tiny")
    (RunDir.create(named).path / "config.yaml").write_text("x")
    with pytest.raises(ConfigError, match="already exists"):
        RunDir.create(named)


def test_only_keel_errors_become_one_line(monkeypatch, capsys):
    import keel.cli

    def bad_input(args):
        raise KeelError("model.d_model: no")
    monkeypatch.setattr(keel.cli, "cmd_summary", bad_input)
    assert main(["summary"]) == 2 and capsys.readouterr().err == "keel: error: model.d_model: no\n"

    def bug(args):
        raise ValueError("a bug, not bad input")
    monkeypatch.setattr(keel.cli, "cmd_summary", bug)
    with pytest.raises(ValueError, match="a bug"):
        main(["summary"])


def test_experiments_take_a_config_file_like_train(tmp_path):
    (tmp_path / "e.yaml").write_text("steps: 5\nrun:\n  compile: true\n")
    cfg = build("depth", True, ["steps=6"], str(tmp_path / "e.yaml"))
    assert cfg.steps == 6 and cfg.run.compile is True
    with pytest.raises(ConfigError, match="depth: bogus"):
        build("depth", True, ["bogus=1"])


def test_trainer_metrics_land_in_its_run_dir(args, tmp_path):
    trainer = Trainer(load_config(args("run.steps=2", "run.eval_every=0"), preset="tiny"))
    trainer.run()
    assert isinstance(trainer.run_dir, RunDir) and Path(trainer.run_dir) == tmp_path / "runs" / "run"
    assert json.loads((trainer.run_dir / "summary.json").read_text())["steps"] == 2
