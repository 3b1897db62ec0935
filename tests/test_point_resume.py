"""A sweep's point killed mid-training continues from its last save: every number it writes is the uninterrupted
point's, bit for bit on a CPU; progress of another configuration or a damaged save is discarded with one line and
the point starts over; the progress goes once the point's file is written."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from keel import TransformerLM, runtime
from keel.cli.experiment import build
from keel.errors import CheckpointError
from keel.experiments import partial as partial_module
from keel.experiments import store
from keel.experiments.budget import budget_point
from keel.experiments.partial import Partial
from keel.experiments.sweep import Sweep

STEPS = 12


class Killed(Exception):
    """Stands for the process dying: nothing runs on the way out but `finally` blocks."""


@pytest.fixture(scope="module")
def cfg(corpus, tmp_path_factory):
    """The quick frontier study's configuration, its token cache shared by the module's tests (none damages it)."""
    return build("frontier", True, [f"data.source={corpus}", f"data.cache_dir={tmp_path_factory.mktemp('cache')}",
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


@pytest.fixture(scope="module")
def uninterrupted(cfg, tmp_path_factory):
    """The point uninterrupted (saving its progress after every step, as the killed ones do), run once for the
    module's tests that compare a continued or restarted point with it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(partial_module, "EVERY_SECONDS", 0.0)
        point = run_point(cfg, tmp_path_factory.mktemp("whole"))
    assert "resumed_at" not in point
    return point


def partial_of(out):
    return out / "points" / "p.partial"


def test_a_killed_point_continues_to_the_uninterrupted_points_numbers(cfg, uninterrupted, tmp_path, capsys):
    with pytest.raises(Killed):
        run_point(cfg, tmp_path / "killed", kill_after=7)
    assert not store.exists(tmp_path / "killed" / "points", "p")
    saved = sorted(p.name for p in (partial_of(tmp_path / "killed") / "checkpoints").iterdir())
    assert saved == ["step_00000007"]  # one save kept, the last one before the kill
    capsys.readouterr()
    resumed = run_point(cfg, tmp_path / "killed")
    assert "keel: p: continued from step 7 (its saved progress)" in capsys.readouterr().err.splitlines()
    assert resumed["resumed_at"] == [7]
    assert numbers(resumed) == numbers(uninterrupted)  # losses of every step, curve, select and report losses: exact
    assert len(resumed["losses"]) == STEPS and resumed["seconds"] > 0
    assert not partial_of(tmp_path / "killed").exists()  # gone once the point's file is written


def signalled_at(n_calls, signum=signal.SIGTERM):
    """A stand-in for runtime.stop_if_signalled that sends this process `signum` on its `n_calls`-th call (the
    sweep's call before the point is the first, then one as each step starts), and otherwise does what it does."""
    calls, real = {"n": 0}, runtime.stop_if_signalled

    def check():
        calls["n"] += 1
        if calls["n"] == n_calls:
            os.kill(os.getpid(), signum)
        real()
    return check


def test_sigterm_saves_the_points_progress_at_the_next_step_boundary(cfg, uninterrupted, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(partial_module, "EVERY_SECONDS", 1e9)  # no save on the clock: only the signal's
    before = signal.getsignal(signal.SIGTERM)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runtime, "stop_if_signalled", signalled_at(1 + 7))  # during step 7 of 12 (index 6)
        with pytest.raises(KeyboardInterrupt):
            run_point(cfg, tmp_path / "stopped")
    assert signal.getsignal(signal.SIGTERM) is before and not runtime.PENDING_SIGNALS
    assert "keel: p: progress saved at step 7" in capsys.readouterr().err.splitlines()
    assert sorted(p.name for p in (partial_of(tmp_path / "stopped") / "checkpoints").iterdir()) == ["step_00000007"]
    resumed = run_point(cfg, tmp_path / "stopped")
    assert resumed["resumed_at"] == [7] and numbers(resumed) == numbers(uninterrupted)


def test_a_signal_in_the_last_step_finishes_the_point_and_stops_the_sweep_before_the_next(cfg, tmp_path,
                                                                                           monkeypatch):
    monkeypatch.setattr(partial_module, "EVERY_SECONDS", 1e9)
    points = {key: (lambda: budget_point(cfg, cfg.point_model("keel", 4), 3e-3, 0)) for key in ("a", "b")}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runtime, "stop_if_signalled", signalled_at(1 + STEPS))  # during the last step
        try:
            with pytest.raises(KeyboardInterrupt):
                Sweep(tmp_path, cfg).run(points, "t")
        finally:
            signalled, runtime.PENDING_SIGNALS[:] = list(runtime.PENDING_SIGNALS), []
    assert signalled == [signal.SIGTERM]  # the sweep's next boundary raised it
    assert store.exists(tmp_path / "points", "a") and not store.exists(tmp_path / "points", "b")
    assert not (tmp_path / "points" / "b.partial").exists()  # b never started
    assert len(store.load(tmp_path / "points", "a")["losses"]) == STEPS


def test_a_point_killed_twice_records_both_continuations(cfg, uninterrupted, tmp_path):
    for steps in (3, 2):  # the second process dies two steps after it continued from step 3
        with pytest.raises(Killed):
            run_point(cfg, tmp_path / "killed", kill_after=steps)
    resumed = run_point(cfg, tmp_path / "killed")
    assert resumed["resumed_at"] == [3, 5] and numbers(resumed) == numbers(uninterrupted)


def test_progress_of_another_configuration_is_discarded_and_the_point_starts_over(cfg, uninterrupted, tmp_path, capsys):
    with pytest.raises(Killed):
        run_point(cfg, tmp_path / "a", lr=1e-2, kill_after=6)
    other = tmp_path / "b"
    (other / "points").mkdir(parents=True)
    partial_of(tmp_path / "a").rename(partial_of(other))  # lr 1e-2's progress where the lr 3e-3 point looks
    point = run_point(cfg, other)
    assert "another configuration" in capsys.readouterr().err and "resumed_at" not in point
    assert numbers(point) == numbers(uninterrupted)


def test_a_damaged_save_is_discarded_with_one_line_and_the_point_starts_over(cfg, uninterrupted, tmp_path, capsys):
    with pytest.raises(Killed):
        run_point(cfg, tmp_path / "killed", kill_after=6)
    weights = next(partial_of(tmp_path / "killed").glob("checkpoints/*/model.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    point = run_point(cfg, tmp_path / "killed")
    err = [line for line in capsys.readouterr().err.splitlines() if "not continued" in line]
    assert len(err) == 1 and "p.partial" in err[0] and "resumed_at" not in point
    assert numbers(point) == numbers(uninterrupted)


@pytest.mark.slow  # over a second in tests/durations.json
def test_progress_computed_with_another_thread_count_is_discarded(cfg, tmp_path, monkeypatch, capsys):
    """CPU reductions differ with the number of threads: such progress would not continue the same point."""
    with pytest.raises(Killed):
        run_point(cfg, tmp_path / "killed", kill_after=6)
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    point = run_point(cfg, tmp_path / "killed")
    assert "computed otherwise" in capsys.readouterr().err and "resumed_at" not in point


def test_progress_that_cannot_be_removed_fails_the_point_in_one_error_instead_of_looping(cfg, tmp_path, monkeypatch):
    with pytest.raises(Killed):
        run_point(cfg, tmp_path / "killed", kill_after=6)
    weights = next(partial_of(tmp_path / "killed").glob("checkpoints/*/model.safetensors"))
    weights.write_bytes(b"\0" * weights.stat().st_size)
    monkeypatch.setattr(partial_module, "discard", lambda path: None)
    with pytest.raises(CheckpointError, match="p.partial: cannot be removed"):
        run_point(cfg, tmp_path / "killed")


def test_the_guards_history_and_the_callers_state_come_back(cfg, tmp_path):
    """What the kill tests cannot see at 12 steps: the spike detector's history (it waits for 20 losses)."""
    from keel.data import WindowSampler
    from keel.train.guard import DivergenceGuard
    from keel.train.optim import build_optimizer

    def objects():
        torch.manual_seed(0)
        model = TransformerLM(cfg.point_model("keel", 4))
        return model, build_optimizer(model, cfg.optim), WindowSampler(np.arange(1000), 8, 2, seed=0), \
            DivergenceGuard(cfg.guard)
    model, optimizer, sampler, guard = objects()
    guard.history.extend([3.0, 2.5, 2.25])
    sampler.next_batch()
    saver = Partial(tmp_path / "p.partial", {"a": 1}, {"curve": [1.5]}, every_seconds=0.0)
    saver.maybe_save(3, model, optimizer, sampler, guard, [3.0, 2.5, 2.25], [1e-3] * 3, 4.0)
    model2, optimizer2, sampler2, guard2 = objects()
    state = {}
    assert Partial(tmp_path / "p.partial", {"a": 1}, state).restore(model2, optimizer2, sampler2, guard2) == (
        3, [3.0, 2.5, 2.25], [1e-3] * 3, 4.0)
    assert list(guard2.history) == [3.0, 2.5, 2.25] and state == {"curve": [1.5]}
    assert sampler2.state_dict()["step"] == sampler.state_dict()["step"] == 1


def test_a_finished_point_never_reads_or_leaves_progress(cfg, tmp_path):
    point = run_point(cfg, tmp_path / "s")
    assert not partial_of(tmp_path / "s").exists()
    assert store.load(tmp_path / "s" / "points", "p")["losses"] == point["losses"]
    orphan = partial_of(tmp_path / "s") / "checkpoints"  # a process killed between the point's file and the removal
    orphan.mkdir(parents=True)
    assert run_point(cfg, tmp_path / "s") == point and not partial_of(tmp_path / "s").exists()


# the size tests/test_experiments.py's compiled sweeps train at (d=16, 2 x 16 tokens): the compiled blocks are the
# same graphs, so whichever test runs second loads them from Inductor's on-disk caches instead of compiling its own
COMPILED_SIZE = ["model.d_model=16", "model.n_heads=2", "model.n_kv_heads=1", "run.seq_len=16", "run.batch_size=2"]


@pytest.mark.slow  # compiles the model three times
def test_a_killed_compiled_point_continues_to_the_uninterrupted_points_numbers(corpus, tmp_path):
    """As the depth sweep runs its points: compiled per block."""
    cfg = build("frontier", True, [f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}", *COMPILED_SIZE,
                                   "run.compile=true", f"run.steps={STEPS}", "curve_every=2", "curve_batches=1"])
    whole = run_point(cfg, tmp_path / "whole")
    with pytest.raises(Killed):
        run_point(cfg, tmp_path / "killed", kill_after=5)
    resumed = run_point(cfg, tmp_path / "killed")
    assert resumed["resumed_at"] == [5] and resumed["execution"]["compile"] is True
    assert numbers(resumed) == numbers(whole)


# a point long enough that a process seen past step STOP_AT is still training when it is stopped (170 steps left,
# about 3 s at load 5; the signal follows within 50 ms), and no longer: each test trains it about three times
POINT_STEPS, STOP_AT = 200, 30


def experiment_command(corpus, tmp_path, out):
    """A `keel experiment` process running one POINT_STEPS-step point, saving its progress every 0.2 s."""
    return [sys.executable, "-c", "import sys; from keel.experiments import partial; partial.EVERY_SECONDS = 0.2; "
            "from keel.cli import main; sys.exit(main(sys.argv[1:]))", "experiment", "frontier", "--quick",
            "--out", str(out), f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}", "depths=[4]",
            "schemes=[keel]", "lrs={keel: [0.003]}", "seeds=[0]", f"run.steps={POINT_STEPS}", "curve_every=50"]


def the_point(out):
    return store.load(out / "points", store.keys(out / "points")[0])


def started_mid_point(command, out, env, stderr=subprocess.DEVNULL):
    """The process of `command`, once its point has saved progress past step STOP_AT."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    deadline = time.monotonic() + 300
    while not any(int(p.name[5:]) >= STOP_AT for p in out.glob("points/*.partial/checkpoints/step_*")):
        assert process.poll() is None and time.monotonic() < deadline, "the point ended before it could be stopped"
        time.sleep(0.05)
    return process


@pytest.fixture(scope="module")
def whole(corpus, tmp_path_factory):
    """The uninterrupted point, from one `keel experiment` process: (its folder, whose data cache the stopped
    processes share, and the point it wrote)."""
    base = tmp_path_factory.mktemp("whole")
    done = subprocess.run(experiment_command(corpus, base, base / "whole"), env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return base, the_point(base / "whole")


@pytest.mark.slow  # two `keel experiment` processes, and the uninterrupted one (shared)
def test_a_sweep_process_killed_with_sigkill_continues_its_point_in_the_next_one(corpus, tmp_path, whole):
    """A real process death (SIGKILL: no `finally`, its claim left behind) in the middle of a point: the next
    `keel experiment` takes over the dead process's claim, continues the point from its last save, and writes the
    numbers an uninterrupted process writes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed, (base, uninterrupted) = tmp_path / "killed", whole
    process = started_mid_point(experiment_command(corpus, base, killed), killed, env)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert list(killed.glob("points/*.claim")) and not [p for p in killed.glob("points/*.json.gz")
                                                         if p.name != "config.json"]
    again = subprocess.run(experiment_command(corpus, base, killed), env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    resumed = the_point(killed)
    assert len(resumed["resumed_at"]) == 1 and STOP_AT <= resumed["resumed_at"][0] < POINT_STEPS
    assert f"continued from step {resumed['resumed_at'][0]}" in again.stderr
    assert numbers(resumed) == numbers(uninterrupted)
    assert not list(killed.glob("points/*.partial")) and not list(killed.glob("points/*.claim"))


@pytest.mark.slow  # two `keel experiment` processes, and the uninterrupted one (shared)
def test_a_sweep_process_stopped_with_sigterm_saves_at_the_step_it_reached_and_releases_its_claim(corpus, tmp_path,
                                                                                                  whole):
    """SIGTERM (how a session's end or a scheduler stops a sweep): one line, exit 130, the claim released, and the
    point's progress saved at the step boundary it reached, from which the next process continues to the
    uninterrupted numbers."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    stopped, (base, uninterrupted) = tmp_path / "stopped", whole
    process = started_mid_point(experiment_command(corpus, base, stopped), stopped, env, subprocess.PIPE)
    process.send_signal(signal.SIGTERM)
    err = process.communicate(timeout=120)[1]
    assert process.returncode == 130, err
    said = [line for line in err.splitlines() if "progress saved at step" in line]
    assert len(said) == 1 and err.rstrip().endswith("keel: interrupted"), err
    step = int(said[0].rsplit(" ", 1)[1])
    assert [p.name for p in stopped.glob("points/*.partial/checkpoints/*")] == [f"step_{step:08d}"]
    assert not list(stopped.glob("points/*.claim"))
    again = subprocess.run(experiment_command(corpus, base, stopped), env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    resumed = the_point(stopped)
    assert resumed["resumed_at"] == [step] and numbers(resumed) == numbers(uninterrupted)
