"""A person's day with Keel, attacked on purpose (issue 22): interrupts at any moment, damaged logs, presets
and summaries that must not mislead. Each test failed on 868f8d0."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keel.cli import main

KEEL = Path(sys.executable).parent / "keel"
ENV = os.environ | {"OMP_NUM_THREADS": "1"}


# ---- interrupts at any moment ---------------------------------------------------------------------------
@pytest.mark.slow  # eight subprocess runs, each waited on for up to 6 s (tests/test_first_hour_2.py has a fast one)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_at_any_moment_is_one_line_and_exit_130(tmp_path, signum):
    """Signalled during Python's imports of torch (the first seconds), while a run starts, and mid-training:
    exit 130 and at most a line or two on stderr, never a traceback. A delay that the process outlives
    unsignalled would prove nothing, so each run trains far longer than the test waits."""
    for delay in (0.3, 1.0, 2.5, 6.0):
        proc = subprocess.Popen([str(KEEL), "train", "--preset", "tiny", "run.steps=100000", "run.progress=false",
                                 f"run.out_dir={tmp_path / str(delay)}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        time.sleep(delay)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, (delay, proc.returncode, err[-2000:])
        assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, (delay, err[-2000:])


def _swallowed_signal(monkeypatch):
    """A SIGINT whose KeyboardInterrupt Python swallowed (raised inside a callback, e.g. importlib's module-lock
    callback during an import, it is only printed): keel.cli's handler has recorded it, and the command goes on."""
    from keel import runtime

    real = runtime.set_threads

    def set_threads(n):
        runtime.PENDING_SIGNALS.append(signal.SIGINT)
        return real(n)
    monkeypatch.setattr(runtime, "set_threads", set_threads)


def test_a_signal_inside_an_import_ends_the_process_there_with_one_line(tmp_path):
    """A signal that lands while a module is being imported stops the process at once, exit 130 and one line:
    raised as a KeyboardInterrupt there it can cross a native module's initialiser and abort the process (exit
    -6, seen once in CI while torch imported under load). The module here signals its own process mid-import and,
    as a native initialiser does when an exception crosses it, aborts if the interrupt reaches it."""
    (tmp_path / "slow_module.py").write_text("import os, signal, time\ntry:\n    os.kill(os.getpid(), signal.SIGINT)\n"
                                              "    time.sleep(5)\nexcept KeyboardInterrupt:\n    os.abort()\n")
    script = ("import sys; sys.path.insert(0, sys.argv[1])\n"
              "from keel.cli.support import run_interruptible\n"
              "def work():\n    import slow_module  # noqa\n    print('after the import')\n    return 0\n"
              "sys.exit(run_interruptible(work))\n")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60,
                         env=ENV)
    assert (run.returncode, run.stdout, run.stderr) == (130, "", "keel: interrupted\n")


def test_a_swallowed_signal_still_stops_a_run_at_its_first_step_with_a_checkpoint(tmp_path, monkeypatch, capsys):
    _swallowed_signal(monkeypatch)
    code = main(["train", "--preset", "tiny", "run.steps=50", "run.progress=false", f"run.out_dir={tmp_path}",
                 "run.name=r"])
    assert code == 130
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["interrupted"] and summary["steps"] < 50
    assert list((tmp_path / "r" / "checkpoints").glob("step_*"))


def test_a_swallowed_signal_makes_any_other_command_exit_130(tmp_path, monkeypatch, capsys):
    _swallowed_signal(monkeypatch)
    assert main(["runs", str(tmp_path)]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "keel: interrupted"


# ---- damaged logs -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 4-step tiny run with validation and telemetry, copied by each test before damaging it."""
    out = tmp_path_factory.mktemp("runs")
    assert main(["train", "--preset", "tiny", "run.steps=4", "run.eval_every=2", "run.telemetry_every=2",
                 "run.progress=false", f"run.out_dir={out}", "run.name=clean"]) == 0
    return out / "clean"


def _append(name, text):
    return lambda run: (run / name).open("a").write(text)


def _metrics_dir(run):
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()


DAMAGE = {
    "string loss": _append("metrics.jsonl", '{"step": 3, "loss": "nan-ish", "lr": 0.001}\n'),
    "string val_loss": _append("metrics.jsonl", '{"step": 4, "val_loss": "5.1"}\n'),
    "no step": _append("metrics.jsonl", '{"loss": 5.0, "lr": 0.001}\n'),
    "null step": _append("metrics.jsonl", '{"step": null, "loss": 5.0}\n'),
    "string step": _append("metrics.jsonl", '{"step": "3", "loss": 5.0}\n'),
    "list record, then a good one": _append("metrics.jsonl", '[1, 2]\n{"step": 4, "loss": 5.0}\n'),
    "binary line in the middle": _append("metrics.jsonl", '\x00\xff{{\n{"step": 4, "loss": 5.0}\n'),
    "metrics.jsonl is a directory": _metrics_dir,
    "torn summary": lambda run: (run / "summary.json").write_text('{"final_val_loss": 5.'),
    "binary summary": lambda run: (run / "summary.json").write_bytes(b"\x80\x00\xfe"),
    "list summary": lambda run: (run / "summary.json").write_text("[1, 2]"),
    "telemetry without step": _append("telemetry.jsonl", '{"grad_norm": [1.0, 2.0, 3.0, 4.0]}\n'),
    "telemetry scalar": _append("telemetry.jsonl", '{"step": 4, "grad_norm": 3.0}\n'),
    "telemetry string list": _append("telemetry.jsonl", '{"step": 4, "grad_norm": ["a", "b"]}\n'),
}


# one damage in the fast tier (each costs a plot and a resumed run: about 2 s); every damage in the slow one
FAST_DAMAGE = ("torn summary",)


@pytest.mark.parametrize("damage", [d if d in FAST_DAMAGE else pytest.param(d, marks=pytest.mark.slow)
                                    for d in DAMAGE])
def test_damaged_logs_are_skipped_with_one_note(trained, tmp_path, capsys, damage):
    """keel runs, keel plot and keel train resume= on a run whose logs were damaged: no traceback; a damaged
    record is skipped with one note naming the file, an unusable file is ignored (runs, plot) or refused in
    one line (resume cannot rewrite a directory)."""
    import shutil

    runs = tmp_path / "runs"
    run = runs / "clean"
    shutil.copytree(trained, run)
    DAMAGE[damage](run)
    capsys.readouterr()

    assert main(["runs", str(runs), "--json"]) == 0
    out, err = capsys.readouterr()
    row = json.loads(out)[0]
    assert row["run"] == "clean" and row["steps"] == "4/4"  # the summary's step when the metrics are unusable
    assert len(err.strip().splitlines()) <= 1 and "Traceback" not in err
    notes = err

    assert main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) <= 2 and "Traceback" not in err
    notes += err  # keel runs reads no telemetry; plot does (a note is printed once per process)
    damaged = next((name for name in ("summary.json", "telemetry.jsonl") if name.split(".")[0] in damage),
                   "metrics.jsonl")
    assert notes.count(damaged) == 1, notes

    code = main(["train", f"resume={run}", "run.steps=6", "run.progress=false"])
    err = capsys.readouterr().err
    assert code == (2 if damage == "metrics.jsonl is a directory" else 0), err
    assert len(err.strip().splitlines()) <= 2 and "Traceback" not in err


# ---- presets and summaries that must not mislead ----------------------------------------------------------
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
    from keel.config.presets import train_preset

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
    from keel.bench.perf_model import calibrated, predict

    micro = predict(c.model, 1, 4096, calibrated("H100"), "compiled", True, 1)
    optimizer = micro["groups"]["optimizer"]["time_s"]
    want = ((micro["step_time_s"] - optimizer) * 1024 + optimizer) * c.run.steps / 3600
    assert hours and float(hours[1].replace(",", "")) == pytest.approx(want, rel=1e-3), out[-800:]
    assert "keel data prepare --out DIR" in out and "data.hf_config=sample-10BT" in out and "docs/data.md" in out


def test_the_cpu_demo_preset_and_keel_cpu_demo_are_one_model():
    import keel
    from keel.config import TrainConfig
    from keel.config.presets import train_preset

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


def test_an_imported_run_is_listed_as_imported_and_never_resumed_as_latest(trained, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from keel.data.tokenizer import train_bpe

    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    train_bpe(["def f(x):\n    return x + 1\n" * 50], 300, tmp_path / "llama" / "tokenizer.json")
    runs = tmp_path / "runs"
    runs.mkdir()
    import shutil

    shutil.copytree(trained, runs / "trained")
    assert main(["import-hf", str(tmp_path / "llama"), str(runs / "imported")]) == 0
    capsys.readouterr()
    assert main(["runs", str(runs), "--json"]) == 0
    status = {row["run"]: row["status"] for row in json.loads(capsys.readouterr().out)}
    assert status == {"trained": "finished", "imported": "imported"}

    from keel.runs.run_dir import latest_run

    assert latest_run(runs).name == "trained"  # the imported run is the newest, yet not a run to continue


def test_eval_json_is_printed_by_rank_0_only(trained, capsys, monkeypatch):
    """Under torchrun every rank runs `keel eval`; only rank 0 prints (one JSON document in the output)."""
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        assert main(["eval", str(trained), "--json", "--batches", "1"]) == 0
        out = capsys.readouterr().out
        assert bool(out.strip()) == printed, (rank, out)
        if printed:
            assert json.loads(out)["val_loss"] > 0


# ---- the log readers under fuzzed input ------------------------------------------------------------------
_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                   max_size=3), max_leaves=6)
_keys = st.sampled_from(["step", "loss", "val_loss", "lr", "grad_norm", "tokens", "event", "reason", "stream_rms"])
_lines = st.lists(st.one_of(st.dictionaries(_keys, _values, max_size=5).map(json.dumps), _values.map(json.dumps),
                            st.text(max_size=12)), max_size=6)


@pytest.mark.slow  # 80 examples; the damaged-log tests above keep the readers in the fast tier
@settings(max_examples=80, deadline=None)
@given(metrics=_lines, telemetry=_lines, summary=st.one_of(_values.map(json.dumps), st.text(max_size=12)))
def test_log_readers_never_raise_on_any_lines(trained, metrics, telemetry, summary):
    """Whatever the lines of metrics.jsonl / telemetry.jsonl and summary.json hold (any JSON, huge integers,
    NaN, text), the readers return only well-typed records and `keel runs`' row and status never raise."""
    import contextlib
    import io
    import tempfile

    from keel.runs.run_dir import RunDir, latest_run

    with tempfile.TemporaryDirectory() as root, contextlib.redirect_stderr(io.StringIO()):
        run = Path(root) / "fuzzed"
        run.mkdir()
        (run / "config.yaml").write_text((trained / "config.yaml").read_text())
        (run / "metrics.jsonl").write_text("\n".join(metrics))
        (run / "telemetry.jsonl").write_text("\n".join(telemetry))
        (run / "summary.json").write_text(summary)
        r = RunDir.open(run)
        for record in r.metrics() + r.telemetry():
            assert isinstance(record["step"], int) and record["step"] >= 0
        for record in r.metrics():
            assert all(isinstance(v, (int, float, type(None))) or k in ("event", "reason") for k, v in record.items())
        assert r.summary() is None or isinstance(r.summary(), dict)
        row = r.describe()
        assert row["status"] in ("finished", "diverged", "interrupted")
        assert latest_run(root) == r
