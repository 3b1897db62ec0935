"""A sweep's point killed mid-training continues from its last save: every number it writes is the uninterrupted
point's, bit for bit on a CPU; progress of another configuration or a damaged save is discarded with one line and
the point starts over; the progress goes once the point's file is written."""

import json

import pytest

from keel import runtime
from keel.experiments import partial as partial_module
from keel.experiments.budget import budget_point
from keel.experiments.cli import build
from keel.experiments.sweep import Sweep

STEPS = 12


class Killed(Exception):
    """Stands for the process dying: nothing runs on the way out but `finally` blocks."""


@pytest.fixture
def cfg(corpus, tmp_path):
    return build("depth", True, [f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
                                 f"run.steps={STEPS}", "curve_every=2", "curve_batches=1"])


def run_point(cfg, out, lr=3e-3, kill_after=None):
    """The point (keel, 4 sub-layers, `lr`, seed 0) through a Sweep in `out`; with `kill_after`, the process "dies"
    once it has trained that many steps (each saved as it finished), as the next one is about to start."""
    with pytest.MonkeyPatch.context() as patch:
        if kill_after is not None:
            calls = {"n": 0}

            def dies():  # called by the sweep before the point, then by training before each step
                calls["n"] += 1
                if calls["n"] == 1 + kill_after + 1:
                    raise Killed
            patch.setattr(runtime, "stop_if_signalled", dies)
        return Sweep(out, cfg).run({"p": lambda: budget_point(cfg, cfg.point_model("keel", 4), lr, 0)}, "t")["p"]


def numbers(point: dict) -> dict:
    """What the point measured: all but how long it took, how it ran, and where it was continued from."""
    return {k: v for k, v in point.items() if k not in ("seconds", "execution", "resumed_at")}


@pytest.fixture(autouse=True)
def save_every_step(monkeypatch):
    monkeypatch.setattr(partial_module, "EVERY_SECONDS", 0.0)


def partial_of(out):
    return out / "points" / "p.partial"


def test_a_killed_point_continues_to_the_uninterrupted_points_numbers(cfg, tmp_path, monkeypatch):
    whole = run_point(cfg, tmp_path / "whole")
    assert "resumed_at" not in whole
    with pytest.raises(Killed):
        run_point(cfg, tmp_path / "killed", kill_after=7)
    assert not (tmp_path / "killed" / "points" / "p.json").exists()
    saved = sorted(p.name for p in (partial_of(tmp_path / "killed") / "checkpoints").iterdir())
    assert saved == ["step_00000007"]  # one save kept, the last one before the kill
    resumed = run_point(cfg, tmp_path / "killed")
    assert resumed["resumed_at"] == [7]
    assert numbers(resumed) == numbers(whole)  # losses of every step, curve, select and report losses: exact
    assert len(resumed["losses"]) == STEPS and resumed["seconds"] > 0
    assert not partial_of(tmp_path / "killed").exists()  # gone once the point's file is written


def test_a_point_killed_twice_records_both_continuations(cfg, tmp_path):
    whole = run_point(cfg, tmp_path / "whole")
    for steps in (3, 2):  # the second process dies two steps after it continued from step 3
        with pytest.raises(Killed):
            run_point(cfg, tmp_path / "killed", kill_after=steps)
    resumed = run_point(cfg, tmp_path / "killed")
    assert resumed["resumed_at"] == [3, 5] and numbers(resumed) == numbers(whole)


def test_progress_of_another_configuration_is_discarded_and_the_point_starts_over(cfg, tmp_path, capsys):
    with pytest.raises(Killed):
        run_point(cfg, tmp_path / "a", lr=1e-2, kill_after=6)
    other = tmp_path / "b"
    (other / "points").mkdir(parents=True)
    partial_of(tmp_path / "a").rename(partial_of(other))  # lr 1e-2's progress where the lr 3e-3 point looks
    point = run_point(cfg, other)
    assert "another configuration" in capsys.readouterr().err and "resumed_at" not in point
    assert numbers(point) == numbers(run_point(cfg, tmp_path / "fresh"))


def test_a_damaged_save_is_discarded_with_one_line_and_the_point_starts_over(cfg, tmp_path, capsys):
    with pytest.raises(Killed):
        run_point(cfg, tmp_path / "killed", kill_after=6)
    weights = next(partial_of(tmp_path / "killed").glob("checkpoints/*/model.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    point = run_point(cfg, tmp_path / "killed")
    err = [line for line in capsys.readouterr().err.splitlines() if "not continued" in line]
    assert len(err) == 1 and "p.partial" in err[0] and "resumed_at" not in point
    assert numbers(point) == numbers(run_point(cfg, tmp_path / "fresh"))


def test_a_finished_point_never_reads_or_leaves_progress(cfg, tmp_path):
    point = run_point(cfg, tmp_path / "s")
    assert not partial_of(tmp_path / "s").exists()
    assert json.loads((tmp_path / "s" / "points" / "p.json").read_text())["losses"] == point["losses"]


@pytest.mark.slow  # compiles the model three times
def test_a_killed_compiled_point_continues_to_the_uninterrupted_points_numbers(corpus, tmp_path):
    """As the depth sweep runs its points: compiled per block."""
    cfg = build("depth", True, [f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}", "run.compile=true",
                                f"run.steps={STEPS}", "curve_every=2", "curve_batches=1"])
    whole = run_point(cfg, tmp_path / "whole")
    with pytest.raises(Killed):
        run_point(cfg, tmp_path / "killed", kill_after=5)
    resumed = run_point(cfg, tmp_path / "killed")
    assert resumed["resumed_at"] == [5] and resumed["execution"]["compile"] is True
    assert numbers(resumed) == numbers(whole)
