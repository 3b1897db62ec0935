"""Interrupts: Ctrl-C or SIGTERM at any moment (in imports, at start, mid-training) is one line and exit 130, with
a checkpoint at the step reached and the resume command; a signal Python swallowed still stops the command; a
resumed run counts the wall time of every segment."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keel.cli import main
from keel.config import load_config
from keel.runs.run_dir import RunDir, steps_done
from keel.train.trainer import Trainer

KEEL = Path(sys.executable).parent / "keel"
ENV = os.environ | {"OMP_NUM_THREADS": "1"}


@pytest.mark.slow  # over a second in tests/durations.json
def test_ctrl_c_is_one_line_on_stderr_and_the_run_shows_the_step_it_reached(tmp_path, monkeypatch, capsys):
    """Interrupted at step 16 with a metrics record every 10 steps: one stderr line naming step 16 and the resume
    command, nothing else said, exit 130; summary, checkpoint and `steps_done` all say 16 (the last record: 10).
    Before: four lines on stdout, and `keel runs` showed 10/300."""

    def ctrl_c_at_16(trainer, step):  # called before step `step` + 1, which then completes
        if step == 15:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: the trainer's handler only sets its flag
    real_init = Trainer.__init__
    monkeypatch.setattr(Trainer, "__init__", lambda self, config, run_dir=None, callbacks=(): real_init(
        self, config, run_dir, [*callbacks, ctrl_c_at_16]))
    rc = main(["train", "--preset", "tiny", "run.steps=300", "run.log_every=10", "run.eval_every=0",
               "run.progress=false", f"run.out_dir={tmp_path}", "run.name=r"])
    out, err = capsys.readouterr()
    run = tmp_path / "r"
    assert rc == 130
    assert err == f"keel: interrupted at step 16; saving its checkpoint; continue with: keel train resume={run}\n"
    assert "interrupted" not in out and "checkpoint" not in out and "curves" not in out, out
    assert json.loads((run / "summary.json").read_text())["steps"] == 16
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "step_00000016"
    assert (run / "curves.png").is_file()  # still drawn, without a line
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 10 and steps_done(RunDir.open(run)) == 16
    (run / "summary.json").write_text(json.dumps({"steps": "16"}))  # not a step count: the metrics alone
    assert steps_done(RunDir.open(run)) == 10


def _await_keels_handler(proc: subprocess.Popen, deadline: float) -> None:
    """Until `proc` catches SIGTERM (Linux's /proc/PID/status, SigCgt): keel.cli takes SIGINT and SIGTERM over
    together before anything heavy loads; Python itself catches only SIGINT. What comes before it, the
    interpreter's own start, is no code of keel's."""
    status = Path(f"/proc/{proc.pid}/status")
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            text = status.read_text()
        except OSError:  # it ended between the two looks: poll says so next
            continue
        caught = next((line for line in text.splitlines() if line.startswith("SigCgt:")), "SigCgt: 0")
        if int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1:
            return
        time.sleep(0.005)
    _, err = proc.communicate(timeout=60) if proc.poll() is not None else ("", "")
    raise AssertionError(f"keel's handler not in place (exit {proc.returncode}): {err[-2000:]}")


def _training(out: Path, deadline: float) -> bool:
    """Whether a run under `out` has logged a trained step (the tiny preset logs every step)."""
    while time.monotonic() < deadline:
        if any('"loss"' in m.read_text() for m in out.glob("*/metrics.jsonl")):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow  # eight subprocess runs, each waited on for seconds (the Ctrl-C test above is the fast one)
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc/PID/status (Linux)")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_at_any_moment_is_one_line_and_exit_130(tmp_path, signum):
    """Signalled during Python's imports of torch (the first seconds after keel's handler is in place: a signal
    during the interpreter's own start, before any keel code runs, gets Python's default), while a run starts, and
    mid-training (once the run has logged a step, however long the imports took): exit 130 and at most a line or
    two on stderr, never a traceback. A moment that the process outlives unsignalled would prove nothing, so each
    run trains far longer than the test waits."""
    for moment in (0.3, 1.0, 2.5, "training"):
        out = tmp_path / str(moment)
        proc = subprocess.Popen([str(KEEL), "train", "--preset", "tiny", "run.steps=100000", "run.progress=false",
                                 f"run.out_dir={out}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=ENV)
        if moment == "training":
            assert _training(out, time.monotonic() + 120), "no step logged in 120 s"
        else:
            _await_keels_handler(proc, time.monotonic() + 60)
            time.sleep(moment)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, (moment, proc.returncode, err[-2000:])
        assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, (moment, err[-2000:])
        assert moment != "training" or "keel: interrupted at step" in err, err[-2000:]  # it was training


def _swallowed_signal(monkeypatch):
    """A SIGINT whose KeyboardInterrupt Python swallowed (raised inside a callback, e.g. importlib's module-lock
    callback during an import, it is only printed): keel.cli's handler has recorded it, and the command goes on."""
    from keel import runtime

    monkeypatch.setattr(runtime, "PENDING_SIGNALS", [])  # this test's own: a signal it leaves is not the next test's
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


@pytest.mark.slow  # over a second in tests/durations.json
def test_a_swallowed_signal_still_stops_a_run_at_its_first_step_with_a_checkpoint(tmp_path, monkeypatch, capsys,
                                                                                  no_curves):
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


@pytest.mark.slow  # two tiny runs
def test_resumed_run_counts_wall_time_of_all_segments(tmp_path, capsys, monkeypatch, no_curves):
    """On a clock only the callbacks move, segment one takes 100 s and is interrupted (as by Ctrl-C) at step 3, the
    resumed segment 7 s: the resumed run's summary says 107 s. Before: wall_seconds of the last segment only."""
    import types

    import keel.train.trainer as trainer_module

    now = [1000.0]
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(time=lambda: now[0]))

    def slow_then_stop(trainer, step):
        if step == 1:
            now[0] += 100.0
        if step == 3:  # as Ctrl-C: the trainer's handler only sets its flag
            os.kill(os.getpid(), signal.SIGINT)

    config = load_config(["run.steps=6", "run.eval_every=0", f"run.out_dir={tmp_path}", "run.name=w"], None, "tiny")
    first = Trainer(config, callbacks=[slow_then_stop]).run()
    assert first["interrupted"] and first["wall_seconds"] == 100.0
    err = capsys.readouterr().err  # one line, said before the seconds the checkpoint takes
    assert err == ("keel: interrupted at step 4; saving its checkpoint; continue with: keel train "
                   f"resume={tmp_path / 'w'}\n")
    run = tmp_path / "w"
    resumed_config = RunDir.open(run).resume_config([f"resume={run}"])
    trainer = Trainer(resumed_config, callbacks=[lambda trainer, step: now.__setitem__(0, now[0] + 7.0 * (step == 4))])
    second = trainer.run(RunDir.open(run).latest_checkpoint())
    assert not second["interrupted"] and second["steps"] == 6
    assert second["wall_seconds"] == 107.0
    assert json.loads((run / "summary.json").read_text())["wall_seconds"] == second["wall_seconds"]
