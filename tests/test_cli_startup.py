"""Start-up: commands that need no torch answer without importing it (version, help, usage and config errors,
`keel runs`), in one line where the input is wrong; generated text reaches the terminal without control bytes."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from keel.cli import COMMANDS, printable
from keel.config import load_config

# ---- start-up: commands that need no torch do not import it -------------------------------------------
NO_TORCH = [["--version"], ["--help"], [], ["trian"], ["eval"], ["generate", "--help"], ["eval", "--help"],
            ["runs", "--help"]]
ERRORS = [
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
    (["experiment", "frontier", "--bogus"], "unrecognized arguments: --bogus"),
    (["experiment", "nope"], "invalid choice: 'nope'"),
    (["bench", "--model-gpu", "X100"], "invalid choice: 'X100'"),
    (["bench", "--preset", "tiny", "model.nope=1"], "ModelConfig has no field 'nope'"),
]
USAGE = [[command, "--bogus"] for command in COMMANDS]
# One fresh interpreter runs keel.cli.main on each command line in turn, its output captured, and says after each
# whether torch is loaded; one that loaded torch ends it, and the next line starts a fresh interpreter, so each
# line is judged as if alone (imports only accumulate: a line that loads torch loads it after any other).
CHILD = """\
import contextlib, io, json, sys
from keel.cli import main
answers = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as stop:  # as the interpreter turns sys.exit's argument into a status
            rc = stop.code
            if not (rc is None or isinstance(rc, int)):
                print(rc, file=sys.stderr)
                rc = 1
    answers.append([0 if rc is None else rc, out.getvalue() + err.getvalue(), "torch" in sys.modules])
    if answers[-1][2]:
        break
with open(sys.argv[2], "w") as f:
    json.dump(answers, f)
"""


def _without_torch_each(argvs: list[list[str]], tmp: Path) -> dict[tuple, tuple[int, str, bool]]:
    """keel.cli.main(argv) for each of `argvs`, in fresh interpreters: {argv: (exit code, output, torch loaded)}."""
    answers, left = {}, list(argvs)
    while left:
        proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(left), str(tmp / "answers.json")],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        done = json.loads((tmp / "answers.json").read_text())
        answers |= {tuple(argv): tuple(answer) for argv, answer in zip(left, done)}
        left = left[len(done):]
    return answers


@pytest.fixture(scope="module")
def without_torch(tmp_path_factory):
    """Run keel.cli.main(argv) as in a fresh interpreter; returns (exit code, output) and fails if torch loaded.
    Every command line of this section is answered once, up front."""
    answers = _without_torch_each(NO_TORCH + [argv for argv, _ in ERRORS] + USAGE, tmp_path_factory.mktemp("cli"))

    def answer(argv: list[str]) -> tuple[int, str]:
        rc, out, torch_loaded = answers[tuple(argv)]
        assert not torch_loaded, (argv, "torch was imported", out[-1500:])
        return rc, out
    return answer


@pytest.mark.parametrize("argv", NO_TORCH)
def test_commands_that_need_no_torch_answer_without_it(argv, without_torch):
    rc, out = without_torch(argv)
    assert rc in (0, 2), out
    assert "Traceback" not in out


def test_version_and_help_say_what_they_should(without_torch):
    rc, out = without_torch(["--version"])
    assert rc == 0 and re.fullmatch(r"keel \S+\n", out)
    rc, out = without_torch(["--help"])
    assert rc == 0 and all(name in out for name in ("train", "eval", "generate", "experiment", "bench", "lm-eval"))
    rc, out = without_torch(["trian"])
    assert rc == 2 and len(out.strip().splitlines()) == 1 and "invalid choice: 'trian'" in out


def test_generate_help_shows_defaults(without_torch):
    rc, out = without_torch(["generate", "--help"])
    assert rc == 0
    for default in ("(default: 200)", "(default: 0.8)", "(default: 'def ')"):
        assert default in out, out
    assert "(default: None)" not in out and "(default: False)" not in out


@pytest.mark.parametrize("argv, says", ERRORS)
def test_argument_and_config_errors_answer_in_one_line_without_torch(argv, says, without_torch):
    """Before: keel.config imported the model, the data loader and keel.scale.parallel (all torch), and
    eval/generate/experiment imported their work before checking their arguments."""
    rc, out = without_torch(argv)
    assert rc == 2 and out.startswith("keel: error:") and len(out.strip().splitlines()) == 1, out
    assert says in out, out


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_commands_usage_error_answers_without_torch(command, without_torch):
    rc, out = without_torch([command, "--bogus"])
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
    answers = _without_torch_each([["runs", str(tmp_path)], ["runs", str(tmp_path), "--json"]], tmp_path)
    (rc, out, torch_loaded), (rc_json, out_json, torch_json) = answers.values()
    assert rc == 0 and not torch_loaded, out
    row = out.splitlines()[2].split()
    assert row == ["pre-ln-4L", "pre_ln", "4", "64", "7/7", "5.25", "-", "finished"], out
    assert rc_json == 0 and not torch_json and json.loads(out_json)[0]["val_loss"] == 5.25, out_json
    # a run that stopped without a summary: its status comes from its checkpoints (listed without torch too)
    (run / "summary.json").unlink()
    (run / "checkpoints" / "step_00000007").mkdir(parents=True)
    rc, out, torch_loaded = _without_torch_each([["runs", str(tmp_path)]], tmp_path)[("runs", str(tmp_path))]
    assert rc == 0 and not torch_loaded and out.splitlines()[2].split()[-1] == "interrupted", out


# ---- config reads and terminal output ----------------------------------------------------------------------
def test_log_to_as_a_bare_word_is_a_one_item_list():
    assert load_config(["run.log_to=tensorboard"], None, "tiny").run.log_to == ["tensorboard"]
    assert load_config(["run.eval_tasks=brackets,indent"], None, "tiny").run.eval_tasks == ["brackets", "indent"]
    assert load_config(["run.log_to=[tensorboard]"], None, "tiny").run.log_to == ["tensorboard"]


def test_generated_text_reaches_the_terminal_without_control_bytes():
    assert printable("a\rb\x1b[2Jc\nd\te") == "a\\rb\\x1b[2Jc\nd\te"
    assert printable("é ü 中") == "é ü 中"
