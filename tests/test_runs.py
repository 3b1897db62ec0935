"""Runs as a user handles them: listed, compared and plotted, their status (running, new, imported), the printed
config round-tripped and `resume=latest`; `keel eval`'s table or JSON (rank 0 only), the exported model card."""

import json
import math
import os

import pytest

from keel.cli import main
from keel.config import load_config
from keel.runs.run_dir import RunDir


@pytest.mark.slow
def test_two_runs_listed_compared_plotted_and_watched(args, tmp_path, capsys):
    common = ("run.steps=6", "run.telemetry_every=2", "run.eval_every=3", "run.log_every=1")
    assert main(["train", "--preset", "tiny", *args(*common, name="keel")]) == 0
    assert main(["train", "--preset", "tiny", *args(*common, "scheme=pre_ln", "run.curves=false", name="pre")]) == 0
    out = capsys.readouterr().out
    assert "final_val_loss" in out and "{" not in out  # an aligned summary, not raw JSON
    runs = tmp_path / "runs"
    assert (runs / "keel" / "curves.png").stat().st_size > 0  # drawn at the end of training
    assert not (runs / "pre" / "curves.png").exists() and out.count("keel: curves: ") == 1  # run.curves=false
    telemetry = RunDir(runs / "keel").telemetry()
    assert [t["step"] for t in telemetry] == [2, 4, 6]
    assert all(len(t["grad_norm"]) == 4 and len(t["update_ratio"]) == 4 for t in telemetry)
    assert all(math.isfinite(v) and v > 0 for t in telemetry for v in t["grad_norm"])

    assert main(["runs", str(runs)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["run", "scheme", "sub-layers"]
    assert any(line.split()[:2] == ["keel", "keel"] and "6/6" in line and "finished" in line for line in table)
    assert any(line.split()[:2] == ["pre", "pre_ln"] for line in table)
    assert main(["runs", str(runs), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["run"]: r["status"] for r in rows} == {"keel": "finished", "pre": "finished"}

    assert main(["plot", str(runs / "keel"), str(runs / "pre")]) == 0
    assert (runs / "compare-keel-pre.png").stat().st_size > 0


def test_run_status_running_then_new(args):
    from keel.train.trainer import Trainer

    trainer = Trainer(load_config(args("run.steps=2", name="busy"), preset="tiny"))
    assert RunDir(trainer.run_dir.path).status() == "running"  # another handle sees the lock
    trainer.run_dir.unlock()
    assert RunDir(trainer.run_dir.path).status() == "new"


@pytest.mark.slow
def test_print_config_round_trips_and_resume_latest(args, tmp_path, capsys, no_curves):
    assert main(["train", "--preset", "tiny", "--print-config", *args("run.steps=3", name="a")]) == 0
    text = capsys.readouterr().out
    (tmp_path / "printed.yaml").write_text(text)
    assert load_config([], str(tmp_path / "printed.yaml")) == load_config(args("run.steps=3", name="a"), preset="tiny")
    assert not (tmp_path / "runs").exists()
    assert main(["train", "--preset", "tiny", *args("run.steps=3", "run.eval_every=0", name="a")]) == 0
    assert main(["train", "--preset", "tiny", *args("run.steps=3", "run.eval_every=0", name="b")]) == 0
    os.utime(tmp_path / "runs" / "a" / "metrics.jsonl")  # a is now the most recently active
    capsys.readouterr()
    assert main(["train", "resume=latest", f"run.out_dir={tmp_path / 'runs'}", "run.steps=5", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("\n{") + 1:out.index("\n}") + 2])["steps"] == 5
    assert RunDir(tmp_path / "runs" / "a").summary()["steps"] == 5


def test_a_bpe_vocabulary_larger_than_the_model_is_refused_before_training_it(args, capsys, monkeypatch):
    import keel.data.tokenizer

    def no_training(*a, **k):
        raise AssertionError("the tokenizer was trained before the vocabulary was checked")
    monkeypatch.setattr(keel.data.tokenizer, "train_bpe", no_training)
    assert main(["train", "--preset", "tiny", *args("data.tokenizer=bpe:1024")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("keel: error: model.vocab_size: 256 is smaller than the 1024 tokens of data.tokenizer=bpe:1024; "
                   "set model.vocab_size=1024")


@pytest.mark.parametrize("name", ["first", ""])
def test_a_refused_start_leaves_no_folder_it_made_and_keeps_the_ones_it_found(name, tmp_path, capsys):
    out = tmp_path / "a" / "b" / "runs"  # none of these exist: the refused start made them and removes them
    argv = ["train", "--preset", "tiny", f"data.source={tmp_path / 'no-such-corpus.txt'}", f"run.out_dir={out}",
            *([f"run.name={name}"] if name else [])]  # unnamed: a name from the clock
    assert main(argv) == 2
    assert "no such file" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    (out / "earlier").mkdir(parents=True)  # a folder that holds another run stays, and so does the run
    assert main(argv) == 2
    assert [p.name for p in out.iterdir()] == ["earlier"]


def test_eval_prints_a_table_or_json(tmp_path, capsys, make_run, corpus):
    make_run(tmp_path / "run")
    config = (tmp_path / "run" / "config.yaml").read_text()
    (tmp_path / "run" / "config.yaml").write_text(config.replace("source: stdlib", f"source: {corpus}"))
    from keel.runs import trust

    trust.sign(tmp_path / "run")  # edited by its own user: trusted again (keel.runs.trust)
    assert main(["eval", str(tmp_path / "run"), "--batches", "1"]) == 0
    text = capsys.readouterr().out
    assert "val_loss" in text and "{" not in text
    assert main(["eval", str(tmp_path / "run"), "--batches", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["val_tokens"] > 0


def test_export_model_card_states_effective_options_and_no_local_paths(tmp_path, make_run):
    pytest.importorskip("transformers")
    from keel.hf.export import export_run

    make_run(tmp_path / "run")  # keel with alpha and first_layer left to their defaults (None in the config)
    out = export_run(tmp_path / "run", tmp_path / "hf")
    card = (out / "README.md").read_text()
    # the same words as `keel summary` (ModelConfig.scheme_options_shown): 6 sub-layers, alpha = L = 6
    assert "| scheme options | alpha = L = 6 (default), first_layer = v2 (default) |" in card and "None" not in card
    assert str(tmp_path) not in card
    assert oct((out / "model.safetensors").stat().st_mode & 0o777) == oct(0o644)


@pytest.mark.slow
def test_a_quick_experiment_does_not_write_into_results(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["experiment", "redundancy", "--quick"]) == 0  # a study file: its data are in its file
    assert (tmp_path / "runs" / "quick" / "redundancy" / "results.json").is_file()
    assert not (tmp_path / "results").exists()


@pytest.mark.slow  # over a CPU second in the fast tier
def test_an_imported_run_is_listed_as_imported_and_never_resumed_as_latest(trained_run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from keel.data.tokenizer import train_bpe

    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    train_bpe(["def f(x):\n    return x + 1\n" * 50], 300, tmp_path / "llama" / "tokenizer.json")
    runs = tmp_path / "runs"
    runs.mkdir()
    import shutil

    shutil.copytree(trained_run, runs / "trained")
    assert main(["import-hf", str(tmp_path / "llama"), str(runs / "imported")]) == 0
    capsys.readouterr()
    assert main(["runs", str(runs), "--json"]) == 0
    status = {row["run"]: row["status"] for row in json.loads(capsys.readouterr().out)}
    assert status == {"trained": "finished", "imported": "imported"}

    from keel.runs.run_dir import latest_run

    assert latest_run(runs).name == "trained"  # the imported run is the newest, yet not a run to continue


def test_eval_json_is_printed_by_rank_0_only(trained_run, tmp_path, capsys, monkeypatch):
    """Under torchrun every rank runs `keel eval`; only rank 0 prints (one JSON document in the output). The rank
    is keel.scale.distributed.current()'s answer (torchrun's RANK and WORLD_SIZE would start a process group)."""
    import shutil

    from keel.scale import distributed

    run = shutil.copytree(trained_run, tmp_path / "run")  # eval writes its eval-*.json into the run
    for rank, printed in ((1, False), (0, True)):
        monkeypatch.setattr(distributed, "current", lambda rank=rank: distributed.World(rank, 2))
        assert main(["eval", str(run), "--json", "--batches", "1"]) == 0
        out = capsys.readouterr().out
        assert bool(out.strip()) == printed, (rank, out)
        if printed:
            assert json.loads(out)["val_loss"] > 0
