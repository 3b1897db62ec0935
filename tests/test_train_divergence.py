"""`keel train` when the loss goes bad: a non-finite loss or a blow-up stops the run with a diagnostic and its own exit
code; rollback reloads the last good checkpoint, skips the batch, cuts the LR, and gives up after max_rollbacks."""

import json
import math

import pytest
import torch

from keel.cli import main
from keel.cli.support import DIVERGED_EXIT
from keel.runs import checkpoint
from keel.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("no_curves")  # none of these checks curves.png: each run skips its plot


def nan_at(step_to_break, times=1):
    state = {"left": times}

    def inject(trainer, step):
        if step == step_to_break and state["left"] > 0:
            state["left"] -= 1
            with torch.no_grad():
                trainer.model.lm_head.weight[0, 0] = float("nan")
    return inject


@pytest.mark.slow  # over a second in tests/durations.json
def test_injected_nan_stops_the_run_with_a_diagnostic(trainer_for):
    trainer = trainer_for("run.ckpt_every=5", callbacks=[nan_at(8)])
    summary = trainer.run()
    assert summary["diverged"] and "non-finite loss" in summary["divergence_reason"]
    assert summary["steps"] == 8  # the bad step was not taken
    diagnostic = json.loads((trainer.run_dir / "diverged.json").read_text())
    assert diagnostic["step"] == 9 and diagnostic["last_good_checkpoint"].endswith("step_00000005")
    assert checkpoint.verify(checkpoint.latest_valid(trainer.run_dir)) is None
    assert json.loads((trainer.run_dir / "summary.json").read_text())["diverged"] is True


@pytest.mark.slow  # over a second in tests/durations.json
def test_diverged_run_exits_with_its_own_code(args, monkeypatch, capsys):
    original = Trainer.__init__

    def with_nan(self, config, run_dir=None, callbacks=()):
        original(self, config, run_dir, [nan_at(3)])
    monkeypatch.setattr(Trainer, "__init__", with_nan)
    assert main(["train", "--preset", "tiny", *args()]) == DIVERGED_EXIT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "diverged at step 4: non-finite loss" in err[0]


@pytest.mark.slow  # over a second in tests/durations.json
def test_rollback_reloads_the_last_good_checkpoint_and_skips_the_batch(trainer_for):
    trainer = trainer_for("guard.policy=rollback", "guard.rollback_lr_factor=0.5", "run.ckpt_every=5",
                          callbacks=[nan_at(8)])
    summary = trainer.run()
    assert not summary["diverged"] and summary["steps"] == 20 and summary["rollbacks"] == 1
    events = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    rollback = next(e for e in events if e.get("event") == "rollback")
    assert rollback["to_step"] == 5 and rollback["skipped_draws"] == [8] and rollback["lr_scale"] == 0.5
    assert math.isfinite(summary["final_train_loss"])


@pytest.mark.slow  # over a second in tests/durations.json
def test_a_rollback_trains_on_at_the_cut_lr_past_the_bad_batch(trainer_for):
    """Against an undisturbed run of the same config: after the rollback to step 5 every step's LR is the schedule's
    times rollback_lr_factor, and the batches are the straight run's from draw 5 on, draw 8 (the NaN step's) left
    out."""
    def watched(trainer):
        batches, draw = [], trainer.next_batch

        def next_batch():
            batch = draw()
            batches.append(batch[0].flatten().tolist())
            return batch
        trainer.next_batch = next_batch
        return batches

    straight = trainer_for("run.log_every=1", name="straight")
    plain = watched(straight)
    straight.run()
    trainer = trainer_for("run.log_every=1", "guard.policy=rollback", "guard.rollback_lr_factor=0.5",
                          "run.ckpt_every=5", callbacks=[nan_at(8)])
    seen = watched(trainer)
    assert trainer.run()["rollbacks"] == 1
    # steps 1-8, the NaN step's batch (draw 8), then steps 6-20 from the checkpoint: draws 5, 6, 7, 9, 10, ...
    assert len(seen) == 8 + 1 + 15 and seen[:9] == plain[:9]
    assert seen[9:12] == plain[5:8] and seen[12:23] == plain[9:20] and plain[8] not in seen[9:]
    lrs = {}
    for name, t in (("straight", straight), ("rolled", trainer)):
        records = [json.loads(line) for line in (t.run_dir / "metrics.jsonl").read_text().splitlines()]
        lrs[name] = {r["step"]: r["lr"] for r in records if "lr" in r and "event" not in r}
    assert [lrs["rolled"][k] for k in range(1, 6)] == [lrs["straight"][k] for k in range(1, 6)]
    assert [lrs["rolled"][k] for k in range(6, 21)] == pytest.approx([0.5 * lrs["straight"][k] for k in range(6, 21)])


@pytest.mark.slow  # over a second in tests/durations.json
def test_rollback_gives_up_after_max_rollbacks(trainer_for):
    trainer = trainer_for("guard.policy=rollback", "guard.max_rollbacks=2", "run.ckpt_every=5",
                          callbacks=[nan_at(8, times=99)])
    summary = trainer.run()
    assert summary["diverged"] and summary["rollbacks"] == 2
    assert "(after 2 rollbacks)" in summary["divergence_reason"]


@pytest.mark.slow
def test_a_run_that_blows_up_in_its_first_steps_is_stopped(args, capsys):
    """optim.lr=10 took the loss from 5.5 to 51 at step 2 and 4869 at step 11, and used to exit 0."""
    code = main(["train", "--preset", "tiny", *args("run.steps=30", "optim.lr=10", "optim.warmup_steps=0")])
    err = capsys.readouterr().err
    assert code == DIVERGED_EXIT and "loss blow-up" in err


@pytest.mark.slow  # over a second in tests/durations.json
def test_rollback_does_not_repeat_steps_in_the_log(trainer_for):
    trainer = trainer_for("guard.policy=rollback", "run.ckpt_every=5", callbacks=[nan_at(8)])
    trainer.run()
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r and "event" not in r]
    assert steps == sorted(set(steps)) == list(range(1, 21))
    assert all(r["tokens_per_s"] > 0 for r in records if "tokens_per_s" in r)
