"""A study declared as data (`keel sweep STUDY.yaml` with `arms:`, keel.experiments.declared): its choices, tests and
report recomputed from its point files by hand, its bad fields one line before any point trains."""

import json
import math

import numpy as np
import pytest
import yaml
from scipy import stats as scipy_stats

from keel.cli import main
from keel.experiments import store

TINY = {"model": {"d_model": 32, "n_heads": 2, "n_kv_heads": 1},
        "run": {"steps": 6, "batch_size": 4, "seq_len": 32, "eval_batches": 1, "compile": False},
        "optim": {"warmup_steps": 2}, "data": {"source": "stdlib"}}
TASKS = TINY | {"run": {**TINY["run"], "eval_tasks": ["brackets"]}}  # what measure downstream scores


def study(**fields) -> dict:
    return {"question": "which arm has the lower loss?", "base": TINY,
            "arms": {"keel": {"model.scheme": "keel"}, "pre_ln": {"model": {"scheme": "pre_ln"}},
                     "post_ln": {"model.scheme": "post_ln"}},
            "axes": {"model.n_blocks": [1, 2]},
            "tune": [{"field": "optim.lr", "grid": [1.0e-5, 2.0e-5], "grow": 1}],
            "seeds": [0, 1, 2]} | fields


def write(tmp_path, doc: dict):
    path = tmp_path / "study" / "study.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def holm_by_hand(ps: list[float]) -> list[float]:
    """Holm's step-down adjustment written out: the k-th smallest p times (m - k), kept from falling, capped at 1."""
    order = np.argsort(ps)
    adjusted, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted


def report_losses(points: dict, lr: float, arm: str, depth: int) -> list[float]:
    return [next(p["report_loss"] for p in points.values() if p["arm"] == arm and p["seed"] == s and p["lr"] == lr
                 and p["cell"] == {"model.n_blocks": depth}) for s in (0, 1, 2)]


@pytest.mark.slow
def test_a_declared_study_chooses_tests_and_reports_as_its_points_say(tmp_path):
    path = write(tmp_path, study())
    assert main(["sweep", str(path)]) == 0
    out = path.parent
    results = json.loads((out / "results.json").read_text())["results"]
    points = {k: store.load(out / "points", k) for k in store.keys(out / "points")}
    for cell, depth in (("n_blocks1", 1), ("n_blocks2", 2)):
        for arm in ("keel", "pre_ln", "post_ln"):
            run = {k: p for k, p in points.items() if p["arm"] == arm and p["cell"] == {"model.n_blocks": depth}}
            lrs = sorted({p["lr"] for p in run.values()})
            mean = {lr: np.mean([p["select_loss"] if p["select_loss"] is not None and math.isfinite(p["select_loss"])
                                 else math.inf for p in run.values() if p["lr"] == lr]) for lr in lrs}
            best = min(lrs, key=lambda lr: mean[lr])
            assert results["choices"][cell][arm]["hp"] == {"optim.lr": best}
            # a choice at an edge of the starting grid grew it by the edge's factor (one value: grow 1)
            assert set(lrs) - {1e-5, 2e-5} <= {5e-6, 4e-5} and len(lrs) <= 3
            if best in (1e-5, 2e-5) and best == (min(lrs) if best == 1e-5 else max(lrs)):
                assert len(lrs) == 3  # grown past the edge it chose
            assert all(len([p for p in run.values() if p["lr"] == lr]) == 3 for lr in lrs)  # every seed
    tests = results["tests"]
    assert [(t["cell"], t["pair"]) for t in tests] == [(c, p) for c in ("n_blocks1", "n_blocks2")
                                                       for p in (["keel", "pre_ln"], ["keel", "post_ln"])]
    for t in tests:
        a, b = (report_losses(points, results["choices"][t["cell"]][arm]["hp"]["optim.lr"], arm, int(t["cell"][-1]))
                for arm in t["pair"])
        assert t["mean"] == pytest.approx(np.mean(np.subtract(a, b)), abs=1e-12)
        if t["p"] is not None:
            assert t["p"] == pytest.approx(scipy_stats.ttest_rel(a, b).pvalue, rel=1e-9)
    with_p = [t for t in tests if t["p"] is not None]
    for t, adjusted in zip(with_p, holm_by_hand([t["p"] for t in with_p])):
        assert t["p_holm"] == pytest.approx(adjusted, rel=1e-12)
        assert t["verdict"] == ("inconclusive" if adjusted >= 0.05 else
                                f"{t['pair'][0] if t['mean'] < 0 else t['pair'][1]} lower")
    report = (out / "report.md").read_text()
    assert "which arm has the lower loss?" in report and (out / "study.png").stat().st_size > 0
    before = (out / "results.json").read_text()
    # run again: every point is on disk, nothing trains (--report-only would refuse a missing one), same numbers
    assert main(["sweep", str(path), "--report-only"]) == 0
    assert json.loads((out / "results.json").read_text())["results"] == json.loads(before)["results"]


@pytest.mark.parametrize("change,needle", [
    ({"arms": {"keel": {"model.scheme": "keeel"}, "pre_ln": {"model.scheme": "pre_ln"}}},
     "arms.keel: ModelConfig.scheme: unknown scheme"),
    ({"arms": {"keel": {"model.scheme": "keel"}}}, "arms: at least two arms"),
    ({"arms": {"keel": {"model.nope": 1}, "pre_ln": {}}}, "arms.keel: model.nope"),
    ({"arms": {"keel": {}, "pre_ln": {"model.scheme": "pre_ln", "data.source": "/nonexistent/corpus.txt"}}},
     "arms.pre_ln: /nonexistent/corpus.txt: no such file or directory (data.source)"),  # read before keel's points
    ({"axes": {"model.n_blocks": [0]}}, "axes.model.n_blocks: "),
    ({"axes": {"model.n_blocks": []}}, "axes.model.n_blocks: a list of distinct values"),
    ({"tune": [{"field": "optim.lr", "grid": [1e-3]}]}, "tune[0].grid: at least two"),
    ({"tune": [{"field": "optim.lr", "grid": [1e-3, -1e-3]}]}, "tune[0].grid: at least two distinct positive"),
    ({"tune": [{"field": "optim.lr", "grid": [1e-3, 2e-3], "grow": -1}]}, "tune[0].grow"),
    ({"tune": [{"field": "model.n_blocks", "grid": [1, 2]}]}, "tune: model.n_blocks is chosen per arm and cell"),
    ({"arms": {"keel": {"model.n_blocks": 4}, "pre_ln": {"model.scheme": "pre_ln"}}},
     "axes: model.n_blocks is set per cell, so arms.keel may not set it"),
    ({"arms": {"keel": {"optim.lr": 1e-3}, "pre_ln": {"model.scheme": "pre_ln"}}, "tune": [
        {"field": "optim.lr", "grid": [1e-5, 2e-5], "arms": ["keel"]}]},
     "optim.lr is chosen per arm and cell, so arms.keel"),
    ({"tune": [{"field": "optim.schedule", "grid": [1, 2]}]}, "tune[0]: optim.schedule"),
    ({"seeds": []}, "seeds: empty"),
    ({"seeds": [0, 0]}, "seeds: distinct integers"),
    ({"marginal_seeds": [0]}, "marginal_seeds: must be new seeds"),
    ({"compare": [["keel", "nope"]]}, "compare: pairs of two different arms"),
    ({"compare": [["keel", "pre_ln"], ["keel", "post_lm"]]}, "; 'post_lm' is none of them)"),
    ({"untested": ["keel", "pre_ln"]}, "untested: pairs of two different arms out of keel, pre_ln, post_ln (or of "
                                       "two such pairs), or of arm@cell on both sides (a cell of n_blocks1, n_blocks2) "
                                       "(got ['keel', 'pre_ln']; a list of pairs: [[a, b]])"),
    ({"select_seeds": [5]}, "select_seeds: some of seeds [0, 1, 2]"),
    ({"select_seeds": []}, "select_seeds: some of seeds"),
    ({"curve_batches": 0}, "curve_batches: an integer >= 1"),
    ({"measure": "accuracy"}, "measure: 'accuracy'; allowed: loss"),
    ({"base": {"run": {"seed": 3}}}, "base: run.seed: not used here (set per point from seeds)"),
    ({"base": TINY | {"model": {"max_seq_len": 64}}}, "base: model.max_seq_len: not used here (set per point from run"),
    ({"nope": 1}, "unknown key 'nope'"),
    ({"question": ["does keel", "beat pre_ln?"]}, "question: text, quoted if"),
    ({"best_of": {"best": ["keel"]}}, "best_of: a mapping of new names -> lists of two or more distinct arms"),
    ({"best_of": {"keel": ["keel", "pre_ln"]}}, "best_of: a mapping of new names"),
    ({"best_of": {"best": ["keel", "nope"]}}, "best_of: a mapping of new names"),
    ({"best_of": ["keel", "pre_ln"]}, "best_of: a mapping of new names"),
    ({"best_of": {"best": ["keel", "pre_ln"]}, "compare": [["best", "nope"]]}, "compare: pairs of two different arms "
                                                                               "out of keel, pre_ln, post_ln, best"),
    ({"untested": [["keel", "keel"]]}, "untested: pairs of two different arms"),
    ({"compare": [[["keel", ["keel", "pre_ln"]], "pre_ln"]]}, "compare: pairs of two different arms"),
    ({"probe": "yes"}, "probe: true or false (got 'yes')"),
    ({"tune": [{"field": "optim.lr", "grid": [1e-3, 2e-3], "arms": ["nope"]}]}, "tune[0].arms: some of the arms"),
    ({"tune": [{"field": "optim.lr", "grid": [1e-3, 2e-3], "below": [2e-3]}]}, "tune[0].below: values falling"),
    ({"tune": [{"field": "optim.lr", "grid": [1e-3, 2e-3], "above": [3e-3, 3e-3]}]}, "tune[0].above: values rising"),
    ({"tune": [{"field": "optim.lr", "grid": [1e-3, 2e-3], "ties": "middle"}]}, "tune[0].ties: low or high"),
    ({"tune": [{"field": "optim.lr", "grid": [1e-3, 2e-3], "ladder": [1]}]}, "optionally arms, below, above, ties"),
    ({"compare": [["keel@n_blocks1", "pre_ln"]]}, "or of arm@cell on both sides (a cell of n_blocks1, n_blocks2)"),
    ({"compare": [["keel@n_blocks3", "keel@n_blocks1"]]}, "compare: pairs of two different arms"),
    ({"best_of": {"best": ["keel@n_blocks1", "pre_ln"]}}, "best_of: a mapping of new names -> lists of two or more "
                                                          "distinct arms, or of arm@cell"),
    ({"measure": "max_lr"}, "tune: the loss measurement's; measure max_lr chooses nothing"),
    ({"measure": "max_lr", "tune": [], "probe": True}, "probe: the loss measurement's"),
    ({"max_lr": {"eval_every": 2}}, "max_lr: the max-LR measurement's settings; set measure: max_lr"),
    ({"measure": "max_lr", "tune": [], "max_lr": {"every": 2}}, "max_lr: a mapping of eval_every, rules, scale"),
    ({"measure": "max_lr", "tune": [], "max_lr": {"eval_every": 0}}, "max_lr.eval_every: select-half evaluations"),
    ({"measure": "max_lr", "tune": [], "max_lr": {"rules": {"confirm": 2.5}}}, "max_lr.rules: margin, rise, confirm"),
    ({"measure": "max_lr", "tune": [], "max_lr": {"rules": {"nope": 1}}}, "max_lr.rules: margin, rise, confirm"),
    ({"measure": "max_lr", "tune": [], "max_lr": {"rules": {"rise": -0.3}}}, "max_lr.rules: margin, rise, confirm"),
    ({"measure": "max_lr", "tune": [], "max_lr": {"scale": "ln"}}, "max_lr.scale: lr or log"),
    ({"measure": "max_lr", "tune": [], "max_lr": {"published": {"keel/nope": 1.3}}}, "max_lr.published: arm/arm"),
    ({"measure": "max_lr", "tune": [], "max_lr": {"published": {"keel/pre_ln": 0}}}, "max_lr.published: arm/arm"),
    ({"measure": "max_lr", "tune": []}, "base: optim.warmup_steps: not used here (the max-LR ramp sets it"),
    ({"measure": "max_lr", "tune": [], "base": TINY | {"optim": {"schedule": "constant"}}},
     "base: optim.schedule: not used here (the max-LR ramp sets it"),
    ({"measure": "max_lr", "tune": [], "base": TINY | {"optim": {}},
      "arms": {"keel": {"model.scheme": "keel", "optim.min_lr": 0.0}, "pre_ln": {"model.scheme": "pre_ln"}}},
     "optim.min_lr: not used here (the max-LR ramp sets it"),
    ({"crossing": 0.1}, "crossing: a fraction of the run"),  # no curve
    ({"crossing": 1.5, "curve_every": 2}, "crossing: a fraction of the run"),
    ({"crossing": 0.1, "curve_every": 2, "compare": [[["keel", "pre_ln"], "post_ln"]]}, "compare pairs of two arms"),
    ({"measure": "max_lr", "tune": [], "crossing": 0.1}, "crossing: the loss measurement's"),
    ({"stream": {"bf16": ["nope"]}, "axes": {}}, "stream: keel.experiments.stream's bf16"),
    ({"stream": {"bf16": ["keel", "pre_ln", "post_ln"]}, "axes": {}}, "stream: keel.experiments.stream's bf16"),
    ({"stream": {"bf16": ["keel"], "init_blocks": [0]}, "axes": {}}, "stream: keel.experiments.stream's bf16"),
    ({"stream": {"bf16": ["keel"], "init": [2]}, "axes": {}}, "stream: keel.experiments.stream's bf16"),
    ({"stream": {"bf16": ["keel"]}}, "a study without axes"),
    ({"measure": "max_lr", "tune": [], "stream": {"bf16": ["keel"]}}, "stream: the loss measurement's"),
    ({"measure": "redundancy", "tune": []}, "axes: not used by measure redundancy (one cell"),
    ({"measure": "redundancy", "axes": {}}, "tune: not used by measure redundancy"),
    ({"measure": "redundancy", "axes": {}, "tune": [], "probe": True}, "probe: not used by measure redundancy"),
    ({"measure": "redundancy", "axes": {}, "tune": [], "untested": [["keel", "pre_ln"]]}, "untested: not used by"),
    ({"measure": "redundancy", "axes": {}, "tune": [], "compare": [["keel", "pre_ln"]]},
     "compare: pairs of two different ARM.MODE.PART (an arm; sublayer or branch; 0, 1, lower, upper)"),
    ({"measure": "redundancy", "axes": {}, "tune": [], "compare": [["keel.branch.upper", "keel.block.lower"]]},
     "compare: pairs of two different ARM.MODE.PART"),
    ({"measure": "redundancy", "axes": {}, "tune": [], "compare": [["keel.branch.1", "keel.branch.1"]]},
     "compare: pairs of two different ARM.MODE.PART"),
    ({"measure": "redundancy", "axes": {}, "tune": [], "compare": [[["keel.branch.1", "keel.branch.0"], "x"]]},
     "compare: pairs of two different ARM.MODE.PART"),
    ({"measure": "redundancy", "axes": {}, "tune": [], "max_lr": {"eval_every": 2}}, "max_lr: the max-LR measurement"),
    ({"measure": "redundancy", "axes": {}, "tune": [], "base": TINY | {"model": {**TINY["model"], "n_blocks": 4,
                                                                              "loop_blocks": 2}}},
     "arms.keel: model.loop_blocks: measure redundancy takes out one sub-layer of its own"),
    ({"measure": "downstream", "axes": {}, "tune": []}, "run.eval_tasks: measure downstream scores tasks"),
    ({"measure": "downstream", "axes": {}, "tune": [], "base": TASKS, "curve_every": 2},
     "curve_every: not used by measure downstream"),
    ({"measure": "downstream", "axes": {}, "tune": [], "base": TASKS, "rank": ["keel"]}, "rank: measure downstream's"),
    ({"measure": "downstream", "axes": {}, "tune": [], "base": TASKS, "rank": ["keel", "nope"]}, "rank: measure"),
    ({"measure": "downstream", "axes": {}, "tune": [], "base": TASKS, "rank": ["keel", "keel"]}, "rank: measure"),
    ({"rank": ["keel", "pre_ln"]}, "rank: measure downstream's two or more distinct arms"),
    ({"measure": "downstream", "axes": {}, "tune": [], "base": TINY | {"run": {**TINY["run"], "eval_tasks": [
        "bracket"]}}}, "did you mean 'brackets'"),
])
def test_a_bad_declared_study_is_one_line_before_any_point(change, needle, tmp_path, capsys):
    path = write(tmp_path, study(**change))
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (path.parent / "points").exists()


@pytest.mark.parametrize("doc,needle", [({}, "arms: at least two arms to compare"), (
    {"question": "q", "arm": {"keel": {}}}, "unknown key 'arm' (allowed: question, answer, rule, base, arms,")])
def test_a_study_file_naming_no_study_kind_is_checked_as_a_declared_study(doc, needle, tmp_path, capsys):
    """An empty file, or `arms:` misspelt: the declared study's own message, not 'study: None is not a study kind'."""
    assert main(["sweep", str(write(tmp_path, doc))]) == 2
    assert needle in capsys.readouterr().err


def test_a_corpus_too_small_for_a_validation_window_is_one_line_before_any_point(tmp_path, capsys):
    """Pre-LN's own corpus of 60 one-line files: its validation halves hold fewer tokens than one window of
    run.seq_len + 1, which its first point would find only after keel's points trained."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(60):
        (corpus / f"f{i}.txt").write_text(f"x = {i}\n")
    path = write(tmp_path, study(axes={}, tune=[], arms={"keel": {}, "pre_ln": {"model.scheme": "pre_ln",
                                                                                "data.source": str(corpus)}}))
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert "arms.pre_ln: data.source: " in err and "not one window of run.seq_len + 1 (33); add text" in err, err
    assert not (path.parent / "points").exists()


def _one_line_files(folder, n: int = 60):
    folder.mkdir()
    for i in range(n):
        (folder / f"f{i}.txt").write_text(f"x = {i}\n")
    return folder


def test_each_arms_corpus_is_counted_as_that_arm_tokenises_and_splits_it(tmp_path, capsys):
    """Two arms on one corpus, split otherwise (data.val_fraction): Keel's halves hold a window, Pre-LN's do not.
    Counted once per source, Pre-LN's check read Keel's count and passed, and its first point failed mid-study."""
    corpus = _one_line_files(tmp_path / "corpus")
    path = write(tmp_path, study(axes={}, tune=[], arms={
        "keel": {"data.source": str(corpus), "data.val_fraction": 0.5},
        "pre_ln": {"model.scheme": "pre_ln", "data.source": str(corpus), "data.val_fraction": 0.02}}))
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert "arms.pre_ln: data.source: " in err and "not one window of run.seq_len + 1 (33)" in err, err


def test_a_quick_study_checks_its_corpus_at_the_size_it_trains(tmp_path):
    """A corpus with a window's worth at the smoke size (run.seq_len 32) but not at the study's own (160): refused
    as the study, read at its smoke size (`keel experiment NAME --quick`)."""
    from keel.errors import ConfigError
    from keel.experiments import declared

    corpus = _one_line_files(tmp_path / "corpus")
    doc = study(axes={}, tune=[], base={**TINY, "run": {**TINY.get("run", {}), "seq_len": 160}},
                arms={"keel": {"data.source": str(corpus), "data.val_fraction": 0.5}, "pre_ln": {
                    "model.scheme": "pre_ln", "data.source": str(corpus), "data.val_fraction": 0.5}})
    with pytest.raises(ConfigError, match=r"not one window of run.seq_len \+ 1 \(161\)"):
        declared.read(doc, "test")
    assert declared.read(doc, "test", quick=True).config({}).run.seq_len == 32


def test_a_study_kinds_file_with_its_study_key_misspelt_is_told_that_key(tmp_path, capsys):
    path = write(tmp_path, {"stduy": "gradflow", "fields": {}})
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'stduy' (allowed: study, fields" in err, err


def test_report_only_into_a_new_out_makes_no_folder(tmp_path, capsys):
    path = write(tmp_path, study())
    assert main(["sweep", str(path), "--out", str(tmp_path / "new"), "--report-only"]) == 2
    assert "--report-only trains nothing" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_a_declared_study_takes_no_overrides(tmp_path, capsys):
    path = write(tmp_path, study())
    assert main(["sweep", str(path), "seeds=[0]"]) == 2
    assert "a declared study takes no key=value overrides" in capsys.readouterr().err


def test_the_documented_study_is_a_valid_one():
    """docs/experiments.md's example study reads and checks whole (every arm, axis and grid value merged)."""
    from pathlib import Path

    from keel.experiments import declared

    page = (Path(__file__).parent.parent / "docs" / "experiments.md").read_text()
    block = page.split("## Your own study", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    study = declared.read(yaml.safe_load(block), "docs/experiments.md")
    assert list(study.arms) == ["keel", "pre_ln"] and study.axes == {"model.n_blocks": [4, 8]}
    assert [c.model.n_blocks for c in (study.config({"model.n_blocks": n}) for n in (4, 8))] == [4, 8]


def test_report_only_with_points_missing_writes_nothing(tmp_path, monkeypatch, capsys):
    """--report-only refuses a study whose points are not all there, and leaves the folder as it was: no points/ for
    a study never run, and no added seed recorded in points/config.json (written-out points, no training)."""
    from keel.experiments import declared

    monkeypatch.setattr(declared, "point", lambda study, arm, cell, hp, seed: {
        "seed": seed, "diverged": False, "select_loss": 1.0, "report_loss": 1.0 + 0.1 * seed + 0.01 * len(arm)})
    path = write(tmp_path, study(axes={}, tune=[], seeds=[0, 1]))
    assert main(["sweep", str(path), "--report-only"]) == 2
    assert "point(s) not there" in capsys.readouterr().err and not (path.parent / "points").exists()
    assert main(["sweep", str(path)]) == 0
    recorded = (path.parent / "points" / "config.json").read_text()
    path.write_text(yaml.safe_dump(study(axes={}, tune=[], seeds=[0, 1, 2]), sort_keys=False))
    assert main(["sweep", str(path), "--report-only"]) == 2
    assert (path.parent / "points" / "config.json").read_text() == recorded


def test_a_study_may_set_any_seq_len_and_its_model_takes_that_length():
    """run.seq_len above the science model's 64 positions, in the base or an arm: each point's model is built for
    its own run.seq_len (a study never sets model.max_seq_len itself)."""
    from keel.experiments import declared

    doc = study(base=TINY | {"run": {**TINY["run"], "seq_len": 128}}, axes={}, tune=[],
                arms={"keel": {}, "pre_ln": {"model.scheme": "pre_ln", "run.seq_len": 256}})
    got = declared.read(doc, "test")
    assert [(c.run.seq_len, c.model.max_seq_len) for c in map(got.config, got.arms.values())] == [(128, 128),
                                                                                                  (256, 256)]


@pytest.mark.slow  # over a second in tests/durations.json
def test_a_marginal_test_gets_the_marginal_seeds_on_both_arms_and_all_tests_run_again(tmp_path, monkeypatch):
    """Points with written-out losses (no training): keel - pre_ln on seeds 0-2 is marginal (raw p 0.037 < 0.05,
    lifted by Holm over two tests to 0.075); seeds 3 and 4 are added to both arms at their chosen LR (the other
    pair's arms only where they are in the marginal test), and every test is judged again on all seeds."""
    from keel.experiments import declared

    report = {"keel": [1.00, 1.10, 1.20, 1.00, 1.10], "pre_ln": [1.02, 1.1269, 1.2131, 1.05, 1.12],
              "post_ln": [1.50, 1.10, 1.00, 1.30, 1.20]}
    ran = []

    def fake_point(study, arm, cell, hp, seed):
        ran.append((arm, seed))
        lr = hp["optim.lr"]  # 2e-5 is every arm's best on the select half: an interior choice
        return {"arm": arm, "cell": cell, "tuned": hp, "lr": lr, "seed": seed,
                "select_loss": 1.0 + abs(math.log(lr / 2e-5)), "report_loss": report[arm][seed]}
    monkeypatch.setattr(declared, "point", fake_point)
    doc = study(axes={}, tune=[{"field": "optim.lr", "grid": [1e-5, 2e-5, 4e-5], "grow": 1}], marginal_seeds=[3, 4])
    results = declared.run(declared.read(doc, "test"), tmp_path, "test")
    first = [scipy_stats.ttest_rel(report["keel"][:3], report[b][:3]).pvalue for b in ("pre_ln", "post_ln")]
    assert first[0] < 0.05 and 0.05 <= holm_by_hand(first)[0] < 0.20  # marginal, as the rule says
    assert sorted(s for a, s in ran if s >= 3) == [3, 3, 4, 4] and {a for a, s in ran if s >= 3} == {"keel", "pre_ln"}
    tests = results["tests"]
    assert tests[0]["seeds"] == [0, 1, 2, 3, 4] and tests[1]["seeds"] == [0, 1, 2]  # post_ln ran no added seed
    assert tests[0]["p"] == pytest.approx(scipy_stats.ttest_rel(report["keel"], report["pre_ln"]).pvalue, rel=1e-9)
    final = [t["p"] for t in tests]
    assert [t["p_holm"] for t in tests] == pytest.approx(holm_by_hand(final), rel=1e-12)


def test_select_seeds_choose_alone_and_the_other_seeds_run_at_the_choice(tmp_path, monkeypatch):
    """With select_seeds [0]: seed 0 runs every LR the search tries (the grid grown past its edge), the choice is
    seed 0's lowest select-half loss, and seeds 1 and 2 run at that LR only; the tests use all three seeds."""
    from keel.experiments import declared

    ran = []

    def fake_point(study, arm, cell, hp, seed):
        ran.append((arm, hp["optim.lr"], seed))
        best = {"keel": 4e-5, "pre_ln": 2e-5}[arm]  # keel's best lies past the grid's high edge
        return {"lr": hp["optim.lr"], "seed": seed, "diverged": False,
                "select_loss": 1.0 + abs(math.log(hp["optim.lr"] / best)) + 0.01 * seed,
                "report_loss": {"keel": 1.0, "pre_ln": 1.1}[arm] + 0.01 * seed * (arm == "keel")}
    monkeypatch.setattr(declared, "point", fake_point)
    doc = study(axes={}, arms={"keel": {"model.scheme": "keel"}, "pre_ln": {"model.scheme": "pre_ln"}},
                tune=[{"field": "optim.lr", "grid": [1e-5, 2e-5], "grow": 2}], select_seeds=[0])
    results = declared.run(declared.read(doc, "test"), tmp_path, "test")
    assert results["choices"][""]["keel"]["hp"] == {"optim.lr": 4e-5}
    assert results["choices"][""]["pre_ln"]["hp"] == {"optim.lr": 2e-5}
    assert sorted(lr for a, lr, s in ran if a == "keel" and s == 0) == [1e-5, 2e-5, 4e-5, 8e-5]
    assert sorted((a, lr, s) for a, lr, s in ran if s > 0) == [("keel", 4e-5, 1), ("keel", 4e-5, 2),
                                                               ("pre_ln", 2e-5, 1), ("pre_ln", 2e-5, 2)]
    assert results["report_losses"][""] == {"keel": [1.0, 1.01, 1.02], "pre_ln": [1.1, 1.1, 1.1]}
    assert results["tests"][0]["n"] == 3 and results["tests"][0]["mean"] == pytest.approx(-0.09)


@pytest.mark.slow  # over a CPU second in the fast tier
def test_best_of_picks_the_arm_with_the_lowest_mean_select_loss_at_its_choices_and_untested_pairs_are_means(
        tmp_path, monkeypatch):
    """Points with written-out losses: each arm's LR is chosen by the mean select-half loss over every seed (seed 0
    alone would choose otherwise); best_of then picks, among its arms, the one whose mean at its chosen LR is lowest
    (alpha chosen like the LR), whatever the report half says; a test naming it compares the arm it picked. Holm runs
    over the tests alone: an untested pair is a mean and SD of the paired differences, outside the family."""
    from keel.experiments import declared

    select = {("post_ln", 1e-5): [2.0, 2.5, 2.5], ("post_ln", 2e-5): [2.1, 2.1, 2.1],      # the mean picks 2e-5
              ("keel", 1e-5): [1.9, 2.4, 2.4], ("keel", 2e-5): [2.2, 2.2, 2.2],            # the mean picks 2e-5
              ("keel_sqrtL", 1e-5): [1.8, 3.0, 3.0], ("keel_sqrtL", 2e-5): [2.3, 2.3, 2.3]}  # the mean picks 2e-5
    report = {"post_ln": [2.00, 2.10, 2.05], "keel": [2.30, 2.42, 2.33], "keel_sqrtL": [2.28, 2.39, 2.29]}

    def fake_point(study, arm, cell, hp, seed):
        lr = hp["optim.lr"]
        return {"lr": lr, "seed": seed, "diverged": False, "select_loss": select[arm, lr][seed],
                "report_loss": report[arm][seed] if lr == 2e-5 else 0.5}
    monkeypatch.setattr(declared, "point", fake_point)
    doc = study(axes={}, arms={"post_ln": {"model.scheme": "post_ln"}, "keel": {"model.scheme": "keel"},
                               "keel_sqrtL": {"model.scheme": "keel", "model.alpha": "sqrtL"}},
                tune=[{"field": "optim.lr", "grid": [1e-5, 2e-5], "grow": 0}],
                best_of={"tuned_keel": ["keel", "keel_sqrtL"]},
                compare=[["tuned_keel", "post_ln"], ["keel_sqrtL", "keel"]],
                untested=[["keel", "post_ln"], ["keel_sqrtL", "post_ln"]])
    results = declared.run(declared.read(doc, "test"), tmp_path, "test")
    assert {a: c["hp"]["optim.lr"] for a, c in results["choices"][""].items()} == {a: 2e-5 for a in report}
    # alpha = L has the lower mean select loss at its chosen LR (2.2 < 2.3), though sqrtL reports lower
    assert results["picks"][""]["tuned_keel"] == {"arm": "keel", "select": {"keel": pytest.approx(2.2),
                                                                            "keel_sqrtL": pytest.approx(2.3)}}
    primary, secondary = results["tests"]
    assert primary["pair"] == ["tuned_keel", "post_ln"] and primary["arms"] == ["keel", "post_ln"]
    ps = [scipy_stats.ttest_rel(report["keel"], report["post_ln"]).pvalue,
          scipy_stats.ttest_rel(report["keel_sqrtL"], report["keel"]).pvalue]
    assert [primary["p"], secondary["p"]] == pytest.approx(ps, rel=1e-9)
    assert [primary["p_holm"], secondary["p_holm"]] == pytest.approx(holm_by_hand(ps), rel=1e-12)
    untested = results["untested"]
    assert [t["pair"] for t in untested] == [["keel", "post_ln"], ["keel_sqrtL", "post_ln"]]
    assert untested[0]["mean"] == pytest.approx(np.mean([0.30, 0.32, 0.28])) and "p" not in untested[0]
    report_md = (tmp_path / "report.md").read_text()
    assert "**tuned_keel**: keel (mean select-half loss at the choices: keel 2.200, keel_sqrtL 2.300)" \
        in report_md
    assert "| - | tuned_keel (keel) - post_ln |" in report_md and "| reported, not tested |" in report_md


def test_best_of_ties_go_to_the_first_arm_listed(tmp_path, monkeypatch):
    from keel.experiments import declared

    def fake_point(study, arm, cell, hp, seed):
        return {"seed": seed, "diverged": arm != "post_ln", "report_loss": 1.0 + 0.01 * seed,
                "select_loss": None if arm != "post_ln" else 1.0}  # Keel and Pre-LN diverged: +inf each
    monkeypatch.setattr(declared, "point", fake_point)
    doc = study(axes={}, tune=[], best_of={"best": ["pre_ln", "keel"]}, compare=[["best", "post_ln"]],
                arms={"keel": {"model.scheme": "keel"}, "pre_ln": {"model.scheme": "pre_ln"},
                      "post_ln": {"model.scheme": "post_ln"}})
    results = declared.run(declared.read(doc, "test"), tmp_path, "test")
    assert results["picks"][""]["best"]["arm"] == "pre_ln"


@pytest.mark.slow  # over a CPU second in the fast tier
def test_a_pair_or_best_of_pinned_to_cells_is_one_test_across_them(tmp_path, monkeypatch):
    """LR as an axis, nothing tuned (Table 2's design): keel - pre_ln is judged in every cell; keel@lr4e-05 -
    keel@lr1e-05 once, across two cells; keel_best and pre_ln_best each pick the cell (LR) with the lowest mean
    select-half loss over the seeds, and their test compares those points. Holm runs over all five tests."""
    from keel.experiments import declared

    best = {"keel": 2e-5, "pre_ln": 1e-5}

    def fake_point(study, arm, cell, hp, seed):
        lr = cell["optim.lr"]
        return {"lr": lr, "seed": seed, "diverged": False, "select_loss": 1.0 + abs(math.log(lr / best[arm])),
                "report_loss": {"keel": 1.0, "pre_ln": 1.2}[arm] + lr * 1e3 * (1 + 0.1 * seed)
                + 0.01 * seed ** 2 * (arm == "keel")}
    monkeypatch.setattr(declared, "point", fake_point)
    doc = study(arms={"keel": {"model.scheme": "keel"}, "pre_ln": {"model.scheme": "pre_ln"}}, tune=[],
                axes={"optim.lr": [1e-5, 2e-5, 4e-5]},
                best_of={"keel_best": ["keel@lr1e-05", "keel@lr2e-05", "keel@lr4e-05"],
                         "pre_ln_best": ["pre_ln@lr1e-05", "pre_ln@lr2e-05", "pre_ln@lr4e-05"]},
                compare=[["keel", "pre_ln"], ["keel@lr4e-05", "keel@lr1e-05"], ["keel_best", "pre_ln_best"]])
    results = declared.run(declared.read(doc, "test"), tmp_path, "test")
    tests = results["tests"]
    assert [(t["cell"], t["arms"]) for t in tests] == [
        ("lr1e-05", ["keel", "pre_ln"]), ("lr2e-05", ["keel", "pre_ln"]), ("lr4e-05", ["keel", "pre_ln"]),
        ("", ["keel@lr4e-05", "keel@lr1e-05"]), ("", ["keel@lr2e-05", "pre_ln@lr1e-05"])]
    report = {(a, lr): [fake_point(None, a, {"optim.lr": lr}, {}, s)["report_loss"] for s in (0, 1, 2)]
              for a in best for lr in (1e-5, 2e-5, 4e-5)}
    pairs = [(("keel", lr), ("pre_ln", lr)) for lr in (1e-5, 2e-5, 4e-5)]
    pairs += [(("keel", 4e-5), ("keel", 1e-5)), (("keel", 2e-5), ("pre_ln", 1e-5))]
    for t, (a, b) in zip(tests, pairs):
        assert t["mean"] == pytest.approx(np.mean(np.subtract(report[a], report[b])), abs=1e-12)
        assert t["p"] == pytest.approx(scipy_stats.ttest_rel(report[a], report[b]).pvalue, rel=1e-9)
    assert [t["p_holm"] for t in tests] == pytest.approx(holm_by_hand([t["p"] for t in tests]), rel=1e-12)
    assert results["picks"][""]["keel_best"]["arm"] == "keel@lr2e-05"
    assert "| - | keel_best (keel@lr2e-05) - pre_ln_best (pre_ln@lr1e-05) |" in (tmp_path / "report.md").read_text()


@pytest.mark.slow  # over a second in tests/durations.json
def test_a_tune_step_of_some_arms_grows_through_written_out_values_and_may_give_ties_to_the_high_value(
        tmp_path, monkeypatch):
    """Rule 21's search on written-out losses: every arm's LR; then Post-LN's warm-up alone at its LR, every warm-up
    scoring the same, so ties go to the longest: the grid's top edge, grown through the written-out value above it (5)
    and a bound there; then Post-LN's LR again, at warm-up 5. Keel keeps the base warm-up and runs no other."""
    from keel.experiments import declared

    ran = []

    def fake_point(study, arm, cell, hp, seed):
        lr, wu = hp["optim.lr"], hp["optim.warmup_steps"]
        ran.append((arm, lr, wu))
        return {"lr": lr, "seed": seed, "diverged": False, "select_loss": 1.0 + abs(math.log(lr / 2e-5)),
                "report_loss": 1.0 + 0.01 * seed + 0.1 * (arm == "keel")}
    monkeypatch.setattr(declared, "point", fake_point)
    doc = study(axes={}, arms={"keel": {"model.scheme": "keel"}, "post_ln": {"model.scheme": "post_ln"}},
                tune=[{"field": "optim.lr", "grid": [1e-5, 2e-5, 4e-5], "grow": 1},
                      {"field": "optim.warmup_steps", "grid": [2, 3, 4], "grow": 1, "arms": ["post_ln"],
                       "below": [1], "above": [5], "ties": "high"},
                      {"field": "optim.lr", "grid": [1e-5, 2e-5, 4e-5], "grow": 1, "arms": ["post_ln"]}])
    results = declared.run(declared.read(doc, "test"), tmp_path, "test")
    choices = results["choices"][""]
    assert choices["keel"]["hp"] == {"optim.lr": 2e-5, "optim.warmup_steps": 2}
    assert {wu for a, lr, wu in ran if a == "keel"} == {2} and len(choices["keel"]["grids"]) == 1
    assert choices["post_ln"]["hp"] == {"optim.lr": 2e-5, "optim.warmup_steps": 5}
    first, warmup, again = choices["post_ln"]["grids"]
    assert warmup == {"field": "optim.warmup_steps", "values": [2, 3, 4, 5], "added": [5], "bound": "high"}
    assert sorted({wu for a, lr, wu in ran if a == "post_ln" and lr == 2e-5}) == [2, 3, 4, 5]
    assert {lr for a, lr, wu in ran if a == "post_ln" and wu == 5} == {1e-5, 2e-5, 4e-5} == set(again["values"])


def test_a_grid_grown_past_what_its_field_allows_is_a_bound_not_an_error(tmp_path, monkeypatch):
    """beta1 from [0.5, 0.9], the higher always better: the edge's factor would grow it to 1.62, which AdamW's beta1
    (< 1) refuses; the search stops there with 0.9 a bound at the high edge, and no point runs at 1.62."""
    from keel.experiments import declared

    ran = []

    def fake_point(study, arm, cell, hp, seed):
        study.config({**study.arms[arm], **cell, **hp})  # as a real point: a value the config refuses raises
        ran.append(hp["optim.beta1"])
        return {"seed": seed, "diverged": False, "select_loss": -hp["optim.beta1"], "report_loss": 1.0 + 0.1 * seed}
    monkeypatch.setattr(declared, "point", fake_point)
    doc = study(axes={}, tune=[{"field": "optim.beta1", "grid": [0.5, 0.9], "grow": 2}])
    results = declared.run(declared.read(doc, "test"), tmp_path, "test")
    assert set(ran) == {0.5, 0.9}
    assert results["choices"][""]["keel"]["grids"] == [{"field": "optim.beta1", "values": [0.5, 0.9], "added": [],
                                                        "bound": "high"}]
    assert "optim.beta1 from 0.5, 0.9; bound at the high edge" in (tmp_path / "report.md").read_text()


def test_an_arm_a_tune_step_leaves_out_may_set_that_field_and_keeps_it(tmp_path, monkeypatch):
    """Keel's LR tuned, Pre-LN at the LR its arm sets (3e-5, no step tunes it there): Pre-LN runs at 3e-5 alone."""
    from keel.experiments import declared

    ran = []

    def fake_point(study, arm, cell, hp, seed):
        ran.append((arm, hp["optim.lr"]))
        return {"seed": seed, "diverged": False, "select_loss": 1.0 + abs(math.log(hp["optim.lr"] / 2e-5)),
                "report_loss": 1.0 + 0.1 * seed}
    monkeypatch.setattr(declared, "point", fake_point)
    doc = study(axes={}, arms={"keel": {}, "pre_ln": {"model.scheme": "pre_ln", "optim.lr": 3e-5}},
                tune=[{"field": "optim.lr", "grid": [1e-5, 2e-5, 4e-5], "grow": 1, "arms": ["keel"]}])
    results = declared.run(declared.read(doc, "test"), tmp_path, "test")
    assert {lr for a, lr in ran if a == "pre_ln"} == {3e-5} and {lr for a, lr in ran if a == "keel"} == {1e-5, 2e-5,
                                                                                                        4e-5}
    assert results["choices"][""]["pre_ln"] == {"hp": {"optim.lr": 3e-5}, "grids": []}


def test_a_field_of_one_scheme_is_tuned_for_the_arms_of_that_scheme_alone(tmp_path, monkeypatch):
    """Keel's alpha tuned (arms: [keel]) beside Pre-LN, which has no alpha, and a Keel arm left at alpha = L: the
    study reads, Pre-LN's and keel_L's points carry no alpha (neither None nor 'L' in a key) and run as their arms."""
    from keel.experiments import declared

    ran = []

    def fake_point(study, arm, cell, hp, seed):
        study.config({**study.arms[arm], **cell, **hp})  # as a real point: a field its scheme has not would raise
        ran.append((arm, hp))
        return {"seed": seed, "diverged": False, "select_loss": abs(hp.get("model.alpha", 2) - 2),
                "report_loss": 1.0 + 0.1 * seed + 0.01 * len(arm)}
    monkeypatch.setattr(declared, "point", fake_point)
    doc = study(axes={}, arms={"keel": {}, "keel_L": {"model.alpha": "L"}, "keel_2": {"model.alpha": "2"},
                               "pre_ln": {"model.scheme": "pre_ln"}},
                tune=[{"field": "model.alpha", "grid": [1, 2, 4], "grow": 1, "arms": ["keel"]}])
    results = declared.run(declared.read(doc, "test"), tmp_path, "test")
    assert {arm: c["hp"] for arm, c in results["choices"][""].items()} == {"keel": {"model.alpha": 2.0}, "keel_L": {},
                                                                          "keel_2": {}, "pre_ln": {}}
    assert {(a, tuple(hp.items())) for a, hp in ran if a != "keel"} == {("keel_L", ()), ("keel_2", ()), ("pre_ln", ())}
    assert {declared.key(a, {}, hp, 0) for a, hp in ran if a != "keel"} == {"keel_L-seed0", "keel_2-seed0",
                                                                            "pre_ln-seed0"}


@pytest.mark.slow  # over a CPU second in the fast tier
def test_a_side_that_is_a_pair_is_its_difference_seed_by_seed(tmp_path, monkeypatch):
    """(keel - pre_ln at 2 blocks) - (at 1 block), per seed: the growth of a gap with depth, one test across cells,
    Holm over it and the per-cell tests."""
    from keel.experiments import declared

    loss = {("keel", 1): [1.0, 1.1, 1.3], ("pre_ln", 1): [1.1, 1.2, 1.35], ("keel", 2): [0.9, 1.0, 1.1],
            ("pre_ln", 2): [1.2, 1.25, 1.5]}

    def fake_point(study, arm, cell, hp, seed):
        return {"seed": seed, "diverged": False, "select_loss": 1.0,
                "report_loss": loss[arm, cell["model.n_blocks"]][seed]}
    monkeypatch.setattr(declared, "point", fake_point)
    doc = study(arms={"keel": {"model.scheme": "keel"}, "pre_ln": {"model.scheme": "pre_ln"}}, tune=[],
                compare=[["keel", "pre_ln"], [["keel@n_blocks2", "pre_ln@n_blocks2"],
                                              ["keel@n_blocks1", "pre_ln@n_blocks1"]]])
    results = declared.run(declared.read(doc, "test"), tmp_path, "test")
    growth = results["tests"][-1]
    a = np.subtract(loss["keel", 2], loss["pre_ln", 2])
    b = np.subtract(loss["keel", 1], loss["pre_ln", 1])
    assert growth["cell"] == "" and growth["mean"] == pytest.approx(np.mean(a - b), abs=1e-12)
    assert growth["p"] == pytest.approx(scipy_stats.ttest_rel(a, b).pvalue, rel=1e-9)
    assert [t["p_holm"] for t in results["tests"]] == pytest.approx(
        holm_by_hand([t["p"] for t in results["tests"]]), rel=1e-12)
    assert "| - | (keel@n_blocks2 - pre_ln@n_blocks2) - (keel@n_blocks1 - pre_ln@n_blocks1) |" in (
        tmp_path / "report.md").read_text()


def test_crossing_compares_the_seed_mean_curves_early_and_where_one_stays_below(tmp_path, monkeypatch):
    """Curves written out (evaluations at steps 9, 19, ..., 99): keel starts above pre_ln by more than either arm's
    seed SD and stays below it from step 70 on; against post_ln it is within the seed SD at 10% of the run (a tie)
    and never stays below. Each number worked out by hand from the curves."""
    from keel.experiments import declared

    steps = list(range(9, 100, 10))
    base = np.linspace(3.0, 2.0, 10)
    keel = base + np.array([0.3, 0.3, 0.2, 0.1, 0.05, 0.0, -0.05, -0.1, -0.1, -0.1])
    spread = {0: -0.01, 1: 0.0, 2: 0.01}
    curve = {"keel": keel, "pre_ln": base, "post_ln": keel + np.array([-0.005, 0, 0.1, 0, 0, 0, 0, 0, 0, -0.05])}

    def fake_point(study, arm, cell, hp, seed):
        return {"seed": seed, "diverged": False, "select_loss": 1.0, "report_loss": float(curve[arm][-1]) + seed,
                "evals": {"step": steps, "loss": list(curve[arm] + spread[seed] * (arm != "post_ln"))}}
    monkeypatch.setattr(declared, "point", fake_point)
    doc = study(axes={}, tune=[], curve_every=10, crossing=0.1, compare=[["keel", "pre_ln"], ["keel", "post_ln"]])
    results = declared.run(declared.read(doc, "test"), tmp_path, "test")
    vs_pre, vs_post = results["crossings"]
    sd = 0.01  # the seed SD of keel and pre_ln (-0.01, 0, +0.01); post_ln's is 0
    # 10% of 100 steps: the first evaluation with step + 1 >= 10 is step 9
    assert vs_pre["early_step"] == 9 and vs_pre["early_diff"] == pytest.approx(0.3) and vs_pre["starts_slower"] is True
    assert vs_pre["early_tol"] == pytest.approx(sd) and vs_pre["cross_step"] == 69  # -0.05 from the 7th evaluation on
    assert vs_pre["final_diff"] == pytest.approx(-0.1) and vs_pre["final_tol"] == pytest.approx(sd)
    assert vs_post["early_diff"] == pytest.approx(0.005) and vs_post["starts_slower"] == "tie"
    assert vs_post["cross_step"] is None and vs_post["final_diff"] == pytest.approx(0.05)
    report = (tmp_path / "report.md").read_text()
    assert "| - | keel vs pre_ln | 10 | +0.300 (tol 0.010) | True | 70 | -0.100 (tol 0.010) |" in report
    assert "| - | keel vs post_ln | 10 | +0.005 (tol 0.010) | tie | never | +0.050 (tol 0.010) |" in report


def test_crossing_with_an_arm_whose_every_seed_diverged_says_so(tmp_path, monkeypatch):
    """Post-LN diverged on every seed: its pair has no curve to compare, a row that says so; keel vs pre_ln as usual."""
    from keel.experiments import declared

    def fake_point(study, arm, cell, hp, seed):
        gone = arm == "post_ln"
        return {"seed": seed, "diverged": gone, "select_loss": None if gone else 1.0, "report_loss": None if gone
                else 1.0 + 0.1 * seed + 0.01 * len(arm), "evals": {"step": [4] if gone else [4, 9],
                                                                    "loss": [9.0] if gone else [2.0, 1.0 + seed]}}
    monkeypatch.setattr(declared, "point", fake_point)
    doc = study(axes={}, tune=[], curve_every=5, crossing=0.1, compare=[["keel", "pre_ln"], ["keel", "post_ln"]])
    results = declared.run(declared.read(doc, "test"), tmp_path, "test")
    assert results["crossings"][1] == {"cell": "", "pair": ["keel", "post_ln"], "no_curve": ["post_ln"]}
    report = (tmp_path / "report.md").read_text()
    assert "| - | keel vs post_ln | - | no curve: every seed of post_ln diverged |" in report


def ramp(**fields) -> dict:
    """A max-LR study of TINY (its warm-up left to the ramp): keel, pre_ln and pre_ln without clipping."""
    base = {k: v for k, v in TINY.items() if k != "optim"} | {"optim": {"lr": 0.5}}
    return study(measure="max_lr", base=base, tune=[], arms={"keel": {"model.scheme": "keel"}, "pre_ln": {
        "model.scheme": "pre_ln"}, "pre_ln_noclip": {"model.scheme": "pre_ln", "optim.grad_clip": 0.0}},
        compare=[["keel", "pre_ln"], ["pre_ln_noclip", "pre_ln"]]) | fields


@pytest.mark.slow  # over a CPU second in the fast tier
def test_a_max_lr_study_takes_each_max_lr_where_its_curve_fails_and_tests_them(tmp_path, monkeypatch):
    """Curves built to collapse at a known evaluation (rules confirm 4, window 1: no lag): the max LR is the LR of the
    evaluation before, a curve that never fails has the peak; the compare pairs are t-tests of the log max LRs
    (scipy's) per cell, Holm over them all, the verdict naming the higher arm."""
    from keel.experiments import declared

    lrs = [0.015 * (k + 1) for k in range(33)]  # the LR at each evaluation, as a point records it
    fails = {("keel", 1): [None, 25, 27], ("pre_ln", 1): [10, 12, 15], ("pre_ln_noclip", 1): [11, 12, 14],
             ("keel", 2): [20, 22, 21], ("pre_ln", 2): [8, 9, 11], ("pre_ln_noclip", 2): [8, 10, 11]}

    def fake_point(study, arm, cell, hp, seed):
        at = fails[arm, cell["model.n_blocks"]][seed]
        loss = [2.0] * 33 if at is None else [2.0] * at + [3.3] * (33 - at)
        return {"seed": seed, "depth": 2 * cell["model.n_blocks"], "unigram": 3.3,
                "evals": {"step": list(range(33)), "lr": lrs, "loss": loss}}
    monkeypatch.setattr(declared, "point", fake_point)
    doc = ramp(max_lr={"rules": {"confirm": 4, "window": 1}, "scale": "log", "published": {"keel/pre_ln": 1.32}})
    results = declared.run(declared.read(doc, "test"), tmp_path, "test")
    max_lr = {k: [0.5 if at is None else lrs[at - 1] for at in ats] for k, ats in fails.items()}
    for (arm, blocks), want in max_lr.items():
        got = [results["verdicts"][f"{arm}-n_blocks{blocks}-seed{s}"]["max_lr"] for s in (0, 1, 2)]
        assert got == pytest.approx(want, rel=1e-12), (arm, blocks)
    tests = results["tests"]
    assert [(t["cell"], t["pair"]) for t in tests] == [(c, p) for c in ("n_blocks1", "n_blocks2")
                                                       for p in (["keel", "pre_ln"], ["pre_ln_noclip", "pre_ln"])]
    for t in tests:
        a, b = (np.log(max_lr[arm, int(t["cell"][-1])]) for arm in t["pair"])
        assert t["mean"] == pytest.approx(np.mean(a - b), abs=1e-12)
        assert t["p"] == pytest.approx(scipy_stats.ttest_rel(a, b).pvalue, rel=1e-9)
    for t, adjusted in zip(tests, holm_by_hand([t["p"] for t in tests])):
        assert t["p_holm"] == pytest.approx(adjusted, rel=1e-12)
        assert t["verdict"] == ("inconclusive" if adjusted >= 0.05 else
                                f"{t['pair'][0] if t['mean'] > 0 else t['pair'][1]} higher")
    assert tests[2]["verdict"] == "keel higher"  # 2 blocks: log ratios 0.92, 0.89, 0.65
    ratio = results["ratios"]["keel/pre_ln-n_blocks2"]
    assert ratio["ratio"] == pytest.approx(math.exp(np.mean(np.log(max_lr["keel", 2]) - np.log(max_lr["pre_ln", 2]))))
    report = (tmp_path / "report.md").read_text()
    assert "| n_blocks1 | keel | 2 | " in report and ">= 0.5 / " in report
    assert "| keel / pre_ln | n_blocks2 | 4 |" in report
    assert "![maxlr-2.png](maxlr-2.png)" in report and (tmp_path / "maxlr-4.png").stat().st_size > 0  # by sub-layers


@pytest.mark.slow
def test_a_max_lr_point_trains_on_the_ramp_and_its_study_rebuilds_from_its_points(tmp_path):
    """Real points: every evaluation's LR is the ramp's, peak x (step + 1) / steps; each verdict's max LR is the LR of
    the evaluation before its failure in the point file (or the peak); clipping is off in the noclip arm only; the
    report rebuilds from the points without training."""
    path = write(tmp_path, ramp(base={**ramp()["base"], "model": {**TINY["model"], "n_blocks": 1},
                                      "run": {**TINY["run"], "steps": 30}}, axes={}, seeds=[0, 1],
                                max_lr={"rules": {"confirm": 4, "window": 1}}))
    assert main(["sweep", str(path)]) == 0
    out = path.parent
    results = json.loads((out / "results.json").read_text())["results"]
    points = {k: store.load(out / "points", k) for k in store.keys(out / "points")}
    assert sorted(points) == sorted(f"{a}-seed{s}" for a in ("keel", "pre_ln", "pre_ln_noclip") for s in (0, 1))
    for k, p in points.items():
        e, v = p["evals"], results["verdicts"][k]
        assert e["lr"] == pytest.approx([0.5 * (step + 1) / 30 for step in e["step"]], rel=1e-12)
        assert e["step"][:len(e["step"]) - v["failed"]] == list(range(1, 30, 2))[:len(e["step"]) - v["failed"]]
        assert v["max_lr"] == (e["lr"][e["step"].index(v["at_step"]) - 1] if v["failed"] else 0.5)
        assert p["clip"] == (0.0 if k.startswith("pre_ln_noclip") else 1.0) and p["depth"] == 2
    before = (out / "results.json").read_text()
    assert main(["sweep", str(path), "--report-only"]) == 0
    assert json.loads((out / "results.json").read_text())["results"] == json.loads(before)["results"]


def test_a_redundancy_study_summarises_each_points_deltas_and_tests_the_parts_it_names(tmp_path, monkeypatch):
    """Deltas written out for 8 sub-layers (lower half: 2..3, upper half: 4..7): each summary is its mean worked out
    by hand, each compare pair a paired t-test of the parts it names (scipy's), Holm over them."""
    from keel.experiments import declared

    def deltas(arm: str, seed: int, mode: str) -> list[float]:
        lift = {"keel": 0.001 * seed * (seed + 1), "pre_ln": 0.02 + 0.004 * seed}[arm] + 0.003 * (mode == "branch")
        return [0.5 + seed, 0.2, 0.04 + lift, 0.02, 0.01, 0.01 + lift, 0.0, 0.02]

    def fake_point(study, arm, cell, hp, seed):
        return {"scheme": arm, "seed": seed, "base_loss": 2.0 + seed / 10, "train_loss": 1.9, "diverged": False,
                "delta_loss": {m: deltas(arm, seed, m) for m in ("sublayer", "branch")}}
    monkeypatch.setattr(declared, "point", fake_point)
    pairs = [["keel.sublayer.upper", "keel.sublayer.lower"], ["keel.branch.lower", "pre_ln.branch.lower"]]
    doc = study(measure="redundancy", axes={}, tune=[], base=TINY | {"model": {**TINY["model"], "n_blocks": 4}},
                arms={"pre_ln": {"model.scheme": "pre_ln"}, "keel": {"model.scheme": "keel"}}, compare=pairs)
    results = declared.run(declared.read(doc, "test"), tmp_path, "test")
    part = {"lower": lambda d: (d[2] + d[3]) / 2, "upper": lambda d: (d[4] + d[5] + d[6] + d[7]) / 4,
            "0": lambda d: d[0], "1": lambda d: d[1]}
    for arm in ("keel", "pre_ln"):
        for mode in ("sublayer", "branch"):
            for name, f in part.items():
                got = [s[name] for s in results["summary"][f"{arm}-{mode}"]]
                assert got == pytest.approx([f(deltas(arm, s, mode)) for s in (0, 1, 2)], abs=1e-15)
    side = lambda name: [part[name.split(".")[2]](deltas(*name.split(".")[:1], s, name.split(".")[1])) for s in
                         (0, 1, 2)]
    for t, (a, b) in zip(results["tests"], pairs):
        assert t["pair"] == [a, b] and t["n"] == 3
        assert t["mean"] == pytest.approx(np.mean(np.subtract(side(a), side(b))), abs=1e-12)
        assert t["p"] == pytest.approx(scipy_stats.ttest_rel(side(a), side(b)).pvalue, rel=1e-9)
    assert [t["p_holm"] for t in results["tests"]] == pytest.approx(holm_by_hand([t["p"] for t in results[
        "tests"]]), rel=1e-12)
    report = (tmp_path / "report.md").read_text()
    assert "| keel | branch | 2.100 ± 0.100 (n=3) | 1.500 ± 1.000 (n=3) | 0.200 ± 0.000 (n=3) |" in report
    assert "Models: 8 sub-layers, d=32, trained 6 steps x 4x32 tokens at LR 0.003, seeds [0, 1, 2]." in report


@pytest.mark.slow
def test_a_redundancy_point_takes_out_each_sub_layer_both_ways(tmp_path):
    """Real points: Pre-LN has no norm_out and alpha = 1, so taking out its whole sub-layer and switching off its
    branch are one operation (equal deltas); Keel's differ (its norm_out stays with the branch off); one delta per
    sub-layer; the report rebuilds from the points without training."""
    doc = study(measure="redundancy", axes={}, tune=[], seeds=[0, 1], base=TINY | {"model": {**TINY["model"],
                "n_blocks": 2}}, arms={"pre_ln": {"model.scheme": "pre_ln"}, "keel": {"model.scheme": "keel"}})
    path = write(tmp_path, doc)
    assert main(["sweep", str(path)]) == 0
    points = {k: store.load(path.parent / "points", k) for k in store.keys(path.parent / "points")}
    assert sorted(points) == ["keel-seed0", "keel-seed1", "pre_ln-seed0", "pre_ln-seed1"]
    for k, p in points.items():
        d = p["delta_loss"]
        assert len(d["sublayer"]) == len(d["branch"]) == 4 and all(map(math.isfinite, d["sublayer"]))
        assert (d["sublayer"] == d["branch"]) == k.startswith("pre_ln"), k
    before = json.loads((path.parent / "results.json").read_text())["results"]
    assert main(["sweep", str(path), "--report-only"]) == 0
    assert json.loads((path.parent / "results.json").read_text())["results"] == before
