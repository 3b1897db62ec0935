"""A user's first hour on a shared machine (issue 23, and issue 22's small frictions): threads, start-up
without torch, a light install, one-line errors, wall time over resumed segments. Each test failed before
the change it covers (timings live in benchmarks/cpu/threads, never here)."""

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from keel import runtime
from keel.cli import COMMANDS, main, printable
from keel.config import load_config
from keel.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
TRAINING_DOC = (ROOT / "docs" / "training.md").read_text()  # run directories, tracking
DOCS = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


# ---- start-up: commands that need no torch do not import it -------------------------------------------
def _without_torch(argv: list[str]) -> tuple[int, str]:
    """Run keel.cli.main(argv) in a fresh interpreter; returns (exit code, output) and fails if torch loaded."""
    code = (f"import sys\nfrom keel.cli import main\ntry:\n    rc = main({argv!r})\nexcept SystemExit as e:\n"
            "    rc = e.code\nassert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "torch was imported" not in proc.stderr, (argv, proc.stderr[-1500:])
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("argv", [["--version"], ["--help"], [], ["trian"], ["eval"], ["generate", "--help"],
                                  ["eval", "--help"], ["runs", "--help"]])
def test_commands_that_need_no_torch_answer_without_it(argv):
    rc, out = _without_torch(argv)
    assert rc in (0, 2), out
    assert "Traceback" not in out


def test_version_and_help_say_what_they_should():
    rc, out = _without_torch(["--version"])
    assert rc == 0 and re.fullmatch(r"keel \S+\n", out)
    rc, out = _without_torch(["--help"])
    assert rc == 0 and all(name in out for name in ("train", "eval", "generate", "experiment", "bench", "lm-eval"))
    rc, out = _without_torch(["trian"])
    assert rc == 2 and len(out.strip().splitlines()) == 1 and "invalid choice: 'trian'" in out


def test_generate_help_shows_defaults():
    rc, out = _without_torch(["generate", "--help"])
    assert rc == 0
    for default in ("(default: 200)", "(default: 0.8)", "(default: 'def ')"):
        assert default in out, out
    assert "(default: None)" not in out and "(default: False)" not in out


@pytest.mark.parametrize("argv, says", [
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["train", "model.nope=1"], "ModelConfig has no field 'nope'"),
    (["train", "run.steps=abc"], "run.steps: Value 'abc'"),
    (["train", "steps=5"], "did you mean run.steps?"),
    (["train", "--preset", "tiny", "run.threads=-2"], "run.threads: got -2"),
    (["train", "model.scheme=pre_ln", "model.alpha=4"], "ModelConfig.alpha"),  # a scheme's own option check
    (["train", "run.eval_tasks=[bogus]"], "unknown task 'bogus'"),
    (["train", "--preset", "tiny", "run.pp=3"], "run.pp: 3 stages"),  # a pipeline check, before pipelining loads
    (["train", "run.pp=2", "run.pp_microbatches=3"], "run.pp_microbatches: 3 does not divide"),
    (["summary", "model.d_model=7"], "ModelConfig.d_model"),
    (["eval", "run", "--batches", "-1"], "--batches: got -1"),
    (["generate", "run", "--top-p", "2"], "--top-p: got 2.0"),
    (["experiment", "depth", "--bogus"], "unrecognized arguments: --bogus"),
    (["experiment", "nope"], "invalid choice: 'nope'"),
    (["bench", "--model-gpu", "X100"], "invalid choice: 'X100'"),
    (["bench", "--preset", "tiny", "model.nope=1"], "ModelConfig has no field 'nope'"),
])
def test_argument_and_config_errors_answer_in_one_line_without_torch(argv, says):
    """Before: keel.config imported the model, the data loader and keel.scale.parallel (all torch), and
    eval/generate/experiment imported their work before checking their arguments."""
    rc, out = _without_torch(argv)
    assert rc == 2 and out.startswith("keel: error:") and len(out.strip().splitlines()) == 1, out
    assert says in out, out


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_commands_usage_error_answers_without_torch(command):
    rc, out = _without_torch([command, "--bogus"])
    assert rc == 2 and out.startswith("keel: error:") and len(out.strip().splitlines()) == 1, out


def test_runs_lists_runs_without_torch(tmp_path):
    """`keel runs` reads config.yaml, metrics.jsonl and summary.json: no torch (before: run_dir imported the
    model and checkpoints, and the config the model, the data loader and keel.scale.parallel)."""
    from keel.config import to_yaml

    run = tmp_path / "pre-ln-4L"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(["model.scheme=pre_ln", "run.steps=7"], None, "tiny")))
    (run / "metrics.jsonl").write_text('{"step": 7, "loss": 5.5}\n{"step": 7, "val_loss": 5.25}\n')
    (run / "summary.json").write_text(json.dumps({"steps": 7, "diverged": False, "interrupted": False}))
    rc, out = _without_torch(["runs", str(tmp_path)])
    assert rc == 0, out
    row = out.splitlines()[2].split()
    assert row == ["pre-ln-4L", "pre_ln", "4", "64", "7/7", "5.25", "-", "finished"], out
    rc, out = _without_torch(["runs", str(tmp_path), "--json"])
    assert rc == 0 and json.loads(out)[0]["val_loss"] == 5.25, out
    # a run that stopped without a summary: its status comes from its checkpoints (listed without torch too)
    (run / "summary.json").unlink()
    (run / "checkpoints" / "step_00000007").mkdir(parents=True)
    rc, out = _without_torch(["runs", str(tmp_path)])
    assert rc == 0 and out.splitlines()[2].split()[-1] == "interrupted", out


# ---- threads ----------------------------------------------------------------------------------------------
def test_default_threads_are_physical_cores_within_the_affinity_mask(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    usable = len(os.sched_getaffinity(0))
    assert 1 <= runtime.physical_cores() <= usable
    assert runtime.default_threads() == runtime.physical_cores()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # e.g. taskset -c 0, or a 1-CPU container
    assert runtime.default_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "64")  # the user's setting wins, within the usable CPUs
    assert runtime.default_threads() == 1


def test_physical_cores_count_hyper_threads_of_one_core_once(tmp_path, monkeypatch):
    """On a made-up /sys topology: 4 CPUs, two hyper-threads on each of 2 cores -> 2; the same core id on two
    packages is two cores; a CPU outside the affinity mask does not count; no topology -> one per usable CPU."""
    def topology(cpus: dict[int, tuple[int, int]]) -> None:
        for cpu, (package, core) in cpus.items():
            where = tmp_path / f"sys/devices/system/cpu/cpu{cpu}/topology"
            where.mkdir(parents=True, exist_ok=True)
            (where / "physical_package_id").write_text(f"{package}\n")
            (where / "core_id").write_text(f"{core}\n")
    monkeypatch.setattr(runtime, "Path", lambda path: tmp_path / str(path).lstrip("/"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    topology({0: (0, 0), 1: (0, 0), 2: (0, 1), 3: (0, 1)})
    assert runtime.physical_cores() == 2
    topology({2: (1, 0), 3: (1, 0)})  # cpus 2 and 3 on a second package, core id 0 there too
    assert runtime.physical_cores() == 2
    topology({2: (1, 0), 3: (1, 1)})
    assert runtime.physical_cores() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # taskset -c 0,1: one core's two threads
    assert runtime.physical_cores() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 7})  # cpu7 has no topology here
    assert runtime.physical_cores() == 3


def test_run_threads_is_applied_printed_and_recorded(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # restored after the test
    before = torch.get_num_threads()
    try:
        assert main(["train", "--preset", "tiny", "run.steps=2", "run.threads=1", "run.eval_every=0",
                     f"run.out_dir={tmp_path}", "run.name=t"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert "1 thread (run.threads)" in out
    run = tmp_path / "t"
    assert json.loads((run / "run.json").read_text())["torch_threads"] == 1
    assert "threads: 1" in (run / "config.yaml").read_text()


def test_a_busy_machine_gets_a_note_pointing_to_run_threads(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (40.0, 40.0, 40.0))
    assert "run.threads=1" in runtime.busy_note(threads=2)
    assert "run.threads=1" not in runtime.busy_note(threads=1)  # nothing left to lower
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    assert runtime.busy_note(threads=2) is None


def test_threads_refused_in_one_line(capsys):
    assert main(["train", "--preset", "tiny", "run.threads=-2"]) == 2
    assert "run.threads: got -2" in capsys.readouterr().err


def test_every_torch_command_sets_threads_before_its_work(monkeypatch):
    """The dispatcher applies run.threads (or the default) before calling the command."""
    calls = []
    monkeypatch.setattr(runtime, "set_threads", lambda n=0: calls.append(n) or 1)
    import keel.cli as cli

    monkeypatch.setattr(cli, "cmd_runs", lambda args: calls.append("work") or 0)
    monkeypatch.setattr(cli, "add_runs_command", lambda sub: sub.add_parser("runs").set_defaults(func=cli.cmd_runs))
    monkeypatch.setitem(cli._BUILDERS, "runs", cli.add_runs_command)
    assert main(["runs"]) == 0
    assert calls == [0, "work"]


# ---- one line instead of a traceback ----------------------------------------------------------------------
def test_log_to_as_a_bare_word_is_a_one_item_list():
    assert load_config(["run.log_to=tensorboard"], None, "tiny").run.log_to == ["tensorboard"]
    assert load_config(["run.eval_tasks=brackets,indent"], None, "tiny").run.eval_tasks == ["brackets", "indent"]
    assert load_config(["run.log_to=[tensorboard]"], None, "tiny").run.log_to == ["tensorboard"]


@pytest.mark.slow
def test_lm_eval_task_that_cannot_be_fetched_offline_is_one_line(tmp_path):
    pytest.importorskip("lm_eval")
    assert main(["train", "--preset", "tiny", "run.steps=1", "run.eval_every=0", "run.progress=false",
                 f"run.out_dir={tmp_path}", "run.name=r"]) == 0
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "keel.cli", "lm-eval", str(tmp_path / "r"), "--tasks", "hellaswag",
                           "--limit", "1", "--device", "cpu"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("keel: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "'hellaswag'" in errors[0] and "--include-path" in errors[0]
    assert "Writing model shards" not in proc.stderr + proc.stdout  # transformers' own bars stay quiet


def test_fetch_failure_is_found_through_the_exception_chain():
    from keel.evals.in_memory_lm import fetch_failure

    class OfflineModeIsEnabled(Exception):
        pass

    try:
        try:
            raise OfflineModeIsEnabled("offline")
        except OfflineModeIsEnabled:
            raise RuntimeError("while loading the dataset")  # noqa: B904 (the implicit chain is the point)
    except RuntimeError as err:
        assert fetch_failure(err) == "offline"
    assert fetch_failure(ValueError("a bug")) is None


def test_generated_text_reaches_the_terminal_without_control_bytes():
    assert printable("a\rb\x1b[2Jc\nd\te") == "a\\rb\\x1b[2Jc\nd\te"
    assert printable("é ü 中") == "é ü 中"


# ---- interruption and wall time -----------------------------------------------------------------------------
@pytest.mark.slow  # two tiny runs
def test_resumed_run_counts_wall_time_of_all_segments(tmp_path, capsys, monkeypatch):
    """On a clock only the callbacks move, segment one takes 100 s and is interrupted (as by Ctrl-C) at step 3, the
    resumed segment 7 s: the resumed run's summary says 107 s. Before: wall_seconds of the last segment only."""
    import signal
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
    from keel.runs.run_dir import RunDir

    resumed_config = RunDir.open(run).resume_config([f"resume={run}"])
    trainer = Trainer(resumed_config, callbacks=[lambda trainer, step: now.__setitem__(0, now[0] + 7.0 * (step == 4))])
    second = trainer.run(RunDir.open(run).latest_checkpoint())
    assert not second["interrupted"] and second["steps"] == 6
    assert second["wall_seconds"] == 107.0
    assert json.loads((run / "summary.json").read_text())["wall_seconds"] == second["wall_seconds"]


# ---- install: light for users, heavy extras for developers --------------------------------------------------
def test_light_install_has_what_train_eval_generate_plot_need_and_no_triton():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for needed in ("torch", "numpy", "omegaconf", "safetensors", "tokenizers", "tqdm", "matplotlib"):
        assert needed in core
    for heavy in ("triton", "transformers", "lm_eval", "tensorboard", "datasets", "wandb"):
        assert heavy not in core
    extras = project["optional-dependencies"]
    assert any(d.startswith("triton") for d in extras["kernels"])
    assert any(d.startswith("triton") for d in extras["test"])  # tests/test_junction.py runs its interpreter


@pytest.mark.slow
def test_train_eval_generate_plot_run_on_the_light_install(tmp_path):
    """With every package outside the light install made unimportable, the user's commands still work."""
    heavy = ["triton", "transformers", "lm_eval", "tensorboard", "datasets", "pyarrow", "wandb", "accelerate",
             "hypothesis"]
    code = f"""
import importlib.machinery as machinery, sys
class LightInstall(machinery.PathFinder):  # site-packages as if the heavy packages were never installed
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] in {heavy!r} else super().find_spec(name, path, target)
sys.meta_path = [LightInstall if f is machinery.PathFinder else f for f in sys.meta_path]
import importlib.util
assert importlib.util.find_spec("transformers") is None and importlib.util.find_spec("matplotlib") is not None
from keel.cli import main
run = {str(tmp_path / "r")!r}
assert main(["train", "--preset", "tiny", "run.steps=2", "run.out_dir={tmp_path}", "run.name=r"]) == 0
assert main(["eval", run, "--batches", "1"]) == 0
assert main(["generate", run, "--max-new-tokens", "3"]) == 0
assert main(["plot", run]) == 0
assert main(["runs", {str(tmp_path)!r}]) == 0
assert not any(m.split(".")[0] in {heavy!r} for m in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_ci_installs_what_the_readme_tells_a_developer():
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"pip install -c constraints.txt -e \.\s", quick_start)  # the light install, for a user
    ci = (ROOT / ".ci" / "run").read_text()
    install = next(line.strip() for line in ci.splitlines() if line.strip().startswith("pip install"))
    assert install in quick_start, install


def test_readme_names_the_files_and_quotes_the_globs():
    assert "`eval-" in TRAINING_DOC.split("A run directory holds", 1)[1][:800]  # the run files include eval-*.json
    assert "run.log_to=[tensorboard]" not in DOCS.replace("'run.log_to=[tensorboard]'", "")
    assert "run.threads" in README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "run.steps=50" in README


def test_hf_and_runs_are_ignored_by_git():
    for path in ("hf/config.json", "runs/x/config.yaml"):
        proc = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert proc.returncode == 0, path
    assert subprocess.run(["git", "check-ignore", "-q", "src/keel/hf/new.py"], cwd=ROOT).returncode == 1
