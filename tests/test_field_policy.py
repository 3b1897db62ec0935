"""Which fields each command reads (keel.config.reads.Reads), enforced inside the one merge: a YAML file and
key=value overrides are accepted or refused alike, with the same one line, for every command; run.threads is
applied once, from the merged config; a scheme's options follow it (with_scheme) and read the same everywhere."""

from __future__ import annotations

import math

import pytest
import yaml

from keel import runtime
from keel.cli import main
from keel.cli.experiment import build
from keel.errors import ConfigError
from keel.model.architecture import ModelConfig, with_scheme
from keel.model.schemes import SCHEMES


class Merged(Exception):
    """Raised where a command, its config merged, would start its work: the threads it applies."""


# the commands that read no run.threads: the dispatcher sets the default threads for them, before the merge
DEFAULT_THREADS = ("summary", "summary-run", "tokenizer")


@pytest.fixture
def stop_after_merge(monkeypatch):
    """train, resume, bench and experiments apply run.threads right after their merge: stop them there; the
    tokenizer is stopped where it would read its corpus. summary runs for real (it only describes)."""
    import keel.data

    def set_threads(n=0):
        if not stop_after_merge.default_threads:
            raise Merged(n)
        return 1

    def build_corpus(data):
        raise Merged(data)
    stop_after_merge.default_threads = False
    monkeypatch.setattr(runtime, "set_threads", set_threads)
    monkeypatch.setattr(keel.data, "build_corpus", build_corpus)
    return stop_after_merge


@pytest.fixture
def run_dir(tmp_path_factory, make_run):
    path = tmp_path_factory.mktemp("runs") / "run"
    make_run(path)  # n_blocks=3, run.seq_len=32
    return path


# command -> its argv before the settings; RUN stands for a run directory
COMMANDS = {
    "train": ["train", "--preset", "tiny"],
    "resume": ["train", "resume=RUN"],
    "summary": ["summary", "--preset", "tiny"],
    "summary-run": ["summary", "RUN"],
    "tokenizer": ["tokenizer", "--out", "TMP/tok.json"],
    "bench": ["bench", "--preset", "tiny", "--depths", ""],
    "bench-model-gpu": ["bench", "--preset", "tiny", "--model-gpu", "H100"],
    "experiment": ["experiment", "frontier"],
    "experiment-pilot": ["experiment", "depth-pilot"],
    "experiment-ablations": ["experiment", "ablations"],
}

# (command, settings, the one error line, or None for accepted). The settings go in as overrides and as YAML.
CASES = [
    ("train", {"run.steps": 7}, None),
    ("train", {"run.threads": 1}, None),
    ("train", {"data.source": "stdlib"}, None),
    ("resume", {"run.steps": 9}, None),
    ("resume", {"run.threads": 1}, None),
    ("resume", {"model.n_blocks": 3}, None),  # the run's own value: a run's whole YAML file may be given again
    ("resume", {"model.n_blocks": 4}, "resume: model.n_blocks=4 differs from the run's config (3); "
                                      "a resumed run must keep it"),
    ("summary", {"model.n_blocks": 3}, None),
    ("summary", {"run.steps": 5}, "run.steps: not used by keel summary (it describes the model: model.* fields only)"),
    ("summary", {"run.threads": 1}, "run.threads: not used by keel summary (it describes the model: model.* fields "
                                    "only)"),
    ("summary-run", {"model.n_blocks": 4}, "model.n_blocks: not used by keel summary (it describes the run's model "
                                           "as it was trained)"),
    ("tokenizer", {"data.source": "stdlib"}, None),
    ("tokenizer", {"run.steps": 3}, "run.steps: not used by keel tokenizer (it trains a tokenizer on the corpus: "
                                    "data.* fields only)"),
    ("tokenizer", {"model.d_model": 64}, "model.d_model: not used by keel tokenizer (it trains a tokenizer on the "
                                         "corpus: data.* fields only)"),
    ("bench", {"run.seq_len": 16}, None),
    ("bench", {"run.threads": 1}, None),
    ("bench", {"optim.lr": 0.01}, None),
    ("bench", {"model.scheme": "pre_ln"}, None),  # one of --schemes: its options apply
    ("bench", {"model.scheme": "deepnorm"}, "model.scheme: not used by keel bench (the schemes compared are "
                                            "--schemes; name it there too)"),
    ("bench", {"run.steps": 5}, "run.steps: not used by keel bench (timed steps are --steps)"),
    ("bench", {"data.source": "x"}, "data.source: not used by keel bench (bench trains on synthetic batches)"),
    ("bench", {"optim.warmup_steps": 3}, "optim.warmup_steps: not used by keel bench (bench steps at the constant "
                                         "rate optim.lr)"),
    ("bench-model-gpu", {"run.seq_len": 32}, None),
    ("bench-model-gpu", {"model.scheme": "pre_ln"}, "model.scheme: not used by keel bench (the model predicts both "
                                                    "keel and pre_ln)"),
    ("bench-model-gpu", {"optim.lr": 0.1}, "optim.lr: not used by keel bench (it reads model.* and "
                                           "run.{batch_size,seq_len,dtype,ac_every})"),
    ("experiment", {"run.steps": 5}, None),
    ("experiment", {"run.threads": 1}, None),  # accepted, and applied (below): not only recorded
    ("experiment", {"model.d_model": 32}, None),
    ("experiment", {"model.alpha": "sqrtL"}, None),  # the Keel arms take it
    ("experiment", {"schemes": ["pre_ln", "post_ln"], "model.alpha": "sqrtL"},
     "frontier: model.alpha: not used here (an option of keel; the arms here are post_ln, pre_ln)"),
    ("experiment", {"model.n_blocks": 4}, "frontier: model.n_blocks: not used here (set per point from depths)"),
    ("experiment", {"run.name": "x"}, "frontier: run.name: not used here (a sweep point writes no run directory of "
                                      "its own)"),
    ("experiment-pilot", {"run.steps": 5}, "depth-pilot: run.steps: not used here (the study's fields are in its "
                                           "file, results/depth-pilot/study.yaml: copy it and run keel sweep on the "
                                           "copy)"),
    ("experiment-ablations", {"model.alpha": 2}, "ablations: model.alpha: not used here (the study's fields are in "
                                                 "its file, results/ablations/study.yaml: copy it and run keel sweep "
                                                 "on the copy)"),
]


def _argv(command, run_dir, tmp_path):
    return [str(run_dir) if a == "RUN" else f"resume={run_dir}" if a == "resume=RUN"
            else a.replace("TMP", str(tmp_path)) for a in COMMANDS[command]]


def _outcome(argv, capsys):
    """('accepted', threads applied or None) or ('refused', the error line)."""
    try:
        code = main(argv)
    except Merged as merged:
        return "accepted", merged.args[0] if isinstance(merged.args[0], int) else None
    err = capsys.readouterr().err.strip()
    if code == 0:
        return "accepted", None
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    return "refused", err.removeprefix("keel: error: ")


def _override(key, value):
    return f"{key}=[{','.join(value)}]" if isinstance(value, list) else f"{key}={value}"


def _yaml(settings) -> str:
    tree: dict = {}
    for key, value in settings.items():
        *sections, leaf = key.split(".")
        node = tree
        for s in sections:
            node = node.setdefault(s, {})
        node[leaf] = value
    return yaml.safe_dump(tree)


@pytest.mark.parametrize("command, settings, refused", CASES,
                         ids=[f"{c}-{'-'.join(s)}" + ("-refused" if r else "") for c, s, r in CASES])
def test_a_file_and_an_override_are_accepted_or_refused_alike(command, settings, refused, run_dir, tmp_path,
                                                              stop_after_merge, capsys):
    stop_after_merge.default_threads = command in DEFAULT_THREADS
    argv = _argv(command, run_dir, tmp_path)
    by_override = _outcome([*argv, *(_override(k, v) for k, v in settings.items())], capsys)
    (tmp_path / "c.yaml").write_text(_yaml(settings))
    by_file = _outcome([*argv, "--config", str(tmp_path / "c.yaml")], capsys)
    assert by_override == by_file
    assert by_override[0] == ("refused" if refused else "accepted")
    if refused:
        assert by_override[1] == refused
    elif "run.threads" in settings and by_override[1] is not None:  # applied from the merged config, either way
        assert by_override[1] == settings["run.threads"]


@pytest.mark.parametrize("command", ["train", "experiment", "bench"])  # the CPU suite's: test_cpu_suite.py
def test_run_threads_reaches_set_threads_once_from_the_merged_config(command, run_dir, tmp_path, monkeypatch):
    """From a YAML file as from an override, the command applies run.threads once, with the merged value (the
    dispatcher no longer reads it from the raw strings first)."""
    calls = []

    def set_threads(n=0):
        calls.append(n)
        raise Merged(n)
    monkeypatch.setattr(runtime, "set_threads", set_threads)
    (tmp_path / "c.yaml").write_text("run:\n  threads: 3\n")
    for extra in (["run.threads=3"], ["--config", str(tmp_path / "c.yaml")]):
        calls.clear()
        with pytest.raises(Merged):
            main([*_argv(command, run_dir, tmp_path), *extra])
        assert calls == [3]


def test_a_preset_is_refused_where_a_runs_own_config_is_used(run_dir, capsys, stop_after_merge):
    stop_after_merge.default_threads = True  # summary's default threads; the others refuse before any
    assert main(["train", "--preset", "paper-64", f"resume={run_dir}"]) == 2
    assert capsys.readouterr().err == ("keel: error: --preset: not used with resume= (a resumed run continues with "
                                       "its own config)\n")
    assert main(["summary", str(run_dir), "--preset", "tiny"]) == 2
    assert "--preset: not used" in capsys.readouterr().err


def test_the_tokenizer_takes_keel_trains_data_spelling(tmp_path, stop_after_merge):
    stop_after_merge.default_threads = True
    for spelling in ("data.source=corpus.txt", "source=corpus.txt"):  # the bare field means its one section
        with pytest.raises(Merged) as merged:
            main(["tokenizer", "--out", str(tmp_path / "t.json"), spelling, "data.val_fraction=0.1"])
        assert merged.value.args[0].source == "corpus.txt" and merged.value.args[0].val_fraction == 0.1


def test_experiment_help_shows_only_spellings_the_merge_accepts(capsys):
    """Every key=value in `keel experiment --help` builds (the old `steps=` and `shape.*` did not)."""
    with pytest.raises(SystemExit):
        main(["experiment", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    examples = [w.rstrip(".;,") for w in text.split("e.g. ", 1)[1].split(";")[0].split()]
    assert len(examples) >= 4 and all("=" in e for e in examples), examples
    build("frontier", False, examples)  # a study with the fields the help names (depths, schemes)
    with pytest.raises(ConfigError, match="did you mean run.steps"):
        build("frontier", False, ["steps=5"])


# ---- a scheme owns its options --------------------------------------------------------------------------
def test_alpha_applies_to_the_keel_arms_only():
    cfg = build("frontier", False, ["model.alpha=sqrtL", "depths=[16]"])
    arms = {s: cfg.point_model(s, 16) for s in cfg.schemes}
    assert arms["keel"].alpha == "sqrtL"
    assert all(m.alpha is None for s, m in arms.items() if s != "keel")  # else ModelConfig would refuse them
    from keel.model.transformer import build_scheme

    assert build_scheme(arms["keel"]).alpha == pytest.approx(math.sqrt(16))  # the paper's sqrt(L)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_with_scheme_keeps_exactly_the_options_the_scheme_reads(scheme):
    config = ModelConfig(scheme="keel", alpha=3.0, first_layer="v1")
    switched = with_scheme(config, scheme)
    expected = {"alpha": 3.0, "first_layer": "v1"} if scheme == "keel" else {}
    assert {k: v for k, v in switched.scheme_kwargs().items() if v is not None} == expected
    assert with_scheme(switched, "keel").alpha == (3.0 if scheme == "keel" else None)


@pytest.mark.parametrize("options, shown", [
    ({}, {"alpha": "L = 12 (default)", "first_layer": "v2 (default)"}),
    ({"alpha": "sqrtL"}, {"alpha": f"sqrtL = {math.sqrt(12):g}", "first_layer": "v2 (default)"}),
    ({"alpha": 2.5, "first_layer": "none"}, {"alpha": "2.5", "first_layer": "'none'"}),
])
def test_how_keel_options_read_written_out(options, shown):
    assert ModelConfig(n_blocks=6, **options).scheme_options_shown() == shown


def test_summary_and_the_model_card_print_the_same_option_text(capsys, tmp_path, make_run):
    """`keel summary` and the exported model card: the words come from one place (scheme_options_shown)."""
    pytest.importorskip("transformers")
    from keel.hf.export import export_run

    make_run(tmp_path / "run", alpha="sqrtL")  # 3 blocks: L = 6
    assert main(["summary", str(tmp_path / "run")]) == 0
    summary = capsys.readouterr().out
    card = (export_run(tmp_path / "run", tmp_path / "hf") / "README.md").read_text()
    text = f"sqrtL = {math.sqrt(6):g}"
    assert f"alpha = {text}" in summary and "first_layer = v2 (default)" in summary
    assert f"| scheme options | alpha = {text}, first_layer = v2 (default) |" in card
