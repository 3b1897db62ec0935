"""Tracking: TensorBoard gets the same scalars as metrics.jsonl; a tracker that is not installed is named before
any work."""

import pytest

from keel.cli import main
from keel.runs.run_dir import RunDir

pytestmark = pytest.mark.usefixtures("no_curves")  # none of these checks curves.png: each in-process run skips its plot


@pytest.mark.slow  # over a second in tests/durations.json
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


@pytest.mark.parametrize("tracker", ["wandb", "tensorboard"])
def test_a_tracker_that_is_not_installed_is_named_before_any_work(tracker, args, tmp_path, capsys, monkeypatch):
    import sys

    # as if never installed: an import of it fails (TensorBoard is reached through torch.utils.tensorboard, which
    # torch ships: the package named must be tensorboard, not torch)
    monkeypatch.setitem(sys.modules, tracker, None)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    assert main(["train", "--preset", "tiny", *args(f"run.log_to=[{tracker}]", name="w")]) == 2
    assert f"run.log_to: {tracker} needs the optional package '{tracker}'" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "w").exists()
