"""The downstream measurement (keel.experiments.downstream, results/downstream/study.yaml, rule 18): the report's
numbers recomputed from the points' JSON by other means (numpy's interpolation, scipy's paired t-test), and the
study file's runs are the committed depth-long runs."""

import argparse
import ast
import calendar
import configparser
import csv
import dataclasses
import difflib
import fractions
import gettext
import inspect
import json
import pathlib
import shlex
import string
import textwrap

import numpy as np
import pytest
import yaml
from scipy import stats as scipy_stats

from keel.experiments import declared, store
from keel.experiments.common import point_config, train_curve
from keel.experiments.downstream import CHANCE_MARGIN, score_at


def test_score_at_reads_the_curve_where_the_loss_first_reaches_the_level():
    losses, scores = [5.0, 3.0, 2.0, 1.5, 1.7, 1.2], [0.25, 0.3, 0.5, 0.6, 0.1, 0.7]
    assert score_at(losses, scores, 2.5) == pytest.approx(0.4)  # halfway between (3.0, 0.3) and (2.0, 0.5)
    assert score_at(losses, scores, 1.6) == pytest.approx(0.58)  # the first crossing, not the bump at 1.7
    assert score_at(losses, scores, 2.0) == pytest.approx(0.5)  # exactly at an evaluation
    assert score_at(losses, scores, 5.0) == 0.25
    assert score_at(losses, scores, 6.0) is None  # started below the level
    assert score_at(losses, scores, 1.0) is None  # never reached


def independent_score_at(losses, scores, level):
    """np.interp on the two evaluations around the first one at or below `level`."""
    below = np.flatnonzero(np.asarray(losses) <= level)
    k = int(below[0])
    if k == 0:
        return scores[0]
    return float(np.interp(level, [losses[k], losses[k - 1]], [scores[k], scores[k - 1]]))


STUDY = pathlib.Path(__file__).parent.parent / "results" / "downstream" / "study.yaml"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The study at smoke size (keel.experiments.declared.smoke: 6 steps, seeds 0 and 1) on a directory of
    standard-library modules (a quarter of them validation), its tasks scored at steps 0, 4 and 6 on 8 items each."""
    root = tmp_path_factory.mktemp("downstream")
    tree = root / "tree"
    tree.mkdir()
    for m in (argparse, ast, calendar, configparser, csv, dataclasses, difflib, fractions, gettext, json, pathlib,
              shlex, string, textwrap):
        (tree / f"{m.__name__.replace('.', '_')}.py").write_text(inspect.getsource(m))
    doc = yaml.safe_load(STUDY.read_text())
    doc["base"]["data"] = {"source": str(tree), "val_fraction": 0.25, "cache_dir": str(root / "cache")}
    doc["base"]["run"] |= {"eval_tasks_every": 4, "eval_tasks_items": 8}
    study = declared.smoke(declared.read(doc, str(STUDY)))
    out = root / "out"
    declared.run(study, out, "keel experiment downstream --quick", "downstream")
    return study, out, store.read_results(out)["results"]


@pytest.mark.slow
def test_quick_points_are_every_arm_and_seed_with_curves(quick):
    study, out, res = quick
    arms = [f"{s}-{d}" for d in (32, 64) for s in ("post_ln", "pre_ln", "keel")] + ["wide-pre_ln"]  # written out
    assert set(res["points"]) == {f"{a}-seed{s}" for a in arms for s in (0, 1)}
    assert set(store.keys(out / "points")) == set(res["points"])
    for p in res["points"].values():
        c = p["curve"]
        assert c["step"] == [0, 4, 6]
        assert set(c["acc"]) == {"brackets", "indent", "identifiers", "next_line"}
        assert c["score"] == pytest.approx([np.mean([c["acc"][t][i] for t in c["acc"]]) for i in range(3)])
        # 8 items per task: every accuracy is a count over 8
        assert all(abs(a * 8 - round(a * 8)) < 1e-9 for accs in c["acc"].values() for a in accs)
    assert "![downstream.png](downstream.png)" in (out / "report.md").read_text()


@pytest.mark.slow
def test_equal_loss_comparisons_match_an_independent_recomputation(quick):
    study, out, res = quick
    report = (out / "report.md").read_text()
    points = res["points"]
    assert set(res["equal_loss"]) == {f"keel-{d} vs {o}-{d}" for d in (32, 64) for o in ("pre_ln", "post_ln")}
    tested = 0
    for name, c in {**res["equal_loss"], **res["deep_vs_wide_equal_loss"]}.items():
        a, b = name.split(" vs ")
        runs = {arm: [points[f"{arm}-seed{s}"] for s in (0, 1)] for arm in (a, b)}
        level = max(p["curve"]["loss"][-1] for arm in (a, b) for p in runs[arm])
        assert c["level"] == pytest.approx(level)
        at = {arm: [independent_score_at(p["curve"]["loss"], p["curve"]["score"], level) for p in runs[arm]]
              for arm in (a, b)}
        assert c["score_at_level"][a] == pytest.approx(at[a]) and c["score_at_level"][b] == pytest.approx(at[b])
        # the run whose final loss is the level is read at its last evaluation: its final score
        top = max((p for arm in (a, b) for p in runs[arm]), key=lambda p: p["curve"]["loss"][-1])
        arm = a if top in runs[a] else b
        assert c["score_at_level"][arm][runs[arm].index(top)] == pytest.approx(top["curve"]["score"][-1])
        diffs = np.subtract(at[a], at[b])
        assert c["test"]["mean"] == pytest.approx(diffs.mean())
        if np.ptp(diffs) > 0:
            tested += 1
            p = scipy_stats.ttest_rel(at[a], at[b]).pvalue
            assert c["test"]["p"] == pytest.approx(p, rel=1e-6)
            assert f"p={p:.2g}" in report
            chance_moot = all(np.mean(at[x]) < 0.25 + CHANCE_MARGIN for x in (a, b))
            expected = ("inconclusive (both at chance)" if chance_moot else "inconclusive" if p >= 0.05
                        else "agrees (scores higher)" if diffs.mean() > 0 else "disagrees (scores lower)")
            assert c["verdict"] == expected
    assert tested >= 2  # the p and verdict checks above ran, not only the means
    # rule 18 gives the deep-vs-wide equal-loss pairs no verdict: the report must not show one for them
    table = report[report.index("A - B at l* [95% CI], p | verdict |"):].split("\n\n")[0]  # the equal-loss table
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if " vs " in line}
    assert all(rows[name].endswith("| (reported, no verdict) |") for name in res["deep_vs_wide_equal_loss"]), rows
    assert all(rows[name].endswith(f"| {c['verdict']} |") for name, c in res["equal_loss"].items())


@pytest.mark.slow
def test_deep_vs_wide_rankings_match_scipy(quick):
    study, out, res = quick
    points = res["points"]
    pairs = res["deep_vs_wide"]["pairs"]
    assert set(pairs) == {"keel-32 vs pre_ln-32", "keel-32 vs wide-pre_ln", "pre_ln-32 vs wide-pre_ln"}
    reversed_any = False
    for name, v in pairs.items():
        a, b = name.split(" vs ")
        for what, sign in (("loss", -1), ("score", 1)):
            xa = [points[f"{a}-seed{s}"]["curve"][what][-1] for s in (0, 1)]
            xb = [points[f"{b}-seed{s}"]["curve"][what][-1] for s in (0, 1)]
            p = scipy_stats.ttest_rel(xa, xb).pvalue if np.ptp(np.subtract(xa, xb)) > 0 else None
            assert (v[what]["p"] is None) == (p is None) and (p is None or v[what]["p"] == pytest.approx(p))
            rank = 0 if p is None or p >= 0.05 else sign * int(np.sign(np.mean(np.subtract(xa, xb))))
            assert v[f"by_{what}"] == rank
        reversed_any |= v["by_loss"] * v["by_score"] == -1
    # rule 18 (b), written out: a reversed pair agrees; else every pair the loss separates ranked alike by the score
    # disagrees; else inconclusive
    separated = [v for v in pairs.values() if v["by_loss"] != 0]
    expected = ("agrees (the rankings differ)" if reversed_any else
                "disagrees (the probe ranking follows the loss ranking)"
                if separated and all(v["by_score"] == v["by_loss"] for v in separated) else "inconclusive")
    assert res["deep_vs_wide"]["verdict"] == expected


@pytest.mark.slow
def test_the_study_files_runs_are_the_committed_depth_long_runs():
    """Keel at 32 sub-layers, seed 0, as the study file configures it, logs the first losses that
    results/depth-long-32 committed for the same run (same LR, steps, warm-up, batches): the LRs are the committed
    sweeps' and the runs are comparable with them."""
    study = declared.read(yaml.safe_load(STUDY.read_text()), str(STUDY))
    c = study.config(study.arms["keel-32"])
    assert c.optim.lr == 3e-3 and study.config(study.arms["pre_ln-64"]).optim.lr == 1e-3
    assert study.seeds == [0, 1, 2, 3, 4]
    recorded = store.load(STUDY.parent.parent / "depth-long-32" / "points", "keel-seed0")
    curve, _ = train_curve(point_config(c, c.model, 0), eval_batches=0, on_step=lambda i, model, result: i == 3)
    assert curve.losses == pytest.approx(recorded["losses"][:4], rel=1e-5)
