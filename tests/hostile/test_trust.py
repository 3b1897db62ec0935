"""A run's config never brings code (keel.runs.trust): every field of a downloaded or copied run's config.yaml
that names a file or a module is planted with a file that would leave a marker if it ran, and each command that
reads the config is run on it. The marker must stay absent and a command that would obey the field refuse it in
one line naming the field (exit 2, no traceback); a task file the user names on the command line runs as asked."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
from pathlib import Path

import pytest
import yaml

from damage import refused, victim
from keel.cli import main
from keel.runs import trust

RESUME = ("run.steps=3", "run.progress=false", "run.eval_every=0")


@pytest.fixture(scope="module")
def trained(tiny_two_step_run) -> Path:
    return tiny_two_step_run  # made once for the session (tests/conftest.py)


@pytest.fixture
def run(trained, corpus, tmp_path) -> Path:
    """A copy of a trained run, as someone would send it: its corpus inside it and no cache of its own, so the
    data paths pass the trust check and only the field under test can be refused. Edited, so not signed for
    this user."""
    run = victim(trained, tmp_path)
    shutil.copy(corpus, run / "corpus.txt")
    edit(run, data__source=str(run / "corpus.txt"), data__cache_dir="")
    assert not trust.trusted(run)
    return run


def edit(run: Path, **fields) -> None:
    config = yaml.safe_load((run / "config.yaml").read_text())
    for key, value in fields.items():
        section, name = key.split("__")
        config[section][name] = value
    (run / "config.yaml").write_text(yaml.safe_dump(config))


def plant_module(folder: Path, marker: Path) -> str:
    """A Python module in `folder` that creates `marker` when imported; returns its name (unique: Python and the
    harness cache imported modules by name, so a second test's module must not be taken for the first's)."""
    name = f"planted_{secrets.token_hex(4)}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n\n\n"
                                       "def process_docs(docs):\n    return docs\n")
    return name


def plant_task(folder: Path, marker: Path, file_name: str = "task.yaml") -> Path:
    """An lm-evaluation-harness multiple-choice task over local rows whose `process_docs` is a `!function` in a
    module beside it: loading the task imports that module, which creates `marker`."""
    module = plant_module(folder, marker)
    rows = [{"question": "def add(a, b):", "choices": ["return a + b", "(((", "]]"], "answer": 0},
            {"question": "import", "choices": ["}}", "sys", "= ="], "answer": 1}]
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = folder / file_name
    path.write_text(f"""task: planted_{module}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'rows.jsonl'}
test_split: test
output_type: multiple_choice
process_docs: !function {module}.process_docs
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    return path


def unchanged(run: Path, config: bytes) -> None:
    """Nothing of the refused command is left in the run: no step trained, its config not rewritten (or signed)."""
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]
    assert (run / "config.yaml").read_bytes() == config and not trust.trusted(run)


# ---- run.eval_tasks: a task file is code ----------------------------------------------------------------------
@pytest.mark.parametrize("where", ["inside the run", "outside the run"])
def test_a_task_file_from_the_runs_config_does_not_run_on_resume(run, tmp_path, where, capsys):
    pytest.importorskip("lm_eval")
    marker = tmp_path / "ran"
    task = plant_task(run / "tasks" if where == "inside the run" else tmp_path / "elsewhere", marker)
    edit(run, run__eval_tasks=[f"lm_eval:{task}"])
    config = (run / "config.yaml").read_bytes()
    line = refused(capsys, "run.eval_tasks", "train", f"resume={run}", *RESUME)
    assert str(task) in line and "--trust-config" in line
    # the run's own config.yaml given as --config does not name the task either: it is still the sender's
    refused(capsys, "run.eval_tasks", "train", f"resume={run}", "--config", run / "config.yaml", *RESUME)
    assert not marker.exists()
    unchanged(run, config)


@pytest.mark.slow  # two resumes that load the harness
def test_a_task_file_named_on_the_command_line_runs_as_asked(run, tmp_path, capsys):
    """The same planted files: named by the user, the task loads (its module runs) and is scored. The resume
    then signs the config for this user, task included: they chose it. --trust-config runs the config's own."""
    pytest.importorskip("lm_eval")
    marker = tmp_path / "ran"
    task = plant_task(run / "tasks", marker)
    edit(run, run__eval_tasks=[f"lm_eval:{task}"])
    assert main(["train", f"resume={run}", *RESUME, f"run.eval_tasks=lm_eval:{task}"]) == 0
    assert marker.exists()
    scored = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if f"task/lm_eval:{task}/acc" in r]
    assert [r["step"] for r in scored] == [3] and 0 <= scored[0][f"task/lm_eval:{task}/acc"] <= 1
    assert trust.trusted(run)

    again = victim(run, tmp_path / "again")  # sent on: edited, so untrusted again
    fresh = tmp_path / "ran-again"  # a module of another name: the first one stays imported in this process
    edit(again, data__source=str(again / "corpus.txt"),
         run__eval_tasks=[f"lm_eval:{plant_task(again / 'tasks', fresh, 'fresh.yaml')}"])
    assert not trust.trusted(again)
    refused(capsys, "run.eval_tasks", "train", f"resume={again}", "run.steps=4", "run.progress=false")
    assert not fresh.exists()
    assert main(["train", f"resume={again}", "run.steps=4", "run.progress=false", "--trust-config"]) == 0
    assert fresh.exists()


@pytest.mark.slow  # each command loads the model; lm-eval exports it and loads the harness
@pytest.mark.parametrize("command", ["eval", "runs", "summary", "generate", "export-hf", "lm-eval"])
def test_commands_that_do_not_score_the_runs_tasks_load_none(run, tmp_path, command, capsys):
    """eval, runs, summary, generate, export-hf and lm-eval read the planted config and never load its task
    (lm-eval scores only the tasks its command line names)."""
    pytest.importorskip("lm_eval")
    marker = tmp_path / "ran"
    edit(run, run__eval_tasks=[f"lm_eval:{plant_task(run / 'tasks', marker)}"])
    argv = {"eval": ["eval", run, "--batches", "1", "--device", "cpu"], "runs": ["runs", run.parent],
            "summary": ["summary", run], "generate": ["generate", run, "--max-new-tokens", "2"],
            "export-hf": ["export-hf", run, tmp_path / "hf"], "lm-eval": []}[command]
    if command in ("export-hf", "lm-eval"):
        pytest.importorskip("transformers")
    if command == "lm-eval":
        from mc_task import write_local_task

        mine = Path(write_local_task(tmp_path / "my-tasks")).parent
        argv = ["lm-eval", run, "--tasks", "keel_tiny_mc", "--include-path", mine, "--limit", "2", "--device", "cpu"]
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    assert not marker.exists()


def test_a_wildcard_task_name_is_refused_before_the_harness_reads_it_as_a_path(run, tmp_path, monkeypatch, capsys):
    """The harness matches `hellaswa?` against its task names, then loads the spec as a file path when no task has
    that exact name: a file called `hellaswa?` in the current directory. A name is one task, no pattern."""
    pytest.importorskip("lm_eval")
    marker = tmp_path / "ran"
    monkeypatch.chdir(tmp_path)
    plant_task(tmp_path, marker, file_name="hellaswa?")
    edit(run, run__eval_tasks=["lm_eval:hellaswa?"])
    config = (run / "config.yaml").read_bytes()
    assert "wildcards" in refused(capsys, "run.eval_tasks", "train", f"resume={run}", *RESUME)
    assert "wildcards" in refused(capsys, "run.eval_tasks", "train", "--preset", "tiny",
                                  "run.eval_tasks=lm_eval:hellaswa?", f"run.out_dir={tmp_path / 'runs'}")
    assert not marker.exists()
    unchanged(run, config)


def test_a_task_file_that_is_a_fifo_is_one_line_not_a_hang(tmp_path, capsys):
    """A config naming a FIFO as its task file hung every command that loaded it (`keel runs` included)."""
    pytest.importorskip("lm_eval")
    fifo = tmp_path / "task.yaml"
    os.mkfifo(fifo)
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("reading the task file hung"))
    signal.alarm(30)
    try:
        line = refused(capsys, "run.eval_tasks", "train", "--preset", "tiny", f"run.eval_tasks=lm_eval:{fifo}",
                       f"run.out_dir={tmp_path / 'runs'}")
    finally:
        signal.alarm(0)
    assert "not a regular file" in line


# ---- data.tokenizer: a value that only starts like a built-in one is a path ----------------------------------
@pytest.mark.parametrize("value", ["bytes.json", "bpe-vocab.json", "bpe/tokenizer.json", "bytes/../tok.json"])
def test_a_tokenizer_path_that_starts_like_a_builtin_is_checked(run, tmp_path, monkeypatch, value, capsys):
    """`bytes...` and `bpe...` skipped the trust check and were read relative to the current directory. The
    planted file is a FIFO: read, it would be refused as one ("not a regular file"), not as lying outside."""
    monkeypatch.chdir(tmp_path)
    planted = tmp_path / value
    planted.parent.mkdir(parents=True, exist_ok=True)  # `bytes/` too, so that `bytes/../tok.json` opens
    os.mkfifo(planted.resolve())
    edit(run, data__tokenizer=value)
    config = (run / "config.yaml").read_bytes()
    line = refused(capsys, "data.tokenizer", "train", f"resume={run}", *RESUME)
    assert "outside the run directory" in line
    unchanged(run, config)


def test_builtin_tokenizers_are_exactly_the_loaders_specs(tmp_path):
    from keel.data.corpus import DataConfig
    from keel.data.tokenizer import DEFAULT_BPE_VOCAB, planned_vocab_size
    from keel.errors import DataError

    (tmp_path / "config.yaml").write_text("{}\n")  # not signed for this user: its paths are not followed
    for spec, vocab in (("bytes", 256), ("bpe", DEFAULT_BPE_VOCAB), ("bpe:512", 512)):
        trust.check_data_paths(tmp_path, DataConfig(tokenizer=spec))  # never read as a path
        assert planned_vocab_size(spec) == vocab
    for spec in ("bytes.json", "bpe-vocab.json", "bpe/tokenizer.json", "bytesx"):
        with pytest.raises(DataError, match="data.tokenizer=" + spec):
            trust.check_data_paths(tmp_path, DataConfig(tokenizer=spec))


# ---- run.log_to: a closed list of trackers, never a module the config names ----------------------------------
def test_a_tracker_the_config_names_is_never_imported(run, tmp_path, monkeypatch, capsys):
    marker = tmp_path / "ran"
    module = plant_module(tmp_path, marker)
    shutil.copy(tmp_path / f"{module}.py", run / f"{module}.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # importable, were anything to import it
    edit(run, run__log_to=[module])
    config = (run / "config.yaml").read_bytes()
    refused(capsys, "run.log_to", "train", f"resume={run}", *RESUME)
    assert not marker.exists()
    unchanged(run, config)


# ---- resume=latest: a link among the runs is not followed ---------------------------------------------------
def test_resume_latest_does_not_follow_a_link_to_a_run_elsewhere(trained, tmp_path, capsys):
    runs = tmp_path / "runs"
    victim(trained, tmp_path)  # runs/victim: a run of the user's own
    elsewhere = victim(trained, tmp_path / "elsewhere")
    (runs / "zz-link").symlink_to(elsewhere, target_is_directory=True)
    later = (runs / "victim" / "metrics.jsonl").stat().st_mtime + 60  # the link's run is the latest
    os.utime(elsewhere / "metrics.jsonl", (later, later))
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir() if p.is_file()}
    line = refused(capsys, "symbolic link", "train", "resume=latest", f"run.out_dir={runs}", *RESUME)
    assert "zz-link" in line
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in (elsewhere / "checkpoints").iterdir()) == ["step_00000002"]
