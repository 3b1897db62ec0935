"""The experiments end to end: each --quick path (a study file's by name too) writes its results, plots and report;
sweeps refuse points of another configuration, add seeds, resume compiled after eager, and never write into the
committed results by default. (Measurements and verdicts: test_experiment_measures.py.)"""

import json
import math
from pathlib import Path

import pytest
import torch

from keel.cli.experiment import build, study_files
from keel.data import DataConfig
from keel.errors import ConfigError
from keel.experiments import store
from keel.experiments.budget import budget_point
from keel_studies import EXPERIMENTS

# tests/test_point_resume.py compiles at this size too: one set of compiled graphs, in Inductor's on-disk caches
TINY = ["model.d_model=16", "model.n_heads=2", "model.n_kv_heads=1", "run.seq_len=16", "run.batch_size=2"]
QUICK = {
    "gradflow": ["schemes=[post_ln,keel]", "depths=[4]", "run.steps=3"],
    "frontier": ["depths=[2,4]", "run.steps=3"],
    # one search value (a bound): the points are known before the run
    "downstream-end": ["run.steps=3", "run.eval_tasks=[brackets,indent]", "search_start=2", "search_max=1"],
    "depth-sweep": [],
    "equal-tuning": [],
}


@pytest.fixture(scope="module")
def corpus_cfg(tmp_path_factory):
    import argparse
    import inspect

    root = tmp_path_factory.mktemp("exp")
    (root / "text.txt").write_text(inspect.getsource(argparse) * 2)
    return [f"data.source={root / 'text.txt'}", f"data.cache_dir={root / 'cache'}"]


_S3, _K = ("post_ln", "pre_ln", "keel"), (0, 1)  # the quick configs' schemes and seeds where QUICK sets none
# The points each QUICK configuration must produce, written out from its settings (not from the code's loops)
QUICK_POINTS = {
    "gradflow": [f"{s}-4-{init}-seed{k}" for s in ("post_ln", "keel") for init in ("default", "matched") for k in _K],
    "frontier": [f"{s}-{d}-lr{lr}-seed{k}" for s, grid in (("post_ln", (0.001, 0.003)), ("keel", (0.003, 0.01)))
                 for d in (2, 4) for lr in grid for k in _K],  # every LR with every seed
    "downstream-end": [f"pre_ln-4-lr0.003-seed{k}" for k in _K]  # the reference, trained here
    + [f"keel-4-steps2-lr0.003-seed{k}" for k in (90, *_K)],  # the search's one value, then the final runs
    # every LR of the starting grid with every seed at each budget (an edge choice adds more)
    "depth-sweep": [f"{s}-{d}-lr{lr}-wu2-seed{k}" for s in ("keel", "pre_ln", "post_ln", "deepnorm") for d in (2, 4)
                    for lr in (0.003, 0.01) for k in _K],
    # every arm's starting LR grid at the base warm-up with every choosing seed, and Keel tuned's alpha 2 somewhere
    "equal-tuning": [f"{s}-{d}-lr{lr}-wu2-seed{k}" for s in ("keel", "pre_ln", "post_ln", "deepnorm") for d in (2, 4)
                     for lr in (0.003, 0.01) for k in _K],
}


def numbers(tree, where=""):
    """(where, value) for every number in a JSON tree."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from numbers(value, f"{where}.{key}")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from numbers(value, f"{where}[{i}]")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield where, tree


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_quick_experiment_writes_results_plots_and_report(name, corpus_cfg, tmp_path, monkeypatch):
    from matplotlib.image import imread

    cfg = build(name, True, [*TINY, *QUICK[name], *corpus_cfg])
    assert isinstance(cfg.data, DataConfig)
    out = tmp_path / name
    out.mkdir()
    EXPERIMENTS[name][1](cfg, out, f"keel experiment {name} --quick")
    results = store.read_results(out)
    assert results["experiment"] == name and results["machine"]["torch_version"]
    # every configured point is in results.json, and so is every point the sweep kept on disk
    points = results["results"]["points"]
    assert set(QUICK_POINTS[name]) <= set(points), sorted(set(QUICK_POINTS[name]) - set(points))
    assert set(points) == set(store.keys(out / "points"))
    for key, point in points.items():  # each is its point file less any per-step losses, which only the file has
        saved = store.load(out / "points", key)
        series = {"losses", "train_losses"} & set(saved)
        assert point == {f: v for f, v in saved.items() if f not in series}, key
    found = list(numbers(results["results"]))
    assert len(found) > 10 * len(points) and [(w, v) for w, v in found if not math.isfinite(v)] == []
    report = (out / "report.md").read_text()
    assert f"keel experiment {name} --quick" in report and "|---" in report
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs and all(f"![{p}]({p})" in report for p in pngs)
    for png in pngs:  # a PNG that decodes to an image with something drawn on it, not one flat colour
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = imread(out / png)
        assert min(image.shape[:2]) > 100 and image[..., :3].std() > 0.01, png
    # a second run reuses every finished point instead of training again; what it checks is the points' files,
    # so its figures are built from the points but not laid out or rendered again (the first run's PNGs are checked
    # above): most of the second run's CPU seconds
    points = {p.name: p.stat().st_mtime_ns for p in (out / "points").glob("*.json.gz")}
    from matplotlib.figure import Figure

    monkeypatch.setattr(Figure, "tight_layout", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: None)
    EXPERIMENTS[name][1](cfg, out, f"keel experiment {name} --quick")
    assert {p.name: p.stat().st_mtime_ns for p in (out / "points").glob("*.json.gz")} == points


STUDY_FILES = sorted(study_files())


@pytest.mark.slow
@pytest.mark.parametrize("name", STUDY_FILES)
def test_a_study_file_runs_by_name_at_its_smoke_test_size(name, tmp_path, monkeypatch, capsys):
    """`keel experiment NAME --quick` for a study written as a study file: its arms, cells and grids at the smoke-test
    size (every point 2 blocks at d=32 for 6 steps, the first two seeds), into --out, headed as a smoke test; the
    committed folder is left alone."""
    import yaml

    from keel.cli import main
    from keel.experiments import declared

    committed = sorted(p.name for p in study_files()[name].parent.rglob("*"))
    out = tmp_path / name
    assert main(["experiment", name, "--quick", "--out", str(out)]) == 0, capsys.readouterr().err
    report = (out / "report.md").read_text()
    study = declared.smoke(declared.read(yaml.safe_load(study_files()[name].read_text()), name))
    plots = {"loss": ["study.png"], "redundancy": ["redundancy.png"], "downstream": ["downstream.png"]}.get(
        study.measure) or [
        p.name for p in out.glob("maxlr-*.png")]  # one per cell
    assert report.startswith("> **SMOKE TEST, NOT A RESULT**") and all((out / p).stat().st_size > 0 for p in plots)
    assert len(plots) == (len(study.cells()) if study.measure == "max_lr" else 1)
    trained = [k for k in store.keys(out / "points") if not k.startswith("init-")]
    points = {k: store.load(out / "points", k) for k in trained}
    assert {p["seed"] for p in points.values()} == set(study.seeds[:2])
    if study.measure == "max_lr":  # a point on the ramp keeps its evaluations and per-step losses (6 steps at most)
        assert all(p["depth"] == 4 and 1 <= len(p["train_losses"]) <= 6 for p in points.values())
    elif study.measure == "redundancy":  # each of the 4 sub-layers taken out both ways
        assert all(len(p["delta_loss"]["sublayer"]) == len(p["delta_loss"]["branch"]) == 4 for p in points.values())
    elif study.measure == "downstream":  # scored at step 0 and at the end of its 6 steps
        assert all(p["n_sublayers"] == 4 and p["curve"]["step"] == [0, 6] for p in points.values())
    else:
        assert all(p["n_sublayers"] == 4 and p["d_model"] == 32 and len(p["losses"]) == 6 for p in points.values())
    results = store.read_results(out)["results"]
    if study.measure == "downstream":  # each pair read at equal loss, the rankings of `rank`
        assert list(results["equal_loss"]) == [" vs ".join(p) for p in study.compare]
        assert len(results["deep_vs_wide"]["pairs"]) == len(study.rank) * (len(study.rank) - 1) // 2
        return
    across = [p for p in study.compare if declared._pinned(study.best_of, declared._leaves(p)[0])]  # once, last
    assert [t["pair"] for t in results["tests"]] == [p for c in study.cells() for p in study.compare
                                                     if p not in across] + across
    assert sorted(p.name for p in study_files()[name].parent.rglob("*")) == committed


# a code study's sweep at its smallest: frontier at one depth, one LR per scheme (a point per scheme and seed)
ONE_LR = ["depths=[4]", "lrs={post_ln: [0.003], keel: [0.003]}", "run.steps=4"]


def test_bad_experiment_override_names_the_key():
    with pytest.raises(ValueError, match="depths"):
        build("frontier", True, ["depths=many"])


def test_a_sweep_directory_refuses_points_of_another_configuration(corpus_cfg, tmp_path):
    cfg = build("frontier", True, [*TINY, *ONE_LR, *corpus_cfg, "seeds=[0]"])
    EXPERIMENTS["frontier"][1](cfg, tmp_path, "keel experiment frontier --quick")
    longer = build("frontier", True, [*TINY, *ONE_LR, *corpus_cfg, "seeds=[0]", "run.steps=5"])
    with pytest.raises(ValueError, match="differs in run.steps"):
        EXPERIMENTS["frontier"][1](longer, tmp_path, "keel experiment frontier --quick run.steps=5")


@pytest.mark.slow  # over a CPU second in the fast tier
def test_adding_seeds_to_a_sweep_runs_only_the_new_seeds(corpus_cfg, tmp_path, capsys):
    one = build("frontier", True, [*TINY, *ONE_LR, *corpus_cfg, "seeds=[0]"])
    EXPERIMENTS["frontier"][1](one, tmp_path, "keel experiment frontier --quick seeds=[0]")
    assert "reused" not in capsys.readouterr().out  # nothing was saved before
    first = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "points").glob("*-seed0.json.gz")}
    two = build("frontier", True, [*TINY, *ONE_LR, *corpus_cfg, "seeds=[0,1]"])
    EXPERIMENTS["frontier"][1](two, tmp_path, "keel experiment frontier --quick seeds=[0,1]")
    n = len(one.schemes)  # one LR: a point per scheme and seed; the seed-0 ones found, the seed-1 ones trained
    assert f"reused {n} of {2 * n} saved points from {tmp_path / 'points'}" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "points").glob("*-seed0.json.gz")} == first
    points = store.keys(tmp_path / "points")
    assert sorted(k.rsplit("-", 1)[1] for k in points) == ["seed0"] * n + ["seed1"] * n
    assert json.loads((tmp_path / "points" / "config.json").read_text())["seeds"] == [0, 1]
    # a seed-1-only rerun still reads its points and keeps the recorded union
    EXPERIMENTS["frontier"][1](build("frontier", True, [*TINY, *ONE_LR, *corpus_cfg, "seeds=[1]"]),
                               tmp_path, "keel experiment frontier --quick seeds=[1]")
    assert json.loads((tmp_path / "points" / "config.json").read_text())["seeds"] == [0, 1]


def test_a_prepared_budget_point_starts_from_the_same_init(corpus_cfg):
    cfg = build("frontier", True, [*TINY, *ONE_LR, *corpus_cfg, "curve_every=0"])
    model_cfg = cfg.point_model("keel", 4)
    plain = budget_point(cfg, model_cfg, 3e-3, 1)
    prepared = budget_point(cfg, model_cfg, 3e-3, 1, prepare=lambda m: None)
    assert plain["losses"] == prepared["losses"] and plain["report_loss"] == prepared["report_loss"]


def test_a_field_added_later_with_its_default_does_not_invalidate_a_sweep(corpus_cfg, tmp_path):
    cfg = build("frontier", True, [*TINY, *ONE_LR, *corpus_cfg, "seeds=[0]"])
    EXPERIMENTS["frontier"][1](cfg, tmp_path, "keel experiment frontier --quick")
    recorded = tmp_path / "points" / "config.json"
    old = json.loads(recorded.read_text())
    del old["guard"]["spike_min_rise"]  # as recorded before that field existed
    recorded.write_text(json.dumps(old))
    EXPERIMENTS["frontier"][1](cfg, tmp_path, "keel experiment frontier --quick")  # same default: reused
    changed = build("frontier", True, [*TINY, *ONE_LR, *corpus_cfg, "seeds=[0]", "guard.spike_min_rise=1"])
    recorded.write_text(json.dumps(old))
    with pytest.raises(ValueError, match="differs in guard.spike_min_rise"):
        EXPERIMENTS["frontier"][1](changed, tmp_path, "keel experiment frontier --quick")


@pytest.mark.parametrize("quick", [False, True])
def test_a_bare_experiment_command_never_writes_into_the_committed_results(quick, tmp_path, monkeypatch):
    """`keel experiment frontier` as the README writes it, in a clone whose results/frontier holds committed points
    of another configuration: the run goes to runs/experiments/frontier (runs/quick/frontier with --quick), and only
    a --quick run is marked as a smoke test."""
    from keel.cli import main
    from keel.experiments import common

    (tmp_path / "results" / "frontier" / "points").mkdir(parents=True)
    (tmp_path / "results" / "frontier" / "points" / "config.json").write_text('{"depths": [64, 256, 1024]}')
    monkeypatch.chdir(tmp_path)
    seen = []

    def fake_run(cfg, out, command):
        seen.append((out, common._SMOKE_TEST.get()))
        (out / "report.md").write_text("# frontier\n")

    monkeypatch.setitem(EXPERIMENTS, "frontier", (EXPERIMENTS["frontier"][0], fake_run))
    assert main(["experiment", "frontier", *(["--quick"] if quick else [])]) == 0
    assert seen == [(Path("runs/quick/frontier" if quick else "runs/experiments/frontier"), quick)]
    assert sorted(p.name for p in (tmp_path / "results" / "frontier").rglob("*")) == ["config.json", "points"]


@pytest.mark.slow  # compiles the model (18 s cold on a loaded machine)
def test_a_sweep_recorded_eager_continues_compiled_and_each_point_says_how_it_ran(corpus_cfg, tmp_path):
    """run.compile is how a point is computed, not what (EXECUTION_FIELDS): adding seeds compiled to a sweep
    recorded eager is allowed, and each point records its own execution."""
    eager = build("frontier", True, [*TINY, *ONE_LR, *corpus_cfg, "seeds=[0]"])
    EXPERIMENTS["frontier"][1](eager, tmp_path, "seeds=[0]")
    compiled = build("frontier", True, [*TINY, *ONE_LR, *corpus_cfg, "seeds=[0,1]", "run.compile=true"])
    EXPERIMENTS["frontier"][1](compiled, tmp_path, "seeds=[0,1] run.compile=true")
    ran = {k: store.load(tmp_path / "points", k)["execution"]["compile"] for k in store.keys(tmp_path / "points")}
    assert ran and all(ran[k] is k.endswith("seed1") for k in ran)
    with pytest.raises(ConfigError, match="differs in optim.warmup_steps"):  # what a point computes still counts
        EXPERIMENTS["frontier"][1](build("frontier", True, [*TINY, *ONE_LR, *corpus_cfg, "optim.warmup_steps=1"]),
                                   tmp_path, "")


@pytest.mark.slow
def test_probes_of_a_compiled_point_are_those_of_the_eager_point(corpus_cfg, tmp_path):
    """A compiled model (its Keel junctions fused across blocks) is probed through an eager twin with its weights
    (`probes.plain`): its branches-off losses and rms ratios equal the eager point's to float32 tolerance."""
    out = {}
    for compile in (True, False):
        torch._dynamo.reset()
        cfg = build("frontier", True, [*TINY, *corpus_cfg, f"run.compile={str(compile).lower()}", "run.steps=4",
                                       "probe=true", "probe_batches=1"])
        out[compile] = budget_point(cfg, cfg.point_model("keel", 4), 3e-3, 0)
    probe = {k: v["probe"] for k, v in out.items()}
    assert probe[True]["loss_branches_above_k_off"] == pytest.approx(probe[False]["loss_branches_above_k_off"],
                                                                     rel=1e-4)
    assert probe[True]["f_over_ax"] == pytest.approx(probe[False]["f_over_ax"], rel=1e-3)
    assert out[True]["report_loss"] == pytest.approx(out[False]["report_loss"], rel=1e-4)
