"""keel experiment downstream-end: the step-count search on a made-up loss, the verdict on made-up
per-seed values, the reference arm read from the committed runs, and the --quick run's numbers recomputed from its
points' JSON by other means (scipy's paired t-test, the search's walk written out)."""

import inspect
import shutil
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from keel.cli.experiment import build
from keel.errors import ConfigError
from keel.experiments import store
from keel_studies import EXPERIMENTS
from keel_studies.downstream_end import DownstreamEndConfig, judge, reference_points, search

COMMITTED = Path(__file__).parent.parent / "results" / "downstream"


def counted(loss):
    """`loss` that records each step count it is asked for."""
    asked = []

    def f(steps):
        asked.append(steps)
        return loss(steps)
    return f, asked


def test_search_from_above_walks_up_to_the_bracket_and_picks_the_nearer():
    # 1000 / S on the grid round(1250 * 1.25^k): 1250 0.8, 1562 0.640, 1953 0.512, 2441 0.410, 3052 0.328
    f, asked = counted(lambda s: 1000 / s)
    found = search(f, 0.5, 1250, 1.25, 5)
    assert asked == [1250, 1562, 1953, 2441] and found["bracket"] == [1953, 2441] and found["bound"] is None
    assert found["chosen"] == 1953  # 0.512 is 0.012 from the target, 0.410 is 0.090
    assert search(lambda s: 1000 / s, 1000 / 2400, 1250, 1.25, 5)["chosen"] == 2441  # 0.417: now the lower is nearer


def test_search_from_below_walks_down_to_the_bracket():
    # 1250 0.8, 1000 1.0, 800 1.25, 640 1.5625; target 1.4286: 640 is 0.134 away, 800 0.179
    f, asked = counted(lambda s: 1000 / s)
    found = search(f, 1000 / 700, 1250, 1.25, 5)
    assert asked == [1250, 1000, 800, 640] and found["bracket"] == [640, 800] and found["chosen"] == 640
    exact = search(lambda s: 1000 / s, 0.8, 1250, 1.25, 5)  # at the target counts as below: one step down
    assert exact["evaluated"] == [[1250, 0.8], [1000, 1.0]] and exact["chosen"] == 1250


def test_search_stops_at_search_max_and_reports_the_bound():
    f, asked = counted(lambda s: 1000 / s)
    found = search(f, 0.2, 1250, 1.25, 5)  # never reached within 5 values
    assert asked == [1250, 1562, 1953, 2441, 3052]
    assert found["bound"] == "high" and found["bracket"] is None and found["chosen"] == 3052
    low = search(lambda s: 1000 / s, 10.0, 1250, 1.25, 3)
    assert [s for s, _ in low["evaluated"]] == [1250, 1000, 800] and (low["bound"], low["chosen"]) == ("low", 800)
    # at small counts rounding repeats grid values (2, 1.6 -> 2): the next distinct one, and none below 1 step
    tiny = search(lambda s: 1000 / s, 1e4, 2, 1.25, 5)
    assert [s for s, _ in tiny["evaluated"]] == [2, 1] and tiny["bound"] == "low"


def test_search_halves_the_bracket_until_a_midpoint_is_within_tolerance():
    # rule 29, on 1000 / S with target 1000 / 1420 = 0.70423: the grid brackets it with 1250 (0.8) and 1562 (0.640);
    # midpoint 1406 (0.71124, above, 0.0070 away) replaces 1250; then 1484 (0.67385, 0.030 away) replaces 1562;
    # then 1445 (0.69204, 0.012 away) replaces 1484; then 1426 (0.70126, 0.0030 away): within 0.005, stop
    f, asked = counted(lambda s: 1000 / s)
    found = search(f, 1000 / 1420, 1250, 1.25, 5, bisect=6, tolerance=0.005)
    assert asked == [1250, 1562, 1406, 1484, 1445, 1426]
    assert found["bracket"] == [1406, 1426] and found["chosen"] == 1426 and found["bound"] is None
    # at most `bisect` halvings, then the nearer of the pair left; with tolerance 0.01 the first midpoint ends it
    assert [s for s, _ in search(lambda s: 1000 / s, 1000 / 1420, 1250, 1.25, 5, 2)["evaluated"]] == \
        [1250, 1562, 1406, 1484]
    assert search(lambda s: 1000 / s, 1000 / 1420, 1250, 1.25, 5, 2)["chosen"] == 1406
    assert [s for s, _ in search(lambda s: 1000 / s, 1000 / 1420, 1250, 1.25, 5, 5, 0.01)["evaluated"]][2:] == [1406]
    # adjacent step counts cannot be halved; a bound is never halved
    assert search(lambda s: 1000 / s, 1000 / 2.5, 2, 1.5, 5, bisect=3)["bracket"] == [2, 3]
    assert search(lambda s: 1000 / s, 0.2, 1250, 1.25, 5, bisect=3)["evaluated"][-1][0] == 3052


def test_search_a_diverged_mean_counts_as_above_the_target():
    found = search(lambda s: float("inf") if s < 1500 else 1000 / s, 0.7, 1250, 1.25, 5)
    assert found["bracket"] == [1250, 1562] and found["chosen"] == 1562


REF = {"loss": [1.80, 1.82, 1.79, 1.81, 1.80], "score": [0.40, 0.42, 0.39, 0.41, 0.40]}


def arm_with(d_loss, d_score, ref=REF):
    return {"loss": list(np.add(ref["loss"], d_loss)), "score": list(np.add(ref["score"], d_score))}


FLAT = [0.004, -0.006, 0.002, -0.001, 0.003]  # mean 0.0004, p = 0.84


@pytest.mark.parametrize("d_loss, d_score, ref_shift, verdict", [
    (FLAT, [0.05, 0.06, 0.055, 0.05, 0.06], 0.0, "agrees (scores higher)"),
    (FLAT, [-0.05, -0.06, -0.055, -0.05, -0.06], 0.0, "disagrees (scores lower)"),
    (FLAT, [0.05, -0.04, 0.03, -0.02, 0.01], 0.0, "inconclusive"),
    # raw p = 0.049, Holm over the two tests lifts it to 0.097
    (FLAT, [0.0, 0.05, 0.01, 0.04, 0.03], 0.0, "inconclusive"),
    # a small but significant loss gap (mean 0.011, p = 1e-5), and a large one that is not (mean 0.04, p = 0.17)
    ([0.010, 0.011, 0.012, 0.010, 0.011], [0.05, 0.06, 0.055, 0.05, 0.06], 0.0, "inconclusive (final losses differ)"),
    ([0.1, -0.02, 0.08, -0.01, 0.05], [0.05, 0.06, 0.055, 0.05, 0.06], 0.0, "inconclusive (final losses differ)"),
    # both arms' mean scores under chance + 0.05 = 0.30 (0.234 and 0.289), though they differ significantly
    (FLAT, [0.05, 0.06, 0.055, 0.05, 0.06], -0.17, "inconclusive (both at chance)"),
])
def test_judge(d_loss, d_score, ref_shift, verdict):
    ref = REF | {"score": list(np.add(REF["score"], ref_shift))}
    arm = arm_with(d_loss, d_score, ref)
    res = judge(DownstreamEndConfig(), arm, ref, chance=0.25)
    assert res["verdict"] == verdict
    p = {what: scipy_stats.ttest_rel(arm[what], ref[what]).pvalue for what in ("loss", "score")}
    assert res["loss"]["p"] == pytest.approx(p["loss"]) and res["score"]["p"] == pytest.approx(p["score"])
    lo, hi = sorted(p.values())  # Holm over two: the smaller p doubled, the larger at least that
    holm = {w: min(1, 2 * lo) if v == lo else max(min(1, 2 * lo), hi) for w, v in p.items()}
    assert {w: res[w]["p_holm"] for w in p} == pytest.approx(holm)
    assert res["score"]["mean"] == pytest.approx(np.mean(d_score))


def test_the_default_reference_is_the_committed_pre_ln_runs():
    cfg = build("downstream-end", False, [])
    assert (cfg.arm, cfg.reference, cfg.lrs["keel-64"], cfg.lrs["pre_ln-64"]) == ("keel-64", "pre_ln-64", 3e-3, 1e-3)
    points = reference_points(cfg)
    files = [k for k in store.keys(COMMITTED / "points") if k.startswith("pre_ln-64-seed")]  # the study file's keys
    assert sorted(points) == [f"pre_ln-64-lr0.001-seed{s}" for s in range(5)] and len(files) == 5
    assert all(p["curve"]["step"][-1] == cfg.run.steps for p in points.values())  # read at the end of their run
    # trained with another warm-up than this config's: not this config's reference
    with pytest.raises(ConfigError, match="trains pre_ln-64 with another optim.warmup_steps"):
        reference_points(build("downstream-end", False, ["optim.warmup_steps=50"]))


def test_a_missing_reference_point_is_one_error_naming_it_before_any_training(tmp_path):
    ref = tmp_path / "ref"
    (ref / "points").mkdir(parents=True)
    shutil.copy(COMMITTED / "study.yaml", ref)
    for s in range(4):  # seed 4 missing
        shutil.copy(store.path_of(COMMITTED / "points", f"pre_ln-64-seed{s}"), ref / "points")
    cfg = build("downstream-end", False, [f"reference_dir={ref}"])
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConfigError) as err:
        EXPERIMENTS["downstream-end"][1](cfg, out, "")
    assert str(ref / "points" / f"pre_ln-64-seed4{store.SUFFIX}") in str(err.value)
    assert "seed3" not in str(err.value) and list(out.iterdir()) == []


def test_the_config_refuses_what_it_does_not_train():
    assert build("downstream-end", False, ["reference_dir=null"]).reference_dir is None
    with pytest.raises(ValueError, match="depths: not used here"):
        build("downstream-end", False, ["depths=[32]"])
    with pytest.raises(ValueError, match="set per point from arm and reference"):
        build("downstream-end", False, ["model.n_blocks=4"])
    with pytest.raises(ValueError, match="lrs: no LR for post_ln-16"):
        EXPERIMENTS["downstream-end"][1](build("downstream-end", True, ["arm=post_ln-16"]), None, "")
    with pytest.raises(ValueError, match="search_seeds"):
        EXPERIMENTS["downstream-end"][1](build("downstream-end", True, ["search_seeds=[0]"]), None, "")


@pytest.mark.slow
def test_quick_run_matches_an_independent_recomputation(tmp_path):
    import argparse

    (tmp_path / "text.txt").write_text(inspect.getsource(argparse) * 2)
    # the one-file corpus has no second document for identifiers/next_line
    cfg = build("downstream-end", True, [f"data.source={tmp_path / 'text.txt'}", f"data.cache_dir={tmp_path / 'c'}",
                                         "run.eval_tasks=[brackets,indent]", "model.d_model=16"])
    out = tmp_path / "out"
    out.mkdir()
    EXPERIMENTS["downstream-end"][1](cfg, out, "keel experiment downstream-end --quick")
    res = store.read_results(out)["results"]
    points = res["points"]
    loss, score = ({k: p["curve"][w][-1] for k, p in points.items()} for w in ("loss", "score"))
    target = np.mean([loss[f"pre_ln-4-lr0.003-seed{s}"] for s in (0, 1)])
    assert res["target"] == pytest.approx(target)
    # the walk: from 6 on round(6 * 1.5^k) = ... 3, 4, 6, 9, 14, 20 ..., up while above the target, down otherwise
    grid = [1, 2, 3, 4, 6, 9, 14, 20, 30]
    evaluated = res["search"]["evaluated"]
    means = [loss[f"keel-4-steps{s}-lr0.003-seed90"] for s, _ in evaluated]  # one search seed
    assert [m for _, m in evaluated] == pytest.approx(means) and evaluated[0][0] == 6
    for (s, m), (nxt, _) in zip(evaluated, evaluated[1:]):
        assert nxt == grid[grid.index(s) + (1 if m > target else -1)]
    above = [m > target for m in means]
    if res["search"]["bound"] is None:
        assert above[-1] != above[-2] and len(set(above[:-1])) == 1
        assert res["search"]["chosen"] == min((s for s, _ in evaluated[-2:]), key=lambda s: abs(
            loss[f"keel-4-steps{s}-lr0.003-seed90"] - target))
    else:
        assert len(evaluated) == 3 and len(set(above)) == 1 and res["search"]["chosen"] == evaluated[-1][0]
    chosen = res["search"]["chosen"]
    assert points[f"keel-4-steps{chosen}-lr0.003-seed0"]["curve"]["step"][-1] == chosen  # read at its own end
    arm = {w: [v[f"keel-4-steps{chosen}-lr0.003-seed{s}"] for s in (0, 1)] for w, v in (("loss", loss),
                                                                                          ("score", score))}
    ref = {w: [v[f"pre_ln-4-lr0.003-seed{s}"] for s in (0, 1)] for w, v in (("loss", loss), ("score", score))}
    c = res["comparison"]
    p = {}
    for what in ("loss", "score"):
        d = np.subtract(arm[what], ref[what])
        assert c[what]["mean"] == pytest.approx(d.mean())
        p[what] = scipy_stats.ttest_rel(arm[what], ref[what]).pvalue if np.ptp(d) > 0 else None
        assert c[what]["p"] == (None if p[what] is None else pytest.approx(p[what]))
    ps = [v for v in p.values() if v is not None]
    holm = None if p["score"] is None else min(1, len(ps) * p["score"]) if p["score"] == min(ps) else max(
        min(1, 2 * min(ps)), p["score"])
    differ = (p["loss"] is not None and p["loss"] < 0.05) or abs(np.mean(np.subtract(arm["loss"], ref["loss"]))) > 0.02
    moot = all(np.mean(x["score"]) < 0.25 + 0.05 for x in (arm, ref))
    expected = ("inconclusive (final losses differ)" if differ else "inconclusive (both at chance)" if moot
                else "inconclusive" if holm is None or holm >= 0.05
                else "agrees (scores higher)" if np.mean(arm["score"]) > np.mean(ref["score"])
                else "disagrees (scores lower)")
    assert c["verdict"] == expected
    report = (out / "report.md").read_text()
    assert f"**{c['verdict']}**" in report and "![downstream-end.png](downstream-end.png)" in report
