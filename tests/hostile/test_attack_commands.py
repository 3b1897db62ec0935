"""Every `keel` command under hostile values, as a careless or hostile user would type them: each number of every
config field and every numeric flag (found by walking the dataclasses and the argument parser, not read from the
table under test) as NaN, an infinity, negative or huge; every output a command writes outside a run directory
planted with a link, a file, a device, /proc or a read-only directory; and input files that are not UTF-8, empty,
a directory, a FIFO or a device. Each case must answer with exit 2 and one `keel: error:` line naming the field,
flag or file, no traceback, within a time bound, and leave every file under the test's directory as it was (by
type, size, bytes' hash and link target).

In process (`keel.cli.main`) where it can; the one case that must not block (a FIFO) has a thread's time bound."""

from __future__ import annotations

import argparse
import errno
import hashlib
import os
import re
import threading
import time
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from keel.cli import build_parser, main
from keel.cli.support import flag_limits
from keel.config import TrainConfig
from keel.config.schema import LIMITS, Limit, count
from keel.model.architecture import FLOAT_LIMITS, SIZE_LIMITS
from keel.model.schemes import SCHEMES

ROOT = Path(__file__).resolve().parents[2]
SECONDS = 10  # no refusal may take longer
SLOW = lambda value: pytest.param(value, marks=pytest.mark.slow)  # noqa: E731 (imports torch or transformers: seconds)
HOSTILE_NUMBERS = ["nan", "inf", "-inf", "-1", "1e308", str(10**20)]


# ---- what every case must leave alone ------------------------------------------------------------------
def snapshot(root: Path) -> dict:
    """Every entry under `root`: type, size, a hash of its bytes (regular files), link target."""
    seen = {}
    for here, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(here) / name
            st = path.lstat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() and not path.is_symlink() else None
            seen[str(path.relative_to(root))] = (st.st_mode, st.st_size, digest,
                                                 os.readlink(path) if path.is_symlink() else None)
    return seen


def refused(argv: list[str], capsys, needle: str, root: Path) -> str:
    """Run `keel argv`: exit 2, one `keel: error:` line holding `needle`, no traceback, under SECONDS, and
    nothing under `root` changed. Returns the line."""
    before = snapshot(root)
    start = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own refusals (an int flag given "nan") exit from the parser
        code = stop.code
    took = time.monotonic() - start
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2, (argv, code, captured.err[-2000:])
    assert len(err) == 1 and err[0].startswith("keel: error: "), (argv, err)
    assert needle.lower() in err[0].lower(), (argv, needle, err[0])
    assert "Traceback" not in captured.err + captured.out
    assert took < SECONDS, (argv, took)
    assert snapshot(root) == before, argv
    return err[0]


# ---- every config field, from the dataclasses ------------------------------------------------------------
def numeric_fields() -> list[str]:
    out, config = [], TrainConfig()
    for section in fields(config):
        part = getattr(config, section.name)
        if not is_dataclass(part):
            continue
        for f in fields(part):
            kind = str(f.type)
            if ("int" in kind or "float" in kind) and "bool" not in kind:
                out.append(f"{section.name}.{f.name}")
    return out


def limits() -> dict[str, str]:
    """{field: its allowed values, as an error states them} for every number a config holds: ModelConfig's sizes
    and floats, then LIMITS."""
    model = {f"model.{k}": count(1, v).allowed() for k, v in SIZE_LIMITS.items()}
    model |= {f"model.{k}": Limit(0, v, open_low=True).allowed() for k, v in FLOAT_LIMITS.items()}
    model |= {"model.dropout": Limit(0, 1, open_high=True).allowed(), "model.loop_blocks": "a divisor of n_blocks",
              "model.alpha": f'"L", "sqrtL", or {Limit(0, SCHEMES["keel"].max_alpha, open_low=True).allowed()}',
              "model.mix_ln_fraction": Limit(0, 1).allowed()}
    return model | {name: limit.allowed() for name, limit in LIMITS.items()}


def test_every_numeric_field_has_a_documented_range():
    """The range table covers every int and float field the dataclasses declare, and docs/training.md's table is
    that table, row for row, with every flag's."""
    assert set(numeric_fields()) <= set(limits()), set(numeric_fields()) - set(limits())
    text = (ROOT / "docs" / "training.md").read_text()
    section = text.split("## Allowed values", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(?:keel )?([^`]+)` \| (.+) \|$", section, re.M))
    expected = limits() | {k: v.allowed() for k, v in flag_limits().items()}
    assert {k: rows.get(k) for k in expected} == expected
    assert set(rows) - set(expected) == {"bench --depths"}


# each field with NaN, a negative and a huge integer in the fast tier, and with the infinities and a huge float in
# the slow one (about 25 ms a refusal, a config merge each: 7.7 CPU s for all six in the fast tier)
FAST_NUMBERS = ("nan", "-1", str(10**20))


@pytest.mark.parametrize("values", [pytest.param(FAST_NUMBERS, id="fast"),
                                    pytest.param(tuple(v for v in HOSTILE_NUMBERS if v not in FAST_NUMBERS),
                                                 id="rest", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", numeric_fields())
def test_every_config_number_out_of_range_is_one_line(name, values, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a run directory made by mistake would appear here
    leaf = name.split(".")[1]
    for value in values:
        refused(["train", "--print-config", f"run.out_dir={tmp_path / 'runs'}", f"{name}={value}"], capsys, leaf,
                tmp_path)


@pytest.mark.parametrize("name", ["optim.lr", "model.rope_theta", "guard.spike_factor", "data.val_fraction"])
def test_a_config_file_sets_the_same_ranges(name, tmp_path, capsys):
    section, leaf = name.split(".")
    (tmp_path / "c.yaml").write_text(f"{section}:\n  {leaf}: .nan\n")
    refused(["train", "--print-config", "--config", str(tmp_path / "c.yaml")], capsys, leaf, tmp_path)


# ---- every numeric flag, from the argument parser ------------------------------------------------------------
def numeric_flags() -> list[str]:
    """"<command> --flag" for every option of every sub-command whose argparse type is int or float."""
    out = []

    def walk(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{prefix} {name}".strip())
            elif action.type in (int, float) and action.option_strings:
                out.append(f"{prefix} {action.option_strings[-1]}")
    walk(build_parser("all"), "")
    return out


def command_line(command: str, tmp: Path) -> list[str]:
    """The rest of a command line that would run: positionals and required options."""
    run = str(tmp / "run")
    return {"eval": ["eval", run], "generate": ["generate", run], "tokenizer": ["tokenizer", "--out",
            str(tmp / "tok.json")], "data prepare": ["data", "prepare", "--out", str(tmp / "shards")],
            "lm-eval": ["lm-eval", run, "--tasks", "hellaswag"], "bench": ["bench", "--preset", "tiny"]}[command]


def test_every_numeric_flag_has_a_documented_range():
    assert sorted(numeric_flags()) == sorted(flag_limits())


@pytest.mark.parametrize("key", numeric_flags())
def test_every_flag_out_of_range_is_one_line(key, tmp_path, capsys):
    command, flag = key.rsplit(" ", 1)
    for value in HOSTILE_NUMBERS:
        refused([*command_line(command, tmp_path), flag, value], capsys, flag, tmp_path)


@pytest.mark.parametrize("depths", ["nan", "inf", "-2", "1e308", str(10**20), "4,,8"])
def test_bench_depths_out_of_range_is_one_line(depths, tmp_path, capsys):
    refused(["bench", "--preset", "tiny", "--depths", depths], capsys, "--depths", tmp_path)


# ---- outputs: links, files, devices, /proc, read-only ----------------------------------------------------------
def read_only(monkeypatch, directory: Path) -> None:
    """Creating anything in `directory` fails as on a read-only file system (the tests may run as root, whom
    permissions do not stop)."""
    real_open, real_mkdir = os.open, os.mkdir

    def open_(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and Path(path).absolute().parent == directory:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    def mkdir_(path, *args, **kwargs):
        if Path(path).absolute().parent == directory:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "mkdir", mkdir_)


def plant(tmp: Path, kind: str) -> str:
    """An output path of `kind` under `tmp` (or a device), with a victim file outside it that must survive."""
    (tmp / "victim").mkdir()
    (tmp / "victim" / "keep.txt").write_text("keep")
    if kind == "link to a directory":
        (tmp / "out").symlink_to(tmp / "victim")
        return str(tmp / "out")
    if kind == "a file":
        (tmp / "out").write_text("a file, not a directory")
        return str(tmp / "out")
    if kind == "under a file":
        (tmp / "out").write_text("a file")
        return str(tmp / "out" / "below")
    if kind == "read-only":
        (tmp / "ro").mkdir()
        return str(tmp / "ro" / "out")
    return kind  # a device or /proc: /dev/null, /dev/full/x, /proc/self/x


OUTPUT_KINDS = {"link to a directory": "symbolic link", "a file": "not a directory",
                "under a file": "not a directory", "read-only": "Read-only file system",
                "/dev/null": "not a directory", "/dev/full/x": "not a directory", "/proc/self/x": "cannot"}


def study_file(tmp: Path) -> str:
    """A study kind's file: `--report-only` trains nothing even if --out were taken."""
    (tmp / "study").mkdir()
    (tmp / "study" / "study.yaml").write_text("study: frontier\nfields:\n  depths: [4]\n  schemes: [keel]\n")
    return str(tmp / "study" / "study.yaml")


def directory_commands(tmp: Path) -> dict:
    """Each command that writes a directory outside a run directory, as a function of its --out."""
    return {
        "bench": lambda out: ["bench", "--preset", "tiny", "--depths", "", "--out", out],
        "bench --model-gpu": lambda out: ["bench", "--preset", "tiny", "--model-gpu", "H100", "--out", out],
        "data prepare": lambda out: ["data", "prepare", "--out", out, f"data.source={tmp / 'victim' / 'keep.txt'}"],
        "experiment": lambda out: ["experiment", "frontier", "--quick", "--out", out],
        "sweep": lambda out: ["sweep", study_file(tmp), "--report-only", "--out", out],
        "export-hf": lambda out: ["export-hf", str(tmp / "no-run"), out],
    }


@pytest.mark.parametrize("kind", OUTPUT_KINDS)
@pytest.mark.parametrize("command", ["bench", "bench --model-gpu", "data prepare", SLOW("experiment"), "sweep",
                                     SLOW("export-hf")])
def test_an_output_directory_that_is_no_place_to_write_is_one_line(command, kind, tmp_path, capsys, monkeypatch):
    if command == "export-hf":
        pytest.importorskip("transformers")
    if command == "experiment":  # its studies are found from the checkout
        monkeypatch.chdir(ROOT)
    out = plant(tmp_path, kind)
    if kind == "read-only":
        read_only(monkeypatch, tmp_path / "ro")
    refused(directory_commands(tmp_path)[command](out), capsys, OUTPUT_KINDS[kind], tmp_path)


@pytest.mark.parametrize("kind,needle", [("link", "symbolic link"), ("directory", "is a directory"),
                                          ("/dev/null", "unknown format"), ("/dev/full/x.json", "no such directory"),
                                          ("/proc/self/x.json", "cannot write"), ("read-only", "Read-only"),
                                          ("no suffix", "unknown format")])
def test_a_tokenizer_output_that_is_no_place_to_write_is_one_line(kind, needle, tmp_path, capsys, monkeypatch):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "corpus.txt").write_text("def f(x):\n    return x\n" * 20)
    (tmp_path / "in" / "victim.json").write_text("{}")
    out = {"link": tmp_path / "tok.json", "directory": tmp_path / "dir.json", "read-only": tmp_path / "ro" / "t.json",
           "no suffix": tmp_path / "tok"}.get(kind, kind)
    if kind == "link":
        (tmp_path / "tok.json").symlink_to(tmp_path / "in" / "victim.json")
    elif kind == "directory":
        (tmp_path / "dir.json").mkdir()
    elif kind == "read-only":
        (tmp_path / "ro").mkdir()
        read_only(monkeypatch, tmp_path / "ro")
    refused(["tokenizer", "--vocab-size", "300", "--out", str(out), f"data.source={tmp_path / 'in' / 'corpus.txt'}"],
            capsys, needle, tmp_path)


def test_a_points_link_planted_in_a_study_output_is_refused(tmp_path, capsys, monkeypatch):
    """A `points` link in the output directory would have every point written through it."""
    from keel.experiments.sweep import Sweep

    (tmp_path / "out").mkdir()
    (tmp_path / "victim").mkdir()
    (tmp_path / "out" / "points").symlink_to(tmp_path / "victim")
    before = snapshot(tmp_path)
    sweep = Sweep.__new__(Sweep)
    sweep.out = tmp_path / "out"
    with pytest.raises(Exception, match="symbolic link"):
        Sweep.run(sweep, {}, "nothing")
    assert snapshot(tmp_path) == before


def test_experiment_reports_and_plots_never_go_through_a_planted_link(tmp_path):
    """results.json, report.md and a plot, each planted as a link to a file outside: refused, the outside
    files' bytes unchanged; written whole once the links are gone."""
    from keel.errors import DataError
    from keel.experiments.common import pyplot, save, write_outputs

    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("keep")
    for name in ("results.json", "report.md", "plot.png"):
        (out / name).symlink_to(victim)
        with pytest.raises(DataError, match="symbolic link"):
            if name == "plot.png":
                save(pyplot().figure(), out, name)
            else:
                write_outputs(out, "x", TrainConfig().run, "keel x", {}, "| a |", [])
        assert victim.read_text() == "keep"
        (out / name).unlink()
    write_outputs(out, "x", TrainConfig().run, "keel x", {}, "| a |", [])
    save(pyplot().figure(), out, "plot.png")
    assert {p.name for p in out.iterdir()} == {"results.json", "report.md", "plot.png"}
    assert (out / "plot.png").read_bytes().startswith(b"\x89PNG")


# ---- input files that are not what they should be ----------------------------------------------------------
def bad_file(tmp: Path, kind: str) -> str:
    path = tmp / "in" / f"{kind.replace(' ', '-')}.yaml"
    path.parent.mkdir(exist_ok=True)
    if kind == "not UTF-8":
        path.write_bytes(b"\xff\xfe\x00run: {steps: 3}\n")
    elif kind == "a list":
        path.write_text("- 1\n- 2\n")
    elif kind == "a directory":
        path.mkdir()
    elif kind == "a FIFO":
        os.mkfifo(path)
    elif kind == "missing":
        pass
    else:
        return kind  # /dev/zero
    return str(path)


INPUT_KINDS = ["not UTF-8", "a list", "a directory", "a FIFO", "missing", "/dev/zero"]
CONFIG_COMMANDS = {"train": ["train", "--print-config"], "summary": ["summary"], "tokenizer": ["tokenizer"],
                   "data prepare": ["data", "prepare", "--out", "OUT"], "bench": ["bench", "--depths", ""],
                   "experiment": ["experiment", "frontier", "--quick", "--out", "OUT"]}


def within(seconds: float, work):
    """`work()`'s result, or a failure if it has not returned in `seconds` (a FIFO must never block)."""
    box = {}

    def target():
        try:
            box["result"] = work()
        except BaseException as err:  # noqa: BLE001 (an assertion or a traceback, raised again below)
            box["error"] = err
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["result"]


@pytest.mark.parametrize("kind", INPUT_KINDS)
@pytest.mark.parametrize("command", [SLOW(c) if c == "experiment" else c for c in CONFIG_COMMANDS])
def test_a_config_file_that_is_not_a_config_is_one_line(command, kind, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT if command == "experiment" else tmp_path)
    path = bad_file(tmp_path, kind)
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in CONFIG_COMMANDS[command]] + ["--config", path]
    within(SECONDS, lambda: refused(argv, capsys, f"config file {path}", tmp_path))


@pytest.mark.parametrize("kind", INPUT_KINDS + ["empty"])
def test_a_study_file_that_is_not_a_study_is_one_line(kind, tmp_path, capsys):
    if kind == "empty":
        (tmp_path / "in").mkdir()
        (tmp_path / "in" / "empty.yaml").write_text("")
        path = str(tmp_path / "in" / "empty.yaml")
    else:
        path = bad_file(tmp_path, kind)
    within(SECONDS, lambda: refused(["sweep", path, "--report-only", "--out", str(tmp_path / "out")], capsys,
                                    path, tmp_path))


@pytest.mark.parametrize("kind", ["a file", "a FIFO", "an empty directory", "a config that is not UTF-8",
                                  "a config that is a directory", "missing"])
@pytest.mark.parametrize("command", ["eval", "generate", "summary", "plot", SLOW("export-hf"), "train resume"])
def test_a_run_directory_that_is_not_one_is_one_line(command, kind, tmp_path, capsys):
    if command == "export-hf":
        pytest.importorskip("transformers")
    run = tmp_path / "run"
    if kind == "a file":
        run.write_text("not a run")
    elif kind == "a FIFO":
        os.mkfifo(run)
    elif kind != "missing":
        run.mkdir()
        if kind == "a config that is not UTF-8":
            (run / "config.yaml").write_bytes(b"\xff\xfe\x00model: {}\n")
        elif kind == "a config that is a directory":
            (run / "config.yaml").mkdir()
    argv = {"eval": ["eval", str(run)], "generate": ["generate", str(run)], "summary": ["summary", str(run)],
            "plot": ["plot", str(run), "--out", str(tmp_path / "p.png")],
            "export-hf": ["export-hf", str(run), str(tmp_path / "hf")],
            "train resume": ["train", f"resume={run}"]}[command]
    if command == "plot" and kind.startswith("a config"):
        # plot reads a run's metrics, not its config (runs of older versions plot too): it draws the named file
        before = snapshot(tmp_path)
        assert within(SECONDS, lambda: main(argv)) == 0
        assert set(snapshot(tmp_path)) - set(before) == {"p.png"} and "Traceback" not in capsys.readouterr().err
        return
    within(SECONDS, lambda: refused(argv, capsys, str(run), tmp_path))


# ---- the commands that read a directory someone else made: runs, import-hf, lm-eval ------------------------
def hostile_source(tmp: Path, kind: str) -> str:
    """A path that is not the directory the command expects."""
    path = tmp / "source"
    if kind == "a file":
        path.write_text("hi\n")
    elif kind == "a FIFO":
        os.mkfifo(path)
    elif kind == "an empty directory":
        path.mkdir()
    elif kind == "config.json not UTF-8":
        path.mkdir()
        (path / "config.json").write_bytes(b"\xff\xfe\x00")
    elif kind == "config.json a list":
        path.mkdir()
        (path / "config.json").write_text("[1, 2]")
    elif kind == "config.json a directory":
        (path / "config.json").mkdir(parents=True)
    return str(path)  # "missing": nothing there


SOURCE_KINDS = ["missing", "a file", "a FIFO", "an empty directory", "config.json not UTF-8", "config.json a list",
                "config.json a directory"]


@pytest.mark.parametrize("kind", ["missing", "a file", "a FIFO"])  # an empty directory holds no runs: a fine answer
def test_a_runs_directory_that_is_not_one_is_one_line(kind, tmp_path, capsys):
    refused(["runs", hostile_source(tmp_path, kind)], capsys, "source", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", SOURCE_KINDS)
def test_an_import_source_that_is_not_a_transformers_directory_is_one_line(kind, tmp_path, capsys):
    refused(["import-hf", hostile_source(tmp_path, kind), str(tmp_path / "out")], capsys, "config.json", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["under a file", "a link"])
def test_an_import_output_that_is_no_place_for_a_run_is_one_line(kind, tmp_path, capsys):
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text("{}")  # refused later than the output: the output is checked first
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "run" if kind == "under a file" else tmp_path / "link"
    if kind == "a link":
        (tmp_path / "elsewhere").mkdir()
        out.symlink_to(tmp_path / "elsewhere")
    refused(["import-hf", str(source), str(out)], capsys, "file" if kind == "under a file" else "link", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["missing", "a file", "a FIFO", "an empty directory"])
def test_an_lm_eval_target_that_is_no_model_is_one_line(kind, tmp_path, capsys):
    refused(["lm-eval", hostile_source(tmp_path, kind), "--tasks", "hellaswag"], capsys, "source", tmp_path)
