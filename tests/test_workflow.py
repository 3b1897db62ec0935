"""The user's day around runs: list, compare, plot, watch per-sub-layer telemetry, track, read summaries."""

import json
import math
import os

import pytest
import torch

from keel.cli import main
from keel.config import load_config
from keel.model import ModelConfig, TransformerLM
from keel.runs.run_dir import RunDir
from keel.scale.distributed import World
from keel.train.telemetry import Telemetry


def test_telemetry_equals_an_independent_measurement():
    """Per-sub-layer gradient norms and stream RMS as gradflow's own hooks measure them; |F| / |alpha x| by hand."""
    from keel_studies.gradflow import measure

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


@pytest.mark.slow
def test_two_runs_listed_compared_plotted_and_watched(args, tmp_path, capsys):
    common = ("run.steps=6", "run.telemetry_every=2", "run.eval_every=3", "run.log_every=1")
    assert main(["train", "--preset", "tiny", *args(*common, name="keel")]) == 0
    assert main(["train", "--preset", "tiny", *args(*common, "scheme=pre_ln", name="pre")]) == 0
    out = capsys.readouterr().out
    assert "final_val_loss" in out and "{" not in out  # an aligned summary, not raw JSON
    runs = tmp_path / "runs"
    assert (runs / "keel" / "curves.png").stat().st_size > 0  # drawn at the end of training
    telemetry = RunDir(runs / "keel").telemetry()
    assert [t["step"] for t in telemetry] == [2, 4, 6]
    assert all(len(t["grad_norm"]) == 4 and len(t["update_ratio"]) == 4 for t in telemetry)
    assert all(math.isfinite(v) and v > 0 for t in telemetry for v in t["grad_norm"])

    assert main(["runs", str(runs)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["run", "scheme", "sub-layers"]
    assert any(line.split()[:2] == ["keel", "keel"] and "6/6" in line and "finished" in line for line in table)
    assert any(line.split()[:2] == ["pre", "pre_ln"] for line in table)
    assert main(["runs", str(runs), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["run"]: r["status"] for r in rows} == {"keel": "finished", "pre": "finished"}

    assert main(["plot", str(runs / "keel"), str(runs / "pre")]) == 0
    assert (runs / "compare-keel-pre.png").stat().st_size > 0


def test_run_status_running_then_new(args):
    from keel.train.trainer import Trainer

    trainer = Trainer(load_config(args("run.steps=2", name="busy"), preset="tiny"))
    assert RunDir(trainer.run_dir.path).status() == "running"  # another handle sees the lock
    trainer.run_dir.unlock()
    assert RunDir(trainer.run_dir.path).status() == "new"


@pytest.mark.slow
def test_print_config_round_trips_and_resume_latest(args, tmp_path, capsys):
    assert main(["train", "--preset", "tiny", "--print-config", *args("run.steps=3", name="a")]) == 0
    text = capsys.readouterr().out
    (tmp_path / "printed.yaml").write_text(text)
    assert load_config([], str(tmp_path / "printed.yaml")) == load_config(args("run.steps=3", name="a"), preset="tiny")
    assert not (tmp_path / "runs").exists()
    assert main(["train", "--preset", "tiny", *args("run.steps=3", "run.eval_every=0", name="a")]) == 0
    assert main(["train", "--preset", "tiny", *args("run.steps=3", "run.eval_every=0", name="b")]) == 0
    os.utime(tmp_path / "runs" / "a" / "metrics.jsonl")  # a is now the most recently active
    capsys.readouterr()
    assert main(["train", "resume=latest", f"run.out_dir={tmp_path / 'runs'}", "run.steps=5", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("\n{") + 1:out.index("\n}") + 2])["steps"] == 5
    assert RunDir(tmp_path / "runs" / "a").summary()["steps"] == 5


def test_tensorboard_gets_the_same_scalars(args, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main(["train", "--preset", "tiny", *args("run.steps=4", "run.eval_every=0", "run.log_to=[tensorboard]",
                                                    name="tb")]) == 0
    events = EventAccumulator(str(tmp_path / "runs" / "tb" / "tensorboard"))
    events.Reload()
    logged = [r for r in RunDir(tmp_path / "runs" / "tb").metrics() if "loss" in r]
    scalars = events.Scalars("loss")
    assert [s.step for s in scalars] == [r["step"] for r in logged]
    assert [s.value for s in scalars] == pytest.approx([r["loss"] for r in logged], rel=1e-6)


def test_a_tracker_that_is_not_installed_is_named_before_any_work(args, tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError("no wandb here")
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_wandb)
    assert main(["train", "--preset", "tiny", *args("run.log_to=[wandb]", name="w")]) == 2
    assert "run.log_to: wandb is not installed" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "w").exists()


def test_a_bpe_vocabulary_larger_than_the_model_is_refused_before_training_it(args, capsys, monkeypatch):
    import keel.data.tokenizer

    def no_training(*a, **k):
        raise AssertionError("the tokenizer was trained before the vocabulary was checked")
    monkeypatch.setattr(keel.data.tokenizer, "train_bpe", no_training)
    assert main(["train", "--preset", "tiny", *args("data.tokenizer=bpe:1024")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("keel: error: model.vocab_size: 256 is smaller than the 1024 tokens of data.tokenizer=bpe:1024; "
                   "set model.vocab_size=1024")


def test_eval_prints_a_table_or_json(tmp_path, capsys, make_run, corpus):
    make_run(tmp_path / "run")
    config = (tmp_path / "run" / "config.yaml").read_text()
    (tmp_path / "run" / "config.yaml").write_text(config.replace("source: stdlib", f"source: {corpus}"))
    from keel.runs import trust

    trust.sign(tmp_path / "run")  # edited by its own user: trusted again (keel.runs.trust)
    assert main(["eval", str(tmp_path / "run"), "--batches", "1"]) == 0
    text = capsys.readouterr().out
    assert "val_loss" in text and "{" not in text
    assert main(["eval", str(tmp_path / "run"), "--batches", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["val_tokens"] > 0


def test_export_model_card_states_effective_options_and_no_local_paths(tmp_path, make_run):
    pytest.importorskip("transformers")
    from keel.hf.export import export_run

    make_run(tmp_path / "run")  # keel with alpha and first_layer left to their defaults (None in the config)
    out = export_run(tmp_path / "run", tmp_path / "hf")
    card = (out / "README.md").read_text()
    # the same words as `keel summary` (ModelConfig.scheme_options_shown): 6 sub-layers, alpha = L = 6
    assert "| scheme options | alpha = L = 6 (default), first_layer = v2 (default) |" in card and "None" not in card
    assert str(tmp_path) not in card
    assert oct((out / "model.safetensors").stat().st_mode & 0o777) == oct(0o644)


@pytest.mark.slow
def test_a_quick_experiment_does_not_write_into_results(tmp_path, monkeypatch, corpus):
    monkeypatch.chdir(tmp_path)
    assert main(["experiment", "redundancy", "--quick", f"data.source={corpus}",
                 f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    assert (tmp_path / "runs" / "quick" / "redundancy" / "results.json").is_file()
    assert not (tmp_path / "results").exists()


def test_telemetry_reads_the_stream_through_a_fused_junction():
    """With the fused junction a Residual passes (stream, next branch input) on; telemetry measures the stream."""
    from keel.train import telemetry

    y = torch.full((2, 3), 2.0)
    assert telemetry._rms((y, torch.zeros(2, 3))) == telemetry._rms(y) == 2.0
