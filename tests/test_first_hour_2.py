"""A user's first hour, continued (issue 35): OpenMP's wait policy for Python users, one line on Ctrl-C, the
step `keel runs` shows for an interrupted run, short runs' plots, lm-eval offline. Each test failed before the
change it covers."""

import os
import subprocess
import sys

import pytest

import keel


# ---- OpenMP's wait policy: `import keel` does what the `keel` command does, while it can -----------------
def _policy_after(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code += "\nimport os\nprint(os.environ.get('OMP_WAIT_POLICY'))"
    return subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], capture_output=True,
                          text=True, timeout=120, env=base | env)


def test_import_keel_before_torch_makes_idle_openmp_threads_sleep():
    run = _policy_after("import keel\nimport torch")
    assert (run.returncode, run.stdout) == (0, "passive\n"), run.stderr[-1500:]


def test_a_wait_policy_the_user_chose_is_kept():
    run = _policy_after("import keel\nimport torch", OMP_WAIT_POLICY="active")
    assert (run.returncode, run.stdout) == (0, "active\n"), run.stderr[-1500:]


def test_with_torch_imported_first_the_policy_is_left_alone_and_a_busy_machine_is_warned(monkeypatch):
    # too late to take effect (OpenMP read the variable when torch loaded): setting it would only make
    # run.json's omp_wait_policy say what did not happen
    assert "torch" in sys.modules
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (5.5, 5.0, 4.0))
    assert keel._passive_openmp() == (
        "keel: torch was imported before keel, so its idle OpenMP threads spin; with load average 5.5 on 2 CPUs "
        "that can make CPU work several times slower: import keel before torch, or set OMP_WAIT_POLICY=passive "
        "before Python starts (OMP_WAIT_POLICY=active: keep spinning, no warning)")
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 1.0))  # an idle machine: nothing to say
    assert keel._passive_openmp() is None
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")  # the user's choice: no warning even when busy
    monkeypatch.setattr(os, "getloadavg", lambda: (5.5, 5.0, 4.0))
    assert keel._passive_openmp() is None


@pytest.mark.parametrize("load, warned", [(0.0, False), (99.0, True)])
def test_importing_keel_after_torch_warns_only_on_a_busy_machine(load, warned):
    code = (f"import os, warnings\nos.getloadavg = lambda: ({load!r}, 0.0, 0.0)\nimport torch\n"
            "with warnings.catch_warnings(record=True) as w:\n    warnings.simplefilter('always')\n    import keel\n"
            "print(len(w), w and w[0].category.__name__, w and os.path.basename(w[0].filename))")
    run = _policy_after(code)
    expected = "1 RuntimeWarning <string>\n" if warned else "0 [] []\n"
    assert (run.returncode, run.stdout) == (0, expected + "None\n"), run.stderr[-1500:]


# ---- Ctrl-C: one line on stderr, exit 130, and the step it reached -------------------------------------
def test_ctrl_c_is_one_line_on_stderr_and_the_run_shows_the_step_it_reached(tmp_path, monkeypatch, capsys):
    """Interrupted at step 16 with a metrics record every 10 steps: one stderr line naming step 16 and the resume
    command, nothing else said, exit 130; summary, checkpoint and `steps_done` all say 16 (the last record: 10).
    Before: four lines on stdout, and `keel runs` showed 10/300."""
    import json
    import signal

    from keel.cli import main
    from keel.train.run_dir import RunDir
    from keel.train.stop import steps_done
    from keel.train.trainer import Trainer

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


# ---- short runs' plots ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def telemetry_run(tmp_path_factory):
    """A 6-step tiny run with telemetry at steps 2, 4 and 6."""
    from keel.cli import main

    root = tmp_path_factory.mktemp("plot")
    assert main(["train", "--preset", "tiny", "run.steps=6", "run.telemetry_every=2", "run.eval_every=0",
                 "run.progress=false", f"run.out_dir={root}", "run.name=r"]) == 0
    return root / "r"


def test_heatmap_columns_are_centred_on_their_steps(telemetry_run):
    from keel.train.plot import build_figure

    images = [im for ax in build_figure([telemetry_run]).axes for im in ax.images]
    assert len(images) == 3  # gradient norm, stream RMS, |F| / |alpha x|
    # three columns at steps 2, 4, 6, each 2 steps wide (before: (2, 6), steps 2 and 6 at the columns' edges)
    assert {tuple(im.get_extent()[:2]) for im in images} == {(1.0, 7.0)}


def test_a_run_with_one_telemetry_record_gets_a_line_not_a_sliver_at_step_0(telemetry_run, tmp_path):
    import shutil

    from keel.train.plot import build_figure

    short = tmp_path / "short"
    shutil.copytree(telemetry_run, short)
    first = (short / "telemetry.jsonl").read_text().splitlines()[0]
    (short / "telemetry.jsonl").write_text(first + "\n")
    fig = build_figure([short])
    assert [ax for ax in fig.axes if ax.images] == []
    assert ("short: one telemetry record (step 2), no heatmaps: they need two or more (run.telemetry_every at "
            "most half of run.steps)") in fig._suptitle.get_text().replace("\n", " ")
    assert all(ax.get_xlim()[0] > 0 for ax in fig.axes)  # the curves keep their own range: nothing drawn at 0
