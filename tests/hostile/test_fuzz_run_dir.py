"""Property-based (issues 24 and 25): a run directory's files as anyone could leave them, command lines as anyone
could type them, and checkpoints whose content was changed and then re-checksummed. Every command exits 0 or 2
(one `keel: error:` line) within its time limit, never with a traceback, and a canary outside stays untouched."""

from __future__ import annotations

import json
import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from damage import rechecksum, tiny_run
from keel.cli import main

pytestmark = pytest.mark.slow

# derandomized: CI sees the same examples every run, so a failure is reproducible, not flaky
FUZZ = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                                   HealthCheck.too_slow])
STEPS = ("step_00000002", "step_00000004")
FILES = ["metrics.jsonl", "telemetry.jsonl", "summary.json", "run.json", "config.yaml", f"eval-{STEPS[1]}-val.json"]
KEYS = ["step", "loss", "val_loss", "lr", "grad_norm", "event", "reason", "final_val_loss", "diverged", "interrupted",
        "data", "kind", "model", "run", "scheme", "steps", "grad_norm", "stream_rms", "update_ratio", "tasks"]
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), inner, max_size=4), max_leaves=8)
SPECIAL = ["symlink", "fifo", "directory", "empty", "huge"]
CONTENT = st.one_of(st.binary(max_size=300), st.lists(JSON.map(json.dumps), max_size=4).map("\n".join).map(str.encode),
                    st.sampled_from(SPECIAL))


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """A tiny run of 4 steps: checkpoints at 2 and 4, telemetry, an evaluation result. Its curves.png is not drawn
    (a second or two of CPU): no fuzzed file is it, and the commands that draw (plot, resume) write it anew."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("keel.train.trainer.Trainer.draw_curves", lambda self, quiet=False: None)
        run = tiny_run(tmp_path_factory.mktemp("trained"), corpus, "run.steps=4", "run.ckpt_every=2",
                       "run.eval_every=2", "run.telemetry_every=2", evaluate=True)
    (run / ".lock").unlink()
    return run


@pytest.fixture(scope="module")
def canary(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("outside")
    (root / "canary.txt").write_text("precious\n")
    return root


def snapshot(root: Path) -> dict:
    return {p.relative_to(root): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(root.rglob("*"))}


@contextmanager
def time_limit(seconds: int):
    """Fail instead of hanging (a FIFO read would block forever)."""
    def hung(signum, frame):
        raise AssertionError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def keel(argv, capsys, seconds: int = 60) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `keel argv`; asserts the contract: 0 or 2, a 2 ends in one `keel: error:` line,
    no traceback. argparse's own errors (SystemExit) are one line."""
    parsed = ""
    with time_limit(seconds):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exit:  # argparse: --help (0) or a usage error (2)
            code, parsed = exit.code, capsys.readouterr().err
            assert code == 0 or len(parsed.strip().splitlines()) == 1, parsed
    out, err = capsys.readouterr()
    err = parsed + err
    assert code in (0, 2), err
    assert "Traceback" not in err
    if code == 2:  # never a silent refusal
        assert err.strip() and err.strip().splitlines()[-1].startswith("keel: error: "), err
    return code, out, err


def fresh(trained: Path, tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("ex") / "runs" / "victim"
    shutil.copytree(trained, copy)
    return copy


def put(path: Path, content, canary: Path) -> None:
    """Replace `path` by `content`: bytes, or one of SPECIAL."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    if content == "symlink":
        path.symlink_to(canary / "canary.txt")
    elif content == "fifo":
        os.mkfifo(path)
    elif content == "directory":
        path.mkdir()
        (path / "x").write_text("{}")
    elif content == "huge":  # sparse: no disk, but past every size cap
        with open(path, "wb") as f:
            f.truncate(300 << 20)
    else:
        path.write_bytes(b"" if content == "empty" else content)


def _run_files(trained, canary, tmp_path_factory, capsys, name, content, command):
    run = fresh(trained, tmp_path_factory)
    put(run / name, content, canary)
    before = snapshot(canary)
    argv = {"runs": ["runs", run.parent, "--json"], "summary": ["summary", run], "plot": ["plot", run],
            "eval": ["eval", run, "--batches", "1", "--device", "cpu"],
            "generate": ["generate", run, "--max-new-tokens", "3"],
            "export-hf": ["export-hf", run, run.parent.parent / "export"],
            "resume": ["train", f"resume={run}", "run.steps=5", "run.progress=false"]}[command]
    code, _, err = keel(argv, capsys)
    event(f"{command}: exit {code}")
    assert snapshot(canary) == before


@settings(max_examples=60, **FUZZ)
@given(name=st.sampled_from(FILES), content=CONTENT, command=st.sampled_from(["runs", "summary"]))
def test_fuzzed_run_files_runs_and_summary(trained, canary, tmp_path_factory, capsys, name, content, command):
    _run_files(trained, canary, tmp_path_factory, capsys, name, content, command)


@settings(max_examples=12, **FUZZ)
@given(name=st.sampled_from(FILES), content=CONTENT, command=st.sampled_from(["plot", "eval"]))
def test_fuzzed_run_files_plot_and_eval(trained, canary, tmp_path_factory, capsys, name, content, command):
    _run_files(trained, canary, tmp_path_factory, capsys, name, content, command)


@settings(max_examples=15, **FUZZ)  # seconds each on a busy CI machine
@given(name=st.sampled_from(FILES), content=CONTENT, command=st.sampled_from(["generate", "export-hf", "resume"]))
def test_fuzzed_run_files_generate_export_and_resume(trained, canary, tmp_path_factory, capsys, monkeypatch, name,
                                                     content, command):
    pytest.importorskip("transformers")
    monkeypatch.setattr("keel.train.trainer.Trainer.draw_curves", lambda self, quiet=False: None)  # seconds: untested
    _run_files(trained, canary, tmp_path_factory, capsys, name, content, command)


# ---- command lines ---------------------------------------------------------------------------------------
WORDS = st.one_of(
    st.sampled_from(["--json", "--help", "--dry-run", "--print-config", "--no-cache", "--raw", "--out", "--checkpoint",
                     "--split", "--batches", "--device", "--prompt", "--max-new-tokens", "--temperature", "--top-k",
                     "--top-p", "--seed", "--vocab-size", "--preset", "--config", "train", "val", "cpu", "tiny",
                     "nope", "-1", "0", "1", "3", str(2**80), "nan", "inf", "-inf", "1e400", "", "=", "run.steps=2",
                     "model.n_blocks=x", "source=/nonexistent", "/dev/zero", "/nonexistent/x.png", "x.xyz", "--"]),
    st.integers(-2**70, 2**70).map(str),
    # control characters and line separators too (an error line shows them escaped); no NUL, which no command
    # line can hold, and no lone surrogates
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=8))
COMMANDS = ["runs", "summary", "train", "plot", "eval", "generate", "tokenizer", "export-hf", "nope"]


@settings(max_examples=150, **FUZZ)
@given(command=st.sampled_from(COMMANDS), words=st.lists(WORDS, max_size=6), place=st.sampled_from(["none", "run",
                                                                                                     "empty", "file"]))
def test_fuzzed_command_lines_are_one_line_or_work(trained, tmp_path_factory, capsys, command, words, place):
    """Only commands and arguments that end fast: training is always --dry-run, and eval, generate, export-hf
    and tokenizer never get a run or corpus they could work on for long."""
    root = tmp_path_factory.mktemp("argv")
    (root / "empty").mkdir()
    (root / "file").write_text("x")
    target = {"none": [], "run": [trained], "empty": [root / "empty"], "file": [root / "file"]}[place]
    if command in ("eval", "generate", "export-hf", "tokenizer") and place == "run":
        target = [root / "empty"]
    argv = [command, *target, *words]
    if command == "train":
        argv += ["--dry-run", f"run.out_dir={root / 'runs'}"]
    if command == "tokenizer":
        argv += ["source=/nonexistent"]
    config = (trained / "config.yaml").read_bytes()
    event(f"{command}: exit {keel(argv, capsys)[0]}")  # --hypothesis-show-statistics shows the spread
    assert (trained / "config.yaml").read_bytes() == config


# ---- checkpoints re-checksummed after a change -----------------------------------------------------------
VALUES = st.one_of(JSON, st.sampled_from(["tensor", "empty tensor", "int tensor", "delete"]))


def as_value(value, like):
    if value == "tensor":
        return torch.randn(3, 2)
    if value == "empty tensor":
        return torch.zeros(0, dtype=torch.uint8)
    if value == "int tensor":
        return torch.arange(5)
    return value


def mutate_state(ckpt: Path, where: str, value) -> None:
    state = torch.load(ckpt / "state.pt", weights_only=True)
    key = where.rsplit(".", 1)[-1]
    if where.startswith("optimizer."):  # one parameter's AdamW state, or the first group's settings
        entries = state["optimizer"]["state"]
        per_parameter = key in ("exp_avg", "exp_avg_sq", "step")
        container = entries[sorted(entries)[0]] if per_parameter else state["optimizer"]["param_groups"][0]
    else:
        container = state["sampler"] if where.startswith("sampler.") else state
    if value == "delete":
        container.pop(key, None)
    else:
        container[key] = as_value(value, container.get(key))
    torch.save(state, ckpt / "state.pt")


def mutate_weights(ckpt: Path, index: int, value) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(ckpt / "model.safetensors")
    name = sorted(weights)[index % len(weights)]
    if value == "delete":
        del weights[name]
    elif value in ("nan", "inf"):
        weights[name] = torch.full_like(weights[name], float(value))
    elif value == "shape":
        weights[name] = torch.zeros(weights[name].numel() + 1)
    else:
        weights[name] = weights[name].to(torch.float16 if value == "half" else torch.int64)
    save_file(weights, ckpt / "model.safetensors")


STATE_FIELDS = ["sampler.generator", "sampler.step", "torch_rng", "optimizer.exp_avg", "optimizer.exp_avg_sq",
                "optimizer.step", "optimizer.lr", "optimizer.betas", "optimizer.weight_decay", "optimizer.params",
                "optimizer.amsgrad", "optimizer.maximize", "optimizer.foreach", "sampler", "optimizer"]
META_FIELDS = ["step", "draws", "lr_scale", "rollbacks", "skip_draws", "guard", "world_size", "global_batch",
               "wall_seconds"]
MUTATION = st.one_of(
    st.tuples(st.just("meta"), st.sampled_from(META_FIELDS), st.one_of(JSON, st.just("delete"))),
    st.tuples(st.just("state"), st.sampled_from(STATE_FIELDS), VALUES),
    st.tuples(st.just("weights"), st.integers(0, 50), st.sampled_from(["nan", "inf", "shape", "half", "int",
                                                                        "delete"])))


def mutate(ckpt: Path, kind: str, where, value) -> None:
    if kind == "meta":
        meta = json.loads((ckpt / "meta.json").read_text())
        meta.pop(where, None) if value == "delete" else meta.update({where: value})
        (ckpt / "meta.json").write_text(json.dumps(meta))
    elif kind == "state":
        mutate_state(ckpt, where, value)
    else:
        mutate_weights(ckpt, where, value)
    rechecksum(ckpt)


def _checkpoint_case(trained, tmp_path_factory, capsys, mutation, argv):
    run = fresh(trained, tmp_path_factory)
    mutate(run / "checkpoints" / STEPS[1], *mutation)
    code, out, err = keel([a.replace("RUN", str(run)) for a in argv], capsys, seconds=120)
    event(f"{mutation[0]}: exit {code}{', fell back' if 'trying an older one' in err else ''}")
    if code == 2:
        assert STEPS[1] in err or "checkpoint" in err, err
    return code, out, err


@settings(max_examples=25, **FUZZ)
@given(mutation=MUTATION)
def test_fuzzed_checkpoint_content_in_eval(trained, tmp_path_factory, capsys, mutation):
    _checkpoint_case(trained, tmp_path_factory, capsys, mutation, ["eval", "RUN", "--batches", "1", "--device", "cpu"])


@settings(max_examples=6, **FUZZ)  # a resume is seconds on a busy CI machine
@given(mutation=MUTATION)
def test_fuzzed_checkpoint_content_on_resume_refuses_or_falls_back(trained, tmp_path_factory, capsys, monkeypatch,
                                                                   mutation):
    monkeypatch.setattr("keel.train.trainer.Trainer.draw_curves", lambda self, quiet=False: None)  # seconds: untested
    code, out, err = _checkpoint_case(trained, tmp_path_factory, capsys, mutation,
                                      ["train", "resume=RUN", "run.steps=5", "run.progress=false"])
    if code == 0 and "trying an older one" in err:
        assert f"from step 2 ({STEPS[0]})" in out  # fell back to the older checkpoint, and said so
