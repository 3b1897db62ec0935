"""Presets and summaries that must not mislead: the paper presets are the paper's recipe and say what a run of
them needs; a warm-up never left or a tokenizer far smaller than the vocabulary is warned about; the summary
prints the resolved alpha and first-layer rule; the cpu-demo preset is `keel.cpu_demo()`."""

import re

import pytest

import keel
from keel.bench.perf_model import calibrated, predict
from keel.cli import main
from keel.config import TrainConfig
from keel.config.presets import train_preset


def test_dry_run_warns_of_a_warmup_never_left_and_a_tokenizer_far_smaller_than_the_vocabulary(capsys):
    assert main(["train", "--preset", "paper-512", "--dry-run", "run.steps=1000", "data.tokenizer=bytes"]) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("keel: warning:")]
    assert len(warnings) == 2, out[-1500:]
    assert "optim.warmup_steps=2500 >= run.steps=1000" in warnings[0]
    assert "256 tokens" in warnings[1] and "model.vocab_size=32,000" in warnings[1]

    # a self-consistent recipe (the README's main job) is not warned about
    assert main(["train", "--dry-run"]) == 0
    assert "warning" not in capsys.readouterr().out


@pytest.mark.parametrize("name", ["paper-64", "paper-128", "paper-512", "paper-1024", "paper-2048"])
def test_a_paper_preset_is_the_papers_recipe_and_says_what_a_run_of_it_needs(name, capsys):
    """The paper's recipe (PAPER.md section 5): 2,500 warm-up steps that the run leaves, a global batch of 1024
    sequences of 4096, its peak rate for the depth, a tokenizer of the model's vocabulary; the dry run prints the
    tokens, the memory per GPU and the predicted hours on an H100, and names the paper's data."""
    c = train_preset(name)
    assert c.optim.warmup_steps == 2500 < c.run.steps and c.optim.min_lr == 1e-7 and c.optim.schedule == "cosine"
    assert (c.optim.beta1, c.optim.beta2, c.optim.weight_decay, c.optim.grad_clip) == (0.9, 0.95, 0.01, 1.0)
    assert c.run.seq_len == 4096 and c.run.batch_size * c.run.grad_accum == 1024
    assert c.optim.lr == {64: 9e-3, 128: 9e-3, 512: 6e-3, 1024: 4.5e-3, 2048: 4.5e-3}[c.model.n_sublayers]
    assert c.data.tokenizer == "bpe:32000" and c.model.vocab_size == 32000
    tokens = c.run.steps * 1024 * 4096
    assert 249e9 < tokens < 251e9  # the 250B tokens of the paper's depth-scaling runs
    assert main(["train", "--preset", name, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "warning" not in out, out[-1500:]
    assert f"= {tokens:,} tokens" in out and "memory per process" in out and "H100 80GB: fits" in out
    hours = re.search(r"time on one H100 \(PREDICTED by keel.bench.perf_model, calibrated on [^)]*\)\): ([\d,.]+) "
                      "hours", out)
    # 1024 micro-batches a step, each the forward and backward of one 4096-token sequence, the optimizer once
    micro = predict(c.model, 1, 4096, calibrated("H100"), "compiled", True, 1)
    optimizer = micro["groups"]["optimizer"]["time_s"]
    want = ((micro["step_time_s"] - optimizer) * 1024 + optimizer) * c.run.steps / 3600
    assert hours and float(hours[1].replace(",", "")) == pytest.approx(want, rel=1e-3), out[-800:]
    assert "keel data prepare --out DIR" in out and "data.hf_config=sample-10BT" in out and "docs/data.md" in out


def test_the_cpu_demo_preset_and_keel_cpu_demo_are_one_model():
    assert train_preset("cpu-demo").model == keel.cpu_demo() == TrainConfig().model
    assert train_preset("cpu-demo").run.seq_len <= keel.cpu_demo().max_seq_len


@pytest.mark.slow  # a training run, for one warning line
def test_training_start_warns_once_when_warmup_outlasts_the_run(tmp_path, capsys):
    assert main(["train", "--preset", "tiny", "run.steps=2", "optim.warmup_steps=5", "run.progress=false",
                 f"run.out_dir={tmp_path}", "run.eval_every=0"]) == 0
    err = capsys.readouterr().err
    assert err.count("optim.warmup_steps=5 >= run.steps=2") == 1, err


@pytest.mark.parametrize("command", [["summary"], ["train", "--dry-run"]])
def test_summary_prints_the_resolved_alpha_and_first_layer_rule(capsys, command):
    """cpu-demo is a Keel model with 32 sub-layers and the defaults alpha=L, first_layer=v2: the listing says
    so (not `None`), and leaves out the options of other schemes."""
    assert main(command) == 0
    out = capsys.readouterr().out
    assert "alpha = L = 32" in out and "first_layer = v2 (default)" in out, out[:1500]
    assert "= None" not in out.split("blocks:")[0].replace("loop_blocks = None", "")
    assert main([*command, "model.alpha=sqrtL", "model.first_layer=v1"]) == 0
    out = capsys.readouterr().out
    assert "alpha = sqrtL = 5.65685" in out and "first_layer = 'v1'" in out
