"""A run directory from someone else (issues 24 and 25): planted symlinks, FIFOs, huge files, re-checksummed
checkpoints of the wrong content, and hostile command-line arguments. Every case is a real `keel` command that
must end in one line and exit 2 (never a traceback or a hang), and must leave a file outside the run untouched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from damage import rechecksum, refused, victim
from keel.cli import main


@pytest.fixture(scope="module")
def trained(tiny_two_step_run) -> Path:
    """A tiny run trained for 2 steps (config, run.json, tokenizer/, metrics, one checkpoint with state)."""
    return tiny_two_step_run  # made once for the session (tests/conftest.py)


@pytest.fixture
def run(trained, tmp_path) -> Path:
    return victim(trained, tmp_path)


@pytest.fixture
def outside(tmp_path) -> Path:
    """A canary outside the run directory: its bytes and mtime must never change."""
    path = tmp_path / "outside" / "canary.txt"
    path.parent.mkdir()
    path.write_bytes(b"precious\n")
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    return path


def untouched(path: Path) -> bool:
    return path.read_bytes() == b"precious\n" and path.stat().st_mtime_ns == 1_000_000_000


def keel(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def plant(run: Path, name: str, target: Path) -> None:
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(target)


# ---- writes never follow a planted symlink --------------------------------------------------------------
@pytest.mark.slow  # over a second in tests/durations.json
def test_a_symlinked_lock_is_refused_on_resume(run, outside, capsys):
    plant(run, ".lock", outside)
    refused(capsys, ".lock", "train", f"resume={run}", "run.steps=3", "run.progress=false")
    assert untouched(outside)


def test_a_lock_that_is_a_directory_is_one_line(run, capsys):
    (run / ".lock").mkdir()
    refused(capsys, ".lock", "train", f"resume={run}", "run.steps=3", "run.progress=false")


def test_a_symlinked_eval_result_is_not_written_through(run, outside, capsys):
    step = max((run / "checkpoints").iterdir()).name
    plant(run, f"eval-{step}-val.json", outside)
    refused(capsys, f"eval-{step}-val.json", "eval", run, "--batches", "1", "--device", "cpu")
    assert untouched(outside)


def test_a_symlinked_curves_png_is_not_written_through(run, outside, capsys):
    plant(run, "curves.png", outside)
    refused(capsys, "curves.png", "plot", run)
    assert untouched(outside)


def test_a_symlinked_checkpoints_dir_neither_writes_nor_prunes_outside(run, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    shutil.move(run / "checkpoints", elsewhere)
    (elsewhere / "step_00000000").mkdir()  # an outside step_* that pruning would delete
    (elsewhere / "step_00000000" / "keep.txt").write_text("mine")
    before = sorted(p.name for p in elsewhere.iterdir())
    (run / "checkpoints").symlink_to(elsewhere)
    refused(capsys, "checkpoints", "train", f"resume={run}", "run.steps=4", "run.ckpt_every=1",
            "run.keep_checkpoints=1", "run.progress=false")
    assert sorted(p.name for p in elsewhere.iterdir()) == before
    assert (elsewhere / "step_00000000" / "keep.txt").read_text() == "mine"


# ---- reads: links refused, FIFOs never waited on, sizes capped -------------------------------------------
@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl", "summary.json"])
def test_a_symlinked_run_file_is_not_read(run, tmp_path, name, capsys):
    target = tmp_path / f"secret-{name}"
    shutil.copy(run / name, target) if (run / name).exists() else target.write_text("{}")
    plant(run, name, target)
    code, err = keel(capsys, "runs", run.parent, "--json")
    assert code in (0, 2) and name in err and "symbolic link" in err


@pytest.mark.parametrize("damage", ["binary", "link", "fifo", "directory"])
def test_keel_runs_lists_a_run_with_an_unreadable_config_as_damaged(run, trained, tmp_path, damage, capsys):
    """One such run among others made `keel runs` fail for all of them (exit 2, no table)."""
    shutil.copytree(trained, run.parent / "good", symlinks=True)
    config = run / "config.yaml"
    config.unlink()
    if damage == "binary":
        config.write_bytes(b"\x00\xff model: [")
    elif damage == "link":
        config.symlink_to(run.parent / "good" / "config.yaml")
    elif damage == "fifo":
        os.mkfifo(config)
    else:
        config.mkdir()
    code = main(["runs", str(run.parent), "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, err
    rows = {row["run"]: row for row in json.loads(out)}
    assert rows["victim"]["status"] == "damaged" and rows["good"]["status"] == "finished"
    notes = [line for line in err.splitlines() if "config.yaml" in line]
    assert len(notes) == 1 and notes[0].startswith("keel: ") and notes[0].endswith("listed as damaged"), err


def test_a_symlinked_tokenizer_dir_is_refused(run, tmp_path, capsys):
    shutil.move(run / "tokenizer", tmp_path / "tok")
    (run / "tokenizer").symlink_to(tmp_path / "tok")
    refused(capsys, "tokenizer", "generate", run, "--max-new-tokens", "1")


def test_a_huge_tokenizer_json_is_refused_before_reading(run, capsys):
    tok = run / "tokenizer" / "tokenizer.json"
    for p in (run / "tokenizer").iterdir():
        p.unlink()
    with open(tok, "wb") as f:
        f.truncate(65 << 20)  # sparse: no disk, but larger than the cap
    refused(capsys, "64 MiB", "generate", run, "--max-new-tokens", "1")


def test_a_fifo_metrics_log_does_not_hang_keel_runs(run):
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    out = subprocess.run([sys.executable, "-m", "keel.cli", "runs", str(run.parent)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode in (0, 2) and "Traceback" not in out.stderr
    assert "metrics.jsonl" in out.stderr


# ---- checkpoints that pass their checksums but hold wrong content ---------------------------------------
def newest(run: Path) -> Path:
    return max((run / "checkpoints").iterdir())


def test_meta_with_a_string_draws_is_refused_at_load(run, capsys):
    ckpt = newest(run)
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "draws": "many"}))
    rechecksum(ckpt)
    refused(capsys, "draws", "train", f"resume={run}", "run.steps=3", "run.progress=false")


@pytest.mark.parametrize("damage, name", [("sampler", "sampler"), ("optimizer", "optimizer"), ("betas", "betas"),
                                          ("string step", "not a floating-point tensor"),
                                          ("no exp_avg", "has no exp_avg"), ("amsgrad", "amsgrad"),
                                          ("no lr_scale", "lr_scale"), ("negative step", "no intact checkpoint")])
def test_training_state_of_the_wrong_shape_is_refused_at_load(run, damage, name, capsys):
    """Each was a traceback at restore or at the first step (KeyError, TypeError in AdamW), or a run from a
    negative step."""
    ckpt = newest(run)
    state = torch.load(ckpt / "state.pt", weights_only=True)
    meta = json.loads((ckpt / "meta.json").read_text())
    entry = next(iter(state["optimizer"]["state"].values()))
    if damage == "sampler":
        del state["sampler"]["generator"]
    elif damage == "optimizer":
        entry["exp_avg"] = torch.zeros(3, 5)
    elif damage == "betas":
        state["optimizer"]["param_groups"][0]["betas"] = ["0.9", 0.95]
    elif damage == "string step":
        entry["step"] = "many"
    elif damage == "no exp_avg":
        del entry["exp_avg"]
    elif damage == "amsgrad":  # AdamW would look for max_exp_avg_sq, which keel never writes
        state["optimizer"]["param_groups"][0]["amsgrad"] = True
    elif damage == "no lr_scale":
        del meta["lr_scale"]
    else:
        meta["step"] = -5
    torch.save(state, ckpt / "state.pt")
    (ckpt / "meta.json").write_text(json.dumps(meta))
    rechecksum(ckpt)
    refused(capsys, name, "train", f"resume={run}", "run.steps=3", "run.progress=false")


def test_nan_weights_are_refused_by_generate(run, capsys):
    from safetensors.torch import load_file, save_file

    ckpt = newest(run)
    weights = load_file(ckpt / "model.safetensors")
    name = next(iter(weights))
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, ckpt / "model.safetensors")
    rechecksum(ckpt)
    line = refused(capsys, "NaN", "generate", run, "--max-new-tokens", "2")
    assert ckpt.name in line


# ---- command-line arguments ----------------------------------------------------------------------------
def test_plot_out_with_an_unknown_format_or_missing_directory(run, tmp_path, capsys):
    refused(capsys, "--out", "plot", run, "--out", tmp_path / "x.xyz")
    refused(capsys, "--out", "plot", run, "--out", tmp_path / "no" / "such" / "x.png")


def test_tokenizer_out_is_checked_before_training(run, tmp_path, capsys):
    config = (run / "config.yaml").read_bytes()
    refused(capsys, "--out", "tokenizer", "--out", tmp_path)  # an existing directory
    refused(capsys, "--out", "tokenizer", "--out", run / "config.yaml")
    refused(capsys, "--out", "tokenizer", "--out", run / "tokenizer.json")
    assert (run / "config.yaml").read_bytes() == config


def test_out_of_range_integers_are_refused(run, capsys):
    refused(capsys, "--seed", "generate", run, "--seed", str(2**80))
    refused(capsys, "run.steps", "train", "--preset", "tiny", f"run.steps={10**23}", "--dry-run")


@pytest.mark.parametrize("argv, name", [(["train", "--preset", "nope"], "nope"), (["experiment", "nope"], "nope"),
                                        ([], "command")])
def test_usage_errors_are_one_line(argv, name, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.strip().splitlines()) == 1 and name in err


def test_config_files_that_are_not_regular_or_have_duplicate_keys(tmp_path, capsys):
    refused(capsys, "not a regular file", "train", "--config", "/dev/zero", "--dry-run")
    dup = tmp_path / "dup.yaml"
    dup.write_text("run:\n  steps: 5\n  steps: 6\n")
    refused(capsys, "duplicate key 'steps'", "train", "--config", dup, "--dry-run")


def test_a_symlinked_tensorboard_dir_is_refused(tmp_path):
    """TensorBoard's event files would land wherever a planted `tensorboard` link points."""
    from keel.config import TrainConfig
    from keel.errors import DataError
    from keel.reporting.tracking import Trackers

    pytest.importorskip("torch.utils.tensorboard")
    outside = tmp_path / "outside"
    outside.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").symlink_to(outside, target_is_directory=True)
    with pytest.raises(DataError, match="symbolic link"):
        Trackers(["tensorboard"], run, TrainConfig())
    assert list(outside.iterdir()) == []
