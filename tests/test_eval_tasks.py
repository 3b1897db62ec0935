"""`run.eval_tasks` in `keel train`: scores at the configured steps in metrics.jsonl, summary.json, TensorBoard,
`keel runs` and `keel plot`, equal to a separate keel.evals.score of the saved checkpoint, without changing the
training trajectory or the bit-exact resume; a bad task name fails before anything is written."""

import inspect
import json
from pathlib import Path

import matplotlib.image
import pytest

from keel import evals
from keel.cli import main
from keel.config import load_config
from keel.reporting import plot
from keel.reporting.tables import flat_scores, task_columns, task_scores
from keel.runs.run_dir import RunDir
from keel.train.trainer import Trainer

TASKS = ["brackets", "next_line"]


@pytest.fixture
def tree(tmp_path) -> Path:
    """Real source text as a directory of files: next_line needs several validation documents."""
    import argparse
    import ast
    import calendar
    import configparser
    import csv
    import dataclasses
    import difflib
    import fractions
    import gettext
    import json as json_module
    import pathlib
    import shlex
    import string
    import textwrap

    root = tmp_path / "tree"
    root.mkdir()
    for m in (argparse, ast, calendar, configparser, csv, dataclasses, difflib, fractions, gettext, json_module,
              pathlib, shlex, string, textwrap):
        (root / f"{m.__name__.replace('.', '_')}.py").write_text(inspect.getsource(m))
    return root


@pytest.fixture
def targs(tree, tmp_path):
    def make(*extra, name="run"):
        return ["--preset", "tiny", f"data.source={tree}", "data.val_fraction=0.25",
                f"data.cache_dir={tmp_path / 'cache'}", f"run.out_dir={tmp_path / 'runs'}", f"run.name={name}", *extra]
    return make


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records(run_dir) if "loss" in r and "event" not in r]


def scored(run_dir: Path) -> list[tuple[int, dict]]:
    """(step, task scores) of every record that holds them (the seconds left out: they are the clock's)."""
    return [(r["step"], task_scores(r)) for r in records(run_dir) if task_scores(r)]


def test_flat_keys_round_trip_also_for_a_task_path_with_slashes():
    scores = {"brackets": {"acc": 0.5, "acc_norm": 0.25, "n": 8, "chance": 0.25, "version": 1},
              "lm_eval:tasks/x.yaml": {"acc": 1.0, "n": 2, "chance": None, "metrics": {"acc,none": 1.0}}}
    flat = flat_scores(scores)
    assert flat["task/brackets/acc"] == 0.5 and "task/brackets/version" not in flat
    assert task_scores(flat) == {"brackets": {"acc": 0.5, "acc_norm": 0.25, "n": 8, "chance": 0.25},
                                 "lm_eval:tasks/x.yaml": {"acc": 1.0, "n": 2}}
    records_ = [{"step": 1, **flat}, {"step": 2, "loss": 3.0}]
    assert task_columns(records_) == {"task_acc": 0.75, "task_scores": {"brackets": 0.5, "lm_eval:tasks/x.yaml": 1.0}}
    assert task_columns([{"step": 1, "loss": 3.0}]) == {"task_acc": None, "task_scores": {}}


def test_a_bad_task_name_is_one_line_and_exit_2_before_anything_is_written(targs, tmp_path, capsys):
    assert main(["train", *targs("run.eval_tasks=[brackets,bracket]")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run.eval_tasks" in err and "'brackets'" in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()
    assert main(["train", *targs("run.eval_tasks=[brackets]", "run.eval_tasks_every=-1")]) == 2
    assert main(["train", *targs("run.eval_tasks=[brackets]", "run.eval_tasks_items=0")]) == 2
    assert not (tmp_path / "runs").exists()


def test_experiments_refuse_the_fields_they_do_not_use(capsys):
    assert main(["experiment", "frontier", "--quick", "run.eval_tasks=[brackets]"]) == 2
    assert "run.eval_tasks: not used here" in capsys.readouterr().err


@pytest.mark.slow
def test_scores_at_the_steps_in_every_output_and_equal_to_scoring_the_checkpoint(targs, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    on = ["run.steps=25", "run.eval_tasks_every=10", "run.eval_tasks_items=24", "run.log_to=[tensorboard]"]
    assert main(["train", *targs(*on, f"run.eval_tasks=[{','.join(TASKS)}]", name="tasks")]) == 0
    out = capsys.readouterr().out
    assert main(["train", *targs(*on, name="plain")]) == 0
    tasks_dir, plain_dir = tmp_path / "runs" / "tasks", tmp_path / "runs" / "plain"

    # scoring leaves training alone: every logged loss bit for bit
    assert losses(tasks_dir) == losses(plain_dir) and len(losses(plain_dir)) == 25

    lines = [line for line in out.splitlines() if ": tasks: " in line]
    assert [line.split(":")[0] for line in lines] == ["step 10", "step 20", "step 25"], out
    assert "brackets" in lines[0] and "next_line" in lines[0] and "48 items in" in lines[0]

    history = scored(tasks_dir)
    assert [s for s, _ in history] == [10, 20, 25]
    assert all(set(scores) == set(TASKS) for _, scores in history)
    assert all(s["n"] == 24 and s["chance"] == 0.25 and 0 <= s["acc"] <= 1 for _, scores in history
               for s in scores.values())
    assert not scored(plain_dir)
    summary = json.loads((tasks_dir / "summary.json").read_text())
    assert task_scores(summary) == history[-1][1]

    # the in-loop scores are those of a separate scoring of the saved final checkpoint, on the same items
    config, model, tokenizer, path = RunDir.open(tasks_dir).load_model()
    assert path.name == "step_00000025"
    again = evals.score(model, evals.resolve(TASKS), config.data, tokenizer, max_items=24, device="cpu")
    assert task_scores(flat_scores(again)) == history[-1][1]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tasks_dir / "tensorboard"))
    events.Reload()
    board = events.Scalars("task/brackets/acc")
    assert [e.step for e in board] == [10, 20, 25]
    assert [e.value for e in board] == pytest.approx([scores["brackets"]["acc"] for _, scores in history])

    # keel runs: the mean accuracy of the last scores; nothing for the run without tasks
    capsys.readouterr()
    assert main(["runs", str(tmp_path / "runs")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "task_acc" in table[0]
    mean = sum(s["acc"] for s in history[-1][1].values()) / len(TASKS)
    column = table[0].index("task_acc")
    row = {line.split()[0]: line[column:].split()[0] for line in table[2:]}
    assert float(row["tasks"]) == pytest.approx(mean, abs=1e-4) and row["plain"] == "-"

    # keel plot: the task panel beside the losses, one line per task, chance dotted
    figures = []
    build = plot.build_figure
    with pytest.MonkeyPatch.context() as mp:  # keep each figure keel plot draws (a Figure of its own, no pyplot)
        mp.setattr(plot, "build_figure", lambda runs: figures.append(build(runs)) or figures[-1])
        assert main(["plot", str(tasks_dir)]) == 0
        assert main(["plot", str(plain_dir)]) == 0
    panel = next(a for a in figures[0].axes if a.get_title().startswith("task accuracy"))
    assert not [a for a in figures[1].axes if a.get_title().startswith("task accuracy")]  # no empty panel
    assert sorted(line.get_label() for line in panel.get_lines() if line.get_linestyle() == "-") == TASKS
    assert [line.get_ydata()[0] for line in panel.get_lines() if line.get_linestyle() == ":"] == [0.25]
    for line in panel.get_lines():
        if line.get_label() in TASKS:
            accs = [scores[line.get_label()]["acc"] for _, scores in history]
            assert list(line.get_xdata()) == [10, 20, 25] and list(line.get_ydata()) == accs
    # and in the pixels: coloured curves in the top-right panel, where the task panel sits
    image = matplotlib.image.imread(tasks_dir / "curves.png")[..., :3]  # (H, W, 3)
    h, w = image.shape[:2]
    corner = image[: h // 3, 2 * w // 3:]
    assert ((corner.max(-1) - corner.min(-1)) > 0.3).sum() > 100  # saturated pixels: a curve, not text or frame


@pytest.mark.slow
def test_a_killed_and_resumed_run_repeats_the_uninterrupted_run_scores_included(targs):
    class Killed(Exception):
        pass

    def kill(trainer, step):
        if step == 13:
            raise Killed

    def trainer(name, callbacks=()):
        config = load_config(targs("run.ckpt_every=5", "run.eval_tasks=[brackets,next_line]",
                                   "run.eval_tasks_every=5", "run.eval_tasks_items=24", name=name)[2:],
                             preset="tiny")
        return Trainer(config, Path(config.run.out_dir) / config.run.name, callbacks)

    trainer("straight").run()
    killed = trainer("killed", [kill])
    with pytest.raises(Killed):
        killed.run()
    assert main(["train", f"resume={killed.run_dir}", "run.progress=false"]) == 0
    straight_dir = killed.run_dir.parent / "straight"
    assert losses(killed.run_dir) == losses(straight_dir) and len(losses(straight_dir)) == 20
    assert [s for s, _ in scored(straight_dir)] == [5, 10, 15, 20]
    assert scored(killed.run_dir) == scored(straight_dir)


@pytest.mark.slow
@pytest.mark.distributed
def test_under_torchrun_the_ranks_score_what_one_process_scores_of_the_same_weights(targs, tmp_path, torchrun):
    out = torchrun("keel.cli", "train", *targs("run.batch_size=2", "run.steps=6", "run.eval_every=0",
                                               "run.eval_tasks=[brackets,next_line]", "run.eval_tasks_every=3",
                                               "run.eval_tasks_items=24", "run.curves=false", name="ranks"),
                   timeout=300)
    assert out.stdout.count(": tasks: ") == 2  # steps 3 and 6, printed by rank 0 alone
    run_dir = tmp_path / "runs" / "ranks"
    history = scored(run_dir)
    assert [s for s, _ in history] == [3, 6]
    config, model, tokenizer, path = RunDir.open(run_dir).load_model()
    assert path.name == "step_00000006"
    alone = evals.score(model, evals.resolve(TASKS), config.data, tokenizer, max_items=24, device="cpu")
    assert task_scores(flat_scores(alone)) == history[-1][1]
