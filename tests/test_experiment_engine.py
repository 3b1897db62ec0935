"""One engine: `keel train`, the experiments and the bench share one step, one config merge, one run directory."""

import json
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from keel.bench.core import Bench
from keel.cli import main
from keel.cli.experiment import build
from keel.config import RunConfig, load_config, to_yaml
from keel.config.presets import PRESETS
from keel.errors import ConfigError, KeelError
from keel.experiments import store
from keel.experiments.common import point_config, train_curve
from keel.model import ModelConfig
from keel.runs.run_dir import RunDir
from keel.train import step as step_module
from keel.train.trainer import Trainer


def experiment_point(corpus, tmp_path, *size, n_sublayers=8, **run):
    cfg = build("frontier", True, [f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}", "run.steps=12",
                                   "optim.warmup_steps=3", *size, *(f"run.{k}={v}" for k, v in run.items())])
    return point_config(cfg, cfg.point_model("keel", n_sublayers), 7, lr=3e-3)


@pytest.mark.slow
def test_an_experiment_point_and_keel_train_log_the_same_losses(corpus, tmp_path):
    config = experiment_point(corpus, tmp_path, grad_accum=2)
    curve, _ = train_curve(config, eval_batches=0)
    (tmp_path / "point.yaml").write_text(to_yaml(config))
    assert main(["train", "--config", str(tmp_path / "point.yaml"), f"run.out_dir={tmp_path / 'runs'}",
                 "run.name=point"]) == 0
    logged = [r["loss"] for r in RunDir(tmp_path / "runs" / "point").metrics() if "loss" in r]
    assert len(curve.losses) == 12 and logged == curve.losses  # bit for bit


@pytest.mark.slow  # over a second in tests/durations.json
def test_every_path_trains_through_the_one_step(corpus, tmp_path, args, monkeypatch):
    calls = []
    real = step_module.TrainStep.__call__

    def counted(self, next_batch, lr):
        calls.append(type(self.model).__name__)
        return real(self, next_batch, lr)
    monkeypatch.setattr(step_module.TrainStep, "__call__", counted)
    train_curve(experiment_point(corpus, tmp_path), eval_batches=0)
    assert len(calls) == 12
    Bench(ModelConfig(n_blocks=1, d_model=32, n_heads=2, max_seq_len=16),
          RunConfig(batch_size=2, seq_len=16, device="cpu")).step()
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
    cfg = build("frontier", True, ["run.device=cpu", "run.dtype=bfloat16", "run.compile=false", "depths=[4]",
                                   f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}"])
    assert cfg.run.dtype == "bfloat16" and cfg.run.device == "cpu"
    config = point_config(replace(cfg, run=replace(cfg.run, steps=2)), cfg.point_model("keel", 4), 0, lr=1e-3,
                          warmup_steps=1)
    dtypes = []

    def watch(i, model, result):  # after step 0: record what the second training step's forward computes in
        if i == 0:
            model.blocks[0].register_forward_hook(lambda m, args, out: dtypes.append(("block", out.dtype)))
            model.lm_head.register_forward_hook(lambda m, args, out: dtypes.append(("head", out.dtype)))
    train_curve(config, eval_batches=1, on_step=watch)
    assert seen == {"device": "cpu", "dtype": "bfloat16", "compile": False}
    # the engine's own bf16 autocast was on in training: the head's matmul ran in bf16 while the residual stream
    # stayed float32
    assert dtypes[:2] == [("block", torch.float32), ("head", torch.bfloat16)]
    if not torch.cuda.is_available():  # run.device=cuda reaches the engine, which refuses it here
        with pytest.raises(ConfigError, match="run.device"):
            cuda = build("frontier", True, ["run.device=cuda"])
            train_curve(point_config(cuda, cuda.point_model("keel", 4), 0))


@pytest.mark.slow
def test_compile_true_runs_the_compiled_step(corpus, tmp_path):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    # 4 sub-layers at the size tests/test_experiments.py's compiled sweeps train (d=16, 2 x 16 tokens): the same
    # compiled blocks, which a CI run then compiles once and loads from Inductor's on-disk caches here
    size = ["model.d_model=16", "model.n_heads=2", "model.n_kv_heads=1", "run.seq_len=16", "run.batch_size=2"]
    config = experiment_point(corpus, tmp_path, *size, n_sublayers=4, compile=True)
    curve, model = train_curve(config, eval_batches=0)
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo traced the blocks during training
    eager, _ = train_curve(experiment_point(corpus, tmp_path, *size, n_sublayers=4), eval_batches=0)
    assert curve.losses == pytest.approx(eager.losses, rel=1e-4, abs=1e-4)


def test_every_model_preset_is_a_training_preset():
    from keel.model.sizes import PRESETS as MODEL_PRESETS

    assert set(PRESETS) == set(MODEL_PRESETS)  # `--preset` offers the model presets' names
    for name in PRESETS:
        config = load_config([], preset=name)
        assert config.model.n_blocks >= 1
    assert load_config([], preset="paper-512").model.n_sublayers == 512


def test_dry_run_prints_the_model_and_memory_plan_and_writes_nothing(tmp_path, capsys):
    assert main(["train", "--preset", "paper-512", "--dry-run", f"run.out_dir={tmp_path / 'runs'}"]) == 0
    out = capsys.readouterr().out
    assert "depth: 512 sub-layers (the paper's L; model.n_blocks = 256 blocks)" in out
    assert "parameters: 3,287,809,024" in out
    assert "memory per process" in out and "GiB" in out
    assert not (tmp_path / "runs").exists()


def test_summary_of_a_run_directory_describes_its_model(tmp_path, capsys, make_run):
    make_run(tmp_path / "run", "pre_ln")
    assert main(["summary", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "depth: 6 sub-layers (the paper's L; model.n_blocks = 3 blocks)" in out and "scheme = 'pre_ln'" in out
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
    (tmp_path / "e.yaml").write_text("depths: [2, 4]\nrun:\n  steps: 5\n  compile: true\n")
    cfg = build("frontier", True, ["run.steps=6"], str(tmp_path / "e.yaml"))
    assert cfg.run.steps == 6 and cfg.run.compile is True and cfg.depths == [2, 4]
    with pytest.raises(ConfigError, match="frontier: bogus"):
        build("frontier", True, ["bogus=1"])


def test_experiments_spell_every_knob_as_keel_train_does():
    """One spelling: the old experiment-only names are refused with the section they now live in, and bare
    model fields are model.<field> as in keel train."""
    cfg = build("frontier", False, ["run.steps=7", "optim.warmup_steps=3", "model.d_model=48", "run.seq_len=32",
                                    "run.batch_size=2", "n_heads=8", "ffn=gelu"])
    assert (cfg.run.steps, cfg.optim.warmup_steps, cfg.run.seq_len, cfg.run.batch_size) == (7, 3, 32, 2)
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.ffn) == (48, 8, "gelu")
    point = cfg.point_model("pre_ln", 16)
    assert (point.scheme, point.n_blocks, point.max_seq_len, point.d_model, point.ffn) == ("pre_ln", 8, 32, 48, "gelu")
    with pytest.raises(ConfigError, match=r"did you mean run\.steps"):
        build("frontier", False, ["steps=7"])
    with pytest.raises(ConfigError, match="has no field 'shape'"):
        build("frontier", False, ["shape.d_model=32"])


@pytest.mark.parametrize("name, override, why", [
    ("frontier", "model.n_blocks=4", "set per point from depths"),
    ("frontier", "n_blocks=4", "set per point from depths"),
    ("frontier", "model.scheme=pre_ln", "set per point from schemes"),
    ("frontier", "optim.lr=1e-3", "set per point from lrs"),
    ("frontier", "run.seed=3", "set per point from seeds"),
    ("frontier", "run.name=x", "no run directory"),
    ("frontier", "run.eval_every=5", "no run directory"),
])
def test_an_experiment_refuses_fields_it_does_not_use(name, override, why, tmp_path):
    with pytest.raises(ConfigError, match=f"{override.split('=')[0]}: not used here.*{why}"):
        build(name, False, [override])
    key, value = override.split("=")
    section, field = key.split(".") if "." in key else ("model", key)
    (tmp_path / "e.yaml").write_text(f"{section}:\n  {field}: {value}\n")
    with pytest.raises(ConfigError, match="not used here"):
        build(name, False, [], str(tmp_path / "e.yaml"))
    build(name, False, ["optim.warmup_steps=7"])  # a used field is fine


RESULTS = Path(__file__).parent.parent / "results"


# a study declared as data records the study as read: test_results_reports.py checks those
@pytest.mark.parametrize("folder", sorted(p.parent.parent.name for p in RESULTS.glob("*/points/config.json")
                                           if (p.parent.parent / "results.json").exists()
                                           and not re.search(r"^arms:", (p.parent.parent / "study.yaml").read_text(),
                                                             re.M)) if RESULTS.is_dir() else [])
def test_committed_sweeps_are_this_configuration_in_todays_spelling(folder):
    """Every committed sweep's study file, merged as `keel sweep` merges it, builds a config with no difference
    from the one the sweep recorded: so more seeds can be added to it, and today's defaults are the ones its
    points ran with."""
    from keel.cli.experiment import read_study
    from keel.experiments.sweep import EXECUTION_FIELDS, _differences, adds_points

    name, overrides = read_study(str(RESULTS / folder / "study.yaml"))
    cfg = build(name, False, overrides)
    recorded = json.loads((RESULTS / folder / "points" / "config.json").read_text())
    assert "shape" not in recorded and "steps" not in recorded
    mine = json.loads(json.dumps(asdict(cfg)))
    defaults = json.loads(json.dumps(asdict(type(cfg)())))
    # every sweep committed so far ran eager; today's experiments compile, which is how, not what, a point computes;
    # more seeds or a grid grown further (a rule running now, e.g. frontier grow=2) only add points
    assert [k for k in _differences(mine, recorded, defaults) if k not in adds_points(cfg) + EXECUTION_FIELDS] == []
    changed = build(name, False, [*overrides, "run.batch_size=3"])
    assert "run.batch_size" in _differences(json.loads(json.dumps(asdict(changed))), recorded, defaults)


@pytest.mark.slow
def test_a_committed_point_reruns_to_its_recorded_losses():
    """results/depth's 8-sub-layer Keel point at its chosen LR, seed 0, re-run from its study file as the engine
    builds a point: its first steps' losses are the ones committed (float32 on CPU; the schedule depends on
    run.steps, so it is the same)."""
    from keel.cli.experiment import load_study
    from keel.experiments import declared
    from keel.experiments.budget import BudgetConfig

    study = declared.read(load_study(str(RESULTS / "depth" / "study.yaml")), "depth")
    lr = store.read_results(RESULTS / "depth")["results"]["choices"][""]["keel_8"]["hp"]["optim.lr"]
    recorded = store.load(RESULTS / "depth" / "points", declared.key("keel_8", {}, {"optim.lr": lr}, 0))
    c = study.config({**study.arms["keel_8"], "optim.lr": lr})
    assert c.model.n_sublayers == 8 and c.model.scheme == "keel"
    cfg = BudgetConfig(model=c.model, data=c.data, optim=c.optim, guard=c.guard, run=c.run)
    curve, _ = train_curve(point_config(cfg, c.model, 0, lr=lr), eval_batches=0,
                           on_step=lambda i, model, result: i == 4)
    assert curve.losses == pytest.approx(recorded["losses"][:5], rel=1e-5)


@pytest.mark.slow  # over a second in tests/durations.json
def test_trainer_metrics_land_in_its_run_dir(args, tmp_path):
    trainer = Trainer(load_config(args("run.steps=2", "run.eval_every=0"), preset="tiny"))
    trainer.run()
    assert isinstance(trainer.run_dir, RunDir) and Path(trainer.run_dir) == tmp_path / "runs" / "run"
    assert json.loads((trainer.run_dir / "summary.json").read_text())["steps"] == 2


def test_keel_summary_refuses_overrides_it_does_not_read(capsys):
    assert main(["summary", "--preset", "tiny", "run.steps=5"]) == 2
    assert capsys.readouterr().err.strip() == ("keel: error: run.steps: not used by keel summary (it describes the "
                                               "model: model.* fields only)")
    assert main(["summary", "--preset", "tiny", "model.n_blocks=3", "scheme=pre_ln"]) == 0
    assert "pre_ln" in capsys.readouterr().out


def test_resume_goes_through_the_one_merge(tmp_path, make_run):
    """Resume merges like train: the bare-field shorthand and the checks apply, scoring fields may change, a
    model field may not."""
    from keel.runs.run_dir import RunDir

    make_run(tmp_path / "run")
    run = RunDir.open(tmp_path / "run")
    resumed = run.resume_config(["run.eval_tasks=[brackets]", "run.steps=7"])
    assert resumed.run.eval_tasks == ["brackets"] and resumed.run.steps == 7
    with pytest.raises(ConfigError, match="model.n_blocks=5 differs"):
        run.resume_config(["n_blocks=5"])  # shorthand reaches the model section, and is refused there
    with pytest.raises(ConfigError, match="did you mean run.steps"):
        run.resume_config(["steps=7"])
