"""`keel train` end to end on tiny models: pulse, resume, checkpoints, divergence, bad input."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from keel import TransformerLM
from keel.cli import main
from keel.config import load_config
from keel.runs import checkpoint
from keel.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("no_curves")  # none of these checks curves.png: each run skips its plot


def losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r and "event" not in r]


class Killed(Exception):
    """Stands for the process dying: nothing is saved on the way out."""


def straight_and_killed(trainer_for, *extra: str) -> Trainer:
    """Train the run `straight` to its end, and the same run `killed`, which dies after step 13; the latter is
    returned unresumed."""
    trainer_for(*extra, name="straight").run()

    def kill(trainer, step):
        if step == 13:
            raise Killed

    killed = trainer_for(*extra, name="killed", callbacks=[kill])
    with pytest.raises(Killed):
        killed.run()
    return killed


@pytest.mark.slow
def test_pulse_the_real_entry_point_trains_and_the_loss_falls(args, tmp_path):
    keel = shutil.which("keel", path=os.path.dirname(sys.executable)) or shutil.which("keel")
    cmd = [keel] if keel else [sys.executable, "-m", "keel.cli"]
    train = [*cmd, "train", "--preset", "tiny", *args("run.steps=60", "optim.lr=1e-2", "run.curves=false")]
    out = subprocess.run(train, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / "runs" / "run"
    curve = [loss for _, loss in losses(run_dir)]
    assert len(curve) == 60
    assert sum(curve[-10:]) / 10 < sum(curve[:10]) / 10 - 0.5, curve
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("steps", "tokens", "final_train_loss", "final_val_loss", "tokens_per_second", "n_params",
                "n_sublayers", "diverged", "divergence_reason", "wall_seconds"):
        assert key in summary
    assert summary["steps"] == 60 and summary["tokens"] == 60 * 4 * 32 and summary["diverged"] is False
    assert summary["n_sublayers"] == 4 and summary["final_val_loss"] < math.log(256)
    run = json.loads((run_dir / "run.json").read_text())
    assert run["seed"] == 0 and run["keel_version"] and run["data"]["fingerprint"]
    assert "model:" in (run_dir / "config.yaml").read_text()
    assert f"run: {run_dir}" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("dropout", ["0.0", "0.2"])  # with dropout, the torch RNG the checkpoint restores draws masks
def test_resume_after_a_kill_reproduces_the_uninterrupted_losses(dropout, trainer_for):
    killed = straight_and_killed(trainer_for, "run.ckpt_every=5", f"model.dropout={dropout}")
    assert [p.name for p in checkpoint.list_checkpoints(killed.run_dir)][-1] == "step_00000010"
    assert main(["train", f"resume={killed.run_dir}", "run.progress=false"]) == 0
    straight = losses(killed.run_dir.parent / "straight")
    assert [s for s, _ in straight] == list(range(1, 21))
    assert losses(killed.run_dir) == straight  # every logged loss, bit for bit


TORCHAO_OPTIONS = {"8bit": ("optim.state=8bit",),
                   "bf16-weights": ("run.weights=bfloat16", "run.dtype=bfloat16"),
                   "bf16-weights-8bit": ("run.weights=bfloat16", "run.dtype=bfloat16", "optim.state=8bit")}


@pytest.mark.slow
@pytest.mark.parametrize("option", list(TORCHAO_OPTIONS))
def test_a_run_with_torchaos_adamw_resumes_after_a_kill_to_the_uninterrupted_losses(option, trainer_for):
    """optim.state=8bit and run.weights=bfloat16 (torchao): the quantised moments go through keel's checkpoint
    (checked, loaded weights-only) and come back exactly; stochastic rounding draws from the generator the
    checkpoint restores, so a resumed bf16-weight run rounds as the uninterrupted one did."""
    pytest.importorskip("torchao")
    extra = ("run.ckpt_every=5", *TORCHAO_OPTIONS[option])
    killed = straight_and_killed(trainer_for, *extra)
    assert main(["train", f"resume={killed.run_dir}", "run.progress=false"]) == 0
    assert losses(killed.run_dir) == losses(killed.run_dir.parent / "straight")  # bit for bit
    weights = load_file(checkpoint.list_checkpoints(killed.run_dir)[-1] / "model.safetensors")
    assert {v.dtype for v in weights.values()} == {torch.bfloat16 if "run.weights=bfloat16" in extra
                                                  else torch.float32}


@pytest.mark.slow
def test_interrupt_saves_a_checkpoint_on_the_step_boundary(trainer_for):
    uninterrupted = trainer_for(name="straight").run()

    def interrupt(trainer, step):
        if step == 7:
            raise KeyboardInterrupt

    first = trainer_for(name="interrupted", callbacks=[interrupt]).run()
    assert first["interrupted"] and first["steps"] == 7
    run_dir = Path(first["run_dir"])
    assert checkpoint.latest_valid(run_dir).name == "step_00000007"
    assert main(["train", f"resume={run_dir}"]) == 0
    assert losses(run_dir) == losses(run_dir.parent / "straight")
    assert json.loads((run_dir / "summary.json").read_text())["final_train_loss"] == uninterrupted["final_train_loss"]


@pytest.mark.slow
def test_damaged_checkpoint_is_rejected_and_the_previous_good_one_used(tmp_path, capsys, trainer_for):
    trainer_for("run.ckpt_every=5", "run.keep_checkpoints=3").run()
    run_dir = tmp_path / "runs" / "run"
    ckpts = checkpoint.list_checkpoints(run_dir)
    assert [p.name for p in ckpts] == ["step_00000010", "step_00000015", "step_00000020"]
    newest = ckpts[-1] / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    newest.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="checksum"):
        checkpoint.load(ckpts[-1], torch.nn.Linear(1, 1))
    (ckpts[-2] / "state.pt").write_bytes((ckpts[-2] / "state.pt").read_bytes()[:100])  # truncated
    assert main(["train", f"resume={run_dir}", "run.steps=25"]) == 0
    err = capsys.readouterr().err
    assert "step_00000020 is damaged" in err and "step_00000015 is damaged" in err
    assert losses(run_dir)[10][0] == 11  # resumed from step 10: the log kept steps 1..10 and went on
    assert checkpoint.latest_valid(run_dir).name == "step_00000025"


@pytest.mark.slow
def test_eval_and_generate_work_on_the_run_directory(args, tmp_path, capsys):
    assert main(["train", "--preset", "tiny", *args()]) == 0
    run_dir = tmp_path / "runs" / "run"
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["val_bits_per_byte"] == pytest.approx(result["val_loss"] / math.log(2))  # bytes: 1 token = 1 byte
    assert result["val_ppl"] == pytest.approx(math.exp(result["val_loss"]))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert result["val_loss"] == pytest.approx(summary["final_val_loss"], rel=1e-5)
    assert main(["generate", str(run_dir), "--prompt", "def parse", "--max-new-tokens", "20"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def parse") and len(text.rstrip("\n")) >= len("def parse") + 5


BAD_INPUT = [
    (lambda tmp: [f"data.source={tmp / 'missing.txt'}"], "missing.txt"),
    (lambda tmp: [f"data.source={_write(tmp / 'empty.txt', b'')}"], "empty.txt"),
    (lambda tmp: [f"data.source={_write(tmp / 'blob.bin', bytes(range(256)) * 50)}"], "blob.bin"),
    (lambda tmp: ["model.n_blocks=0"], "n_blocks"),
    (lambda tmp: ["model.alpha=-1"], "alpha"),
    (lambda tmp: ["run.steps=0"], "run.steps"),
    (lambda tmp: ["optim.schedule=linear"], "optim.schedule"),
    (lambda tmp: ["model.n_layers=4"], "n_layers"),
    (lambda tmp: ["run.seq_len=4096"], "run.seq_len"),
    (lambda tmp: [f"run.out_dir={_write(tmp / 'afile', b'x')}"], "afile"),
]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("make,needle", BAD_INPUT, ids=[b[1] for b in BAD_INPUT])
def test_bad_input_is_one_clear_line_and_nonzero(make, needle, args, tmp_path, capsys):
    code = main(["train", "--preset", "tiny", *args(), *make(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err


def test_tokenizer_larger_than_the_model_is_named(args, capsys):
    code = main(["train", "--preset", "tiny", *args(), "data.tokenizer=bpe:300"])
    err = capsys.readouterr().err
    assert code == 2 and "model.vocab_size" in err


@pytest.mark.slow
def test_resume_refuses_a_changed_model_and_an_existing_run_is_not_overwritten(args, tmp_path, capsys):
    assert main(["train", "--preset", "tiny", *args()]) == 0
    run_dir = tmp_path / "runs" / "run"
    before = {p: p.stat().st_mtime_ns for p in checkpoint.list_checkpoints(run_dir)}
    capsys.readouterr()
    assert main(["train", f"resume={run_dir}", "model.n_blocks=3"]) == 2
    assert "model.n_blocks" in capsys.readouterr().err
    assert main(["train", "--preset", "tiny", *args()]) == 2
    assert "already exists" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in checkpoint.list_checkpoints(run_dir)} == before


@pytest.mark.slow
def test_full_disk_while_checkpointing_leaves_earlier_checkpoints_intact(monkeypatch, capsys, trainer_for):
    trainer = trainer_for("run.ckpt_every=5")
    real_save = torch.save

    def failing_save(obj, f, *a, **k):
        if trainer.step >= 10:
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(checkpoint.CheckpointError, match="step_00000010.*No space left"):
        trainer.run()
    assert [p.name for p in checkpoint.list_checkpoints(trainer.run_dir)] == ["step_00000005"]
    assert checkpoint.verify(checkpoint.list_checkpoints(trainer.run_dir)[0]) is None
    assert not list((trainer.run_dir / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow
def test_interrupt_during_validation_still_resumes_exactly(monkeypatch, trainer_for):
    trainer_for(name="straight").run()
    real_evaluate, state = Trainer.evaluate, {"left": 1}

    def interrupted_once(self):
        if self.step == 10 and state["left"]:
            state["left"] -= 1
            raise KeyboardInterrupt
        return real_evaluate(self)
    monkeypatch.setattr(Trainer, "evaluate", interrupted_once)
    first = trainer_for(name="during-eval").run()
    assert first["interrupted"] and first["steps"] == 10  # step 10 was finished when validation began
    run_dir = Path(first["run_dir"])
    assert main(["train", f"resume={run_dir}"]) == 0
    assert losses(run_dir) == losses(run_dir.parent / "straight")


@pytest.mark.slow
def test_resume_keeps_extended_steps_and_leaves_a_finished_run_alone(args, tmp_path, capsys):
    assert main(["train", "--preset", "tiny", *args()]) == 0
    run_dir = tmp_path / "runs" / "run"
    finished = (run_dir / "summary.json").read_text()
    assert main(["train", f"resume={run_dir}"]) == 0
    assert "already finished 20 steps" in capsys.readouterr().out
    assert (run_dir / "summary.json").read_text() == finished  # not overwritten by an empty run
    assert main(["train", f"resume={run_dir}", "run.steps=24"]) == 0
    assert "steps: 24" in (run_dir / "config.yaml").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 24


def test_validation_split_too_short_is_named_before_training(args, capsys):
    assert main(["train", "--preset", "tiny", *args(), "data.val_fraction=0"]) == 2
    assert "run.eval_every" in capsys.readouterr().err


@pytest.mark.slow
def test_weights_only_checkpoint_cannot_be_resumed(args, tmp_path, capsys):
    assert main(["train", "--preset", "tiny", *args()]) == 0
    run_dir = tmp_path / "runs" / "run"
    for old in checkpoint.list_checkpoints(run_dir):
        shutil.rmtree(old)
    model = TransformerLM(load_config(args(), preset="tiny").model)
    checkpoint.save(run_dir, 3, model, {}, {}, keep=1)  # as keel import-hf writes one: weights only
    assert main(["train", f"resume={run_dir}"]) == 2
    assert "holds weights only" in capsys.readouterr().err


def test_tokenizer_command_names_an_unknown_field(capsys):
    assert main(["tokenizer", "bogus=1"]) == 2
    assert "bogus: TrainConfig has no field 'bogus'" in capsys.readouterr().err  # keel train's spelling: data.*
    assert main(["tokenizer", "data.bogus=1"]) == 2
    assert "data.bogus: DataConfig has no field 'bogus'" in capsys.readouterr().err


@pytest.mark.slow
def test_a_signal_inside_the_optimizer_step_waits_for_the_step_boundary(trainer_for):
    """SIGTERM used to land inside optimizer.step(): updated weights were saved with the old step counter."""
    import signal

    trainer_for(name="straight").run()
    trainer = trainer_for("run.ckpt_every=100", name="signalled")
    real_step = trainer.optimizer.step

    def step_then_signal(*a, **k):
        if trainer.step == 6:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered while the update is being applied
        return real_step(*a, **k)
    trainer.optimizer.step = step_then_signal
    summary = trainer.run()
    assert summary["interrupted"] and summary["steps"] == 7  # the signalled step was finished, then saved
    assert [p.name for p in checkpoint.list_checkpoints(trainer.run_dir)] == ["step_00000007"]
    assert main(["train", f"resume={trainer.run_dir}", "run.progress=false"]) == 0
    assert losses(trainer.run_dir) == losses(trainer.run_dir.parent / "straight")


@pytest.mark.slow  # over a second in tests/durations.json
def test_one_trainer_per_run_directory(args, capsys, trainer_for):
    first = trainer_for(name="busy")  # holds the run's lock from construction to the end of run()
    assert main(["train", "--preset", "tiny", *args(name="busy")]) == 2
    assert "is in use by keel process" in capsys.readouterr().err
    first.run()
    assert (first.run_dir / "summary.json").exists()


def test_a_failed_start_leaves_no_run_directory(args, tmp_path, capsys):
    assert main(["train", "--preset", "tiny", *args("data.source=/no/such/file.txt", name="failed")]) == 2
    assert "/no/such/file.txt" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "failed").exists()  # so the same command can simply be retried


@pytest.mark.slow
def test_a_torn_last_metrics_line_does_not_block_resume(capsys, trainer_for):
    trainer = trainer_for("run.steps=10", name="torn")
    trainer.run()
    with open(trainer.run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "lo')  # the process died mid-write
    assert main(["train", f"resume={trainer.run_dir}", "run.steps=14", "run.progress=false"]) == 0
    # the torn line is a damaged record like any other: skipped with one note naming the file and the line
    assert re.search(r"metrics\.jsonl: skipped 1 damaged record \(line \d+: not JSON", capsys.readouterr().err)
    steps = [s for s, _ in losses(trainer.run_dir)]
    assert steps == list(range(1, 15))


@pytest.mark.slow
def test_a_full_disk_at_start_leaves_nothing_that_blocks_a_retry(args, tmp_path, monkeypatch, capsys):
    """It used to leave an empty config.yaml that blocked both a new run of that name and resume=."""
    from keel.runs.run_dir import RunDir

    real_write = RunDir._write

    def full(self, name, text):
        if name == "run.json":  # config.yaml has been written by now
            raise OSError(28, "No space left on device")
        return real_write(self, name, text)
    monkeypatch.setattr(RunDir, "_write", full)
    assert main(["train", "--preset", "tiny", *args("run.steps=2", name="full")]) == 2
    assert "No space left" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "full").exists()
    monkeypatch.setattr(RunDir, "_write", real_write)
    assert main(["train", "--preset", "tiny", *args("run.steps=2", name="full")]) == 0


@pytest.mark.slow
def test_a_signal_during_the_last_step_says_the_run_is_complete(capsys, trainer_for):
    """SIGINT inside the last step (after the loop's last look at the flag) used to end the run with
    exit 0 and no line at all. Now the run, complete and saved, says so in one line on stderr."""
    import signal

    def signal_in_last_step(trainer, step):
        if step == 19:  # run.steps=20: the flag is set after the loop's last check, as the step starts
            os.kill(os.getpid(), signal.SIGINT)

    trainer = trainer_for(name="last", callbacks=[signal_in_last_step])
    summary = trainer.run()
    err = capsys.readouterr().err
    assert summary["interrupted"] is False and summary["steps"] == 20
    assert err.count("interrupted during the last step; the run completed its 20 steps and is saved") == 1, err
    assert checkpoint.list_checkpoints(trainer.run_dir)[-1].name == "step_00000020"


@pytest.mark.slow
def test_the_model_is_frozen_out_of_full_collections_while_the_run_trains_and_thawed_after(trainer_for):
    """gc.freeze after building: Python's collector no longer walks the model's objects between steps; the run
    thaws them when it ends, so a process that trains many runs (tests, sweeps) still collects their cycles."""
    import gc

    walked = []

    def look(trainer, step):  # what a full collection walks now: the collector's generations, not the frozen
        if step == 1:
            ids = {id(o) for o in gc.get_objects()}
            walked.extend(id(p) in ids for p in trainer.model.parameters())
    trainer = trainer_for("run.steps=3", name="frozen", callbacks=[look])
    session = gc.get_freeze_count()  # what tests/conftest.py froze after collection: thawed for this test
    gc.unfreeze()
    try:
        trainer.run()
        assert walked and not any(walked)  # no parameter of the model was walked while it trained
        assert gc.get_freeze_count() == 0
        assert any(id(p) in {id(o) for o in gc.get_objects()} for p in trainer.model.parameters())  # thawed
    finally:
        if session:
            gc.freeze()
