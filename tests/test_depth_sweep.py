"""depth-sweep (rule 21): the warm-up ladder, the marginal rule, the analysis against scipy and a hand-written Holm,
the whole tuning and marginal logic end to end on made-up losses (no training), and (slow) the --quick run."""

import math
import threading

import numpy as np
import pytest
from scipy import stats as sps

from keel.errors import ConfigError
from keel.experiments import store
from keel_studies import depth_sweep as ds
from keel_studies import depth_sweep_report as dsr
from keel_studies.depth_sweep import DepthSweepConfig, LadderGrid, analyse, key, marginal


def test_the_warmup_grid_grows_through_the_rules_values_capped_at_the_run():
    below, above = DepthSweepConfig().warmup_ladders()
    assert (below, above) == ([30, 10], [3000, 8000])  # 9000 capped at the 8000-step run
    up = LadderGrid([100.0, 300.0, 1000.0], 2, below=below, above=above)
    assert [up.extend(lambda w: -w) for _ in range(3)] == [3000, 8000, None] and up.bound == "high"
    assert up.values == [100, 300, 1000, 3000, 8000]
    down = LadderGrid([100.0, 300.0, 1000.0], 2, below=below, above=above)
    assert [down.extend(lambda w: w) for _ in range(3)] == [30, 10, None] and down.bound == "low"
    inside = LadderGrid([100.0, 300.0, 1000.0], 2, below=below, above=above)
    near = lambda w: abs(math.log(w / 1500))  # noqa: E731 (1000 is nearer than 3000)
    assert inside.extend(near) == 3000 and inside.extend(near) is None
    assert inside.bound is None and inside.added == [3000]


def test_an_arm_diverging_everywhere_grows_towards_the_cautious_side_lower_lrs_longer_warmups():
    # a seed of Post-LN diverges at every (LR, warm-up), so every mean is +inf: ties go to the lowest LR and the longest
    # warm-up, so its LR grid grows down to its bound and its warm-up grid up (never to 30 or 10)
    search, asked = ds.tune_arm(DepthSweepConfig(), "post_ln", lambda lr, w: math.inf), []
    with pytest.raises(StopIteration) as done:
        while True:
            asked += next(search)
    got = done.value.value
    assert (got["lr"], got["warmup"]) == (0.000111111, 8000)
    assert got["lr_grid"] == {"values": [0.000111111, 0.000333333, 0.001, 0.003, 0.01],
                              "added": [0.000333333, 0.000111111], "bound": "low"}
    assert got["warmup_grid"] == {"values": [100, 300, 1000, 3000, 8000], "added": [3000, 8000], "bound": "high"}
    assert got["lr_grid_again"]["bound"] == "low"
    assert sorted({w for _, w in asked}) == [100, 300, 1000, 3000, 8000]
    # a finite score still beats +inf whichever way ties go; Keel's LR grid keeps ties at the low end
    grid = LadderGrid([100.0, 300.0, 1000.0], 2, ties="high", below=[30, 10], above=[3000, 8000])
    assert grid.choice(lambda w: 1.0 if w == 100 else math.inf) == 100
    assert ds.Grid([1e-3, 3e-3, 1e-2]).choice(lambda v: math.inf) == 1e-3


def test_marginal_is_a_raw_p_holm_lifts_or_an_adjusted_p_under_0_20():
    assert marginal(0.04, 0.06) and marginal(0.04, 0.5) and marginal(0.06, 0.19) and marginal(0.05, 0.05)
    assert not marginal(0.01, 0.04) and not marginal(0.06, 0.20) and not marginal(0.3, 0.9)
    assert not marginal(None, None)


def test_a_config_the_rule_cannot_run_is_refused():
    with pytest.raises(ConfigError, match="optim.warmup_steps"):
        ds.check(DepthSweepConfig(warmups=[300, 1000, 3000]))
    with pytest.raises(ConfigError, match="warmups_above"):
        ds.check(DepthSweepConfig(warmups_above=[3000, 9000], run=ds.experiment_run(steps=2000)))  # both capped
    with pytest.raises(ConfigError, match="new seeds"):
        ds.check(DepthSweepConfig(marginal_seeds=[2, 3]))
    ds.check(DepthSweepConfig())
    ds.check(DepthSweepConfig.quick())


# ---- the analysis on synthetic points, against scipy and a written-out Holm ------------------------------------
REPORT = {  # (scheme, depth) -> report loss per seed 0..4
    ("keel", 16): [1.40, 1.42, 1.41, 1.43, 1.40], ("pre_ln", 16): [1.45, 1.44, 1.47, 1.48, 1.44],
    ("post_ln", 16): [1.38, 1.43, 1.39, 1.40, 1.41], ("deepnorm", 16): [1.50, 1.41, 1.52, 1.49, 1.55],
    ("keel", 64): [1.35, 1.38, 1.36, 1.37, 1.36], ("pre_ln", 64): [1.49, 1.53, 1.50, 1.50, 1.48],
    ("post_ln", 64): [1.33, 1.37, 1.35, 1.36, 1.30], ("deepnorm", 64): [None] * 5,
    ("keel", 32): [1.37, 1.40, 1.38, 1.39, 1.38], ("pre_ln", 32): [1.46, 1.45, 1.50, 1.46, 1.47],
    ("post_ln", 32): [1.36, 1.39, 1.37, 1.36, 1.37], ("deepnorm", 32): [1.45, 1.47, 1.44, 1.46, 1.45],
}


def synthetic(depths):
    points, tuned = {}, {}
    for d in depths:
        tuned[d] = {}
        for s in ("keel", "pre_ln", "post_ln", "deepnorm"):
            tuned[d][s] = {"lr": 3e-3, "warmup": 100, "lr_grid": {"values": [1e-3, 3e-3, 1e-2], "added": [],
                                                                     "bound": None}, "tried": [(3e-3, 100)]}
            for seed, v in enumerate(REPORT[(s, d)]):
                points[key(s, d, 3e-3, 100, seed)] = {"select_loss": None if v is None else v - 0.1,
                                                      "report_loss": v, "seconds": 10.0, "diverged": v is None}
    return points, tuned


def holm_by_hand(ps):
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [None] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


def test_the_tests_are_scipys_paired_t_tests_holm_adjusted_over_those_run_so_far():
    cfg = DepthSweepConfig()
    points, tuned = synthetic([16, 64, 32])  # in the rule's order; 128 and 256 not in yet
    res = analyse(cfg, points, tuned, set(), 3.3)
    assert res["status"] == "interim" and res["depths_done"] == [16, 64, 32]
    tests = {t["id"]: t for t in res["tests"]}
    assert set(tests) == {f"{x}@{d}" for x in ("pre_ln", "post_ln", "deepnorm") for d in (16, 64, 32)} | {"slope"}
    # DeepNorm diverged at every LR it tried at 64: no t-test, not in the Holm family
    assert tests["deepnorm@64"]["test"] is None and tests["deepnorm@64"]["p_holm"] is None
    assert tests["deepnorm@64"]["verdict"] == "DeepNorm does not train (no t-test)" and res["family_size"] == 9
    raw = {}
    for tid, t in tests.items():
        if tid == "slope" or t["test"] is None:
            continue
        x, d = tid.split("@")
        expected = sps.ttest_rel(REPORT[("keel", int(d))][:3], REPORT[(x, int(d))][:3])
        assert t["p"] == pytest.approx(expected.pvalue, rel=1e-9) and t["test"]["n"] == 3
        raw[tid] = expected.pvalue
    # the growth test: per seed the least-squares slope of Keel - Pre-LN on log2(16, 32, 64) = 4, 5, 6
    slopes = [np.polyfit([4, 5, 6], [REPORT[("keel", d)][s] - REPORT[("pre_ln", d)][s] for d in (16, 32, 64)], 1)[0]
              for s in range(3)]
    assert tests["slope"]["slopes"] == pytest.approx(slopes, rel=1e-9) and tests["slope"]["depths"] == [16, 32, 64]
    raw["slope"] = sps.ttest_1samp(slopes, 0.0).pvalue
    assert tests["slope"]["p"] == pytest.approx(raw["slope"], rel=1e-9)
    ids = list(raw)
    for tid, adj in zip(ids, holm_by_hand([raw[i] for i in ids])):
        t = tests[tid]
        assert t["p_holm"] == pytest.approx(adj, rel=1e-9)
        assert t["verdict"] == ("inconclusive" if adj >= 0.05 else "Keel better" if t["test"]["mean"] < 0
                                else "Keel worse")
        assert t["marginal"] == ((raw[tid] < 0.05 <= adj) or 0.05 <= adj < 0.20)
    assert tests["pre_ln@64"]["verdict"] == "Keel better"  # -0.14, -0.15, -0.14
    # the whole sweep in: final
    done = DepthSweepConfig(depths=[16, 64, 32])
    assert analyse(done, points, tuned, set(), 3.3)["status"] == "final"


def test_an_extended_test_is_run_on_all_five_seeds():
    cfg = DepthSweepConfig()
    points, tuned = synthetic([16, 64])
    for seed in (3, 4):  # seeds only a marginal test runs
        del points[key("deepnorm", 16, 3e-3, 100, seed)]
    res = analyse(cfg, points, tuned, {"post_ln@16", "slope"}, 3.3)
    tests = {t["id"]: t for t in res["tests"]}
    t = tests["post_ln@16"]
    assert t["seeds"] == [0, 1, 2, 3, 4] and t["extended"] and t["test"]["n"] == 5
    assert t["p"] == pytest.approx(sps.ttest_rel(REPORT[("keel", 16)], REPORT[("post_ln", 16)]).pvalue, rel=1e-9)
    first = sps.ttest_rel(REPORT[("keel", 16)][:3], REPORT[("post_ln", 16)][:3]).pvalue  # the one that was marginal
    assert t["test_first"]["p"] == pytest.approx(first, rel=1e-9)
    assert tests["pre_ln@16"]["test"]["n"] == 3  # its Keel arm has seeds 3 and 4, but this test is not marginal
    slopes = [(REPORT[("keel", 64)][s] - REPORT[("pre_ln", 64)][s] - REPORT[("keel", 16)][s]
               + REPORT[("pre_ln", 16)][s]) / 2 for s in range(5)]  # two depths: the difference over log2(64/16)
    assert tests["slope"]["slopes"] == pytest.approx(slopes, rel=1e-9)
    assert tests["slope"]["p"] == pytest.approx(sps.ttest_1samp(slopes, 0.0).pvalue, rel=1e-9)
    # the report losses of an arm stay those of seeds 0-2; the extra seeds are kept beside them
    assert res["arms"][16]["keel"]["report_losses"] == REPORT[("keel", 16)][:3]
    assert res["arms"][16]["keel"]["core_seconds"] == 50.0 and res["arms"][16]["deepnorm"]["core_seconds"] == 30.0


@pytest.mark.slow  # over a second in tests/durations.json
def test_a_lead_that_shrinks_with_depth_is_named_and_the_report_reads_in_depth_order(tmp_path):
    cfg = DepthSweepConfig()
    points, tuned = synthetic([16, 64, 32])  # run in the rule's order
    for seed, bump in enumerate((0.20, 0.21, 0.19, 0.20, 0.22)):  # Pre-LN at 64 now trails Keel by far less
        points[key("pre_ln", 64, 3e-3, 100, seed)]["report_loss"] = REPORT[("keel", 64)][seed] + 0.05 * seed / 10
        points[key("pre_ln", 16, 3e-3, 100, seed)]["report_loss"] = REPORT[("keel", 16)][seed] + bump
    points[key("post_ln", 32, 3e-3, 100, 1)]["report_loss"] = 3.25  # within 0.1 nats of the unigram level (3.3)
    res = analyse(cfg, points, tuned, {"post_ln@16"}, 3.3)
    slope = next(t for t in res["tests"] if t["id"] == "slope")
    assert slope["test"]["mean"] > 0 and slope["p_holm"] < 0.05
    assert slope["verdict"] == "Keel worse (Keel loses ground to Pre-LN with depth)"
    dsr.write_report(cfg, tmp_path, "keel experiment depth-sweep", points, res)
    report = (tmp_path / "report.md").read_text()
    rows = [line.split(" | ")[0] for line in report.splitlines() if line.startswith(("| 16 |", "| 32 |", "| 64 |"))]
    assert rows == ["| 16"] * 4 + ["| 32"] * 4 + ["| 64"] * 4 + ["| 16", "| 32", "| 64"]  # arms, then one-minute
    verdicts = [line for line in report.splitlines() if line.startswith("| Keel - ") or line.startswith("| slope")]
    assert [v.split(" | ")[0].rsplit(" ", 1)[-1] for v in verdicts] == ["16"] * 3 + ["32"] * 3 + ["64"] * 3 + ["64]"]
    marked = [line for line in report.splitlines() if "of the unigram level" in line]
    assert len(marked) == 1 and marked[0].startswith("| 32 | Post-LN |")
    assert "; 1 of 5 seeds within 0.1 nats of the unigram level |" in marked[0]
    # at 16 Post-LN has the lowest mean over seeds 0-2; its test against Keel ran on 5 seeds: the gap is over
    # seeds 0-2 like the choice of winner, the 5-seed mean beside it
    t = next(t for t in res["tests"] if t["id"] == "post_ln@16")
    three = float(np.mean(REPORT[("post_ln", 16)][:3]) - np.mean(REPORT[("keel", 16)][:3]))
    five = float(np.mean(REPORT[("post_ln", 16)]) - np.mean(REPORT[("keel", 16)]))
    minute16 = next(line for line in report.splitlines() if line.startswith("| 16 | Post-LN ("))
    assert f"| {three:+.3f} (Holm p={t['p_holm']:.2g}, n=5: {five:+.3f}) |" in minute16


# ---- the whole logic on made-up losses ---------------------------------------------------------------------------
GAP = {16: [-0.05, -0.03, -0.06, -0.04, -0.05], 64: [-0.20, -0.25, -0.22, -0.21, -0.23]}  # Keel - Pre-LN per seed


def fake_point(cfg, model_cfg, lr, seed):
    """Select-half losses with known optima: Keel's LR past the grid's top, Pre-LN's inside, Post-LN's warm-up past
    the grid's top and its LR higher at a long warm-up, DeepNorm's LR at the bottom (diverging at 64)."""
    s, d, w = model_cfg.scheme, model_cfg.n_sublayers, cfg.optim.warmup_steps
    fake_point.calls.append((s, d, lr, w, seed))
    if s == "deepnorm" and d == 64:
        return {"select_loss": None, "report_loss": None, "seconds": 1.0, "diverged": True}
    target = {"keel": 2e-2, "pre_ln": 3e-3, "deepnorm": 1e-3, "post_ln": 3e-3 if w < 1000 else 1.2e-2}[s]
    select = 1.0 + math.log(lr / target) ** 2 + (math.log(w / 2000) ** 2 if s == "post_ln" else 0) + 0.001 * seed
    keel = 1.5 - 0.001 * d + 0.01 * seed
    report = {"keel": keel, "pre_ln": keel - GAP[d][seed], "post_ln": keel + (0.3, -0.1, 0.2, 0.0, 0.0)[seed],
              "deepnorm": keel + 0.5 + 0.1 * seed}[s]
    return {"select_loss": select, "report_loss": report, "seconds": 1.0, "diverged": False}


@pytest.mark.slow  # over a second in tests/durations.json
def test_the_sweep_tunes_each_arm_by_the_rule_and_adds_seeds_to_marginal_tests(tmp_path, monkeypatch):
    fake_point.calls = []
    monkeypatch.setattr(ds, "budget_point", fake_point)
    monkeypatch.setattr(ds, "unigram_level", lambda cfg: 3.3)
    reports = []

    def write_report(cfg, out, command, points, res):
        write(cfg, out, command, points, res)
        reports.append((res["status"], list(res["depths_done"]), (out / "report.md").read_text(),
                        res.get("pending"), len(list((out / "points").glob("*-seed[34].json.gz")))))
    write = dsr.write_report
    monkeypatch.setattr(dsr, "write_report", write_report)
    cfg = DepthSweepConfig(depths=[64, 16])
    res = ds.run(cfg, tmp_path, "keel experiment depth-sweep")

    # the points of seeds 0-2, written out from rule 21 and the made-up optima
    hps = {"keel": [(lr, 100) for lr in (0.001, 0.003, 0.01, 0.0333333, 0.111111)],
           "pre_ln": [(lr, 100) for lr in (0.001, 0.003, 0.01)],
           "post_ln": [(lr, 100) for lr in (0.001, 0.003, 0.01)] + [(0.003, w) for w in (300, 1000, 3000, 8000)]
           + [(lr, 3000) for lr in (0.001, 0.01, 0.0333333)],  # (0.003, 3000) ran already
           "deepnorm": {16: [(lr, 100) for lr in (0.000333333, 0.001, 0.003, 0.01)],
                        64: [(lr, 100) for lr in (0.000111111, 0.000333333, 0.001, 0.003, 0.01)]}}
    expected = {key(s, d, lr, w, seed) for s, by in hps.items() for d in (64, 16)
                for lr, w in (by[d] if isinstance(by, dict) else by) for seed in (0, 1, 2)}
    saved = set(store.keys(tmp_path / "points"))
    assert {k for k in saved if not k.endswith(("seed3", "seed4"))} == expected
    assert len(fake_point.calls) == len(saved)  # every point trained once
    first_calls = [c[1] for c in fake_point.calls if c[4] < 3]
    assert first_calls == sorted(first_calls, key=[64, 16].index)  # 64 whole before 16 starts

    arms = res["arms"]
    assert (arms[64]["keel"]["lr"], arms[64]["keel"]["lr_grid"]["added"]) == (0.0333333, [0.0333333, 0.111111])
    post = arms[16]["post_ln"]
    assert (post["lr"], post["warmup"], post["warmup_chosen_at_lr"]) == (0.01, 3000, 0.003)
    assert post["warmup_grid"]["added"] == [3000, 8000] and post["lr_grid_again"]["added"] == [0.0333333]
    assert arms[64]["deepnorm"]["lr_grid"]["bound"] == "low" and not arms[64]["deepnorm"]["trains"]

    tests = {t["id"]: t for t in res["tests"]}
    assert tests["deepnorm@64"]["verdict"] == "DeepNorm does not train (no t-test)"
    # Keel - Pre-LN at 16 is marginal on 3 seeds (raw p 0.034, Holm lifts it); it runs again on 5
    three = sps.ttest_rel([1.484, 1.494, 1.504], [1.484 + 0.05, 1.494 + 0.03, 1.504 + 0.06]).pvalue
    assert 0.03 < three < 0.04
    assert tests["pre_ln@16"]["extended"] and tests["pre_ln@16"]["test"]["n"] == 5
    assert tests["pre_ln@16"]["p"] == pytest.approx(sps.ttest_1samp(GAP[16], 0).pvalue, rel=1e-9)
    for tid, t in tests.items():  # every extended test has seeds 3 and 4 on both arms at their chosen (lr, warm-up)
        for s, d in ds.test_arms(tid, t.get("depths", [])) if t["extended"] else []:
            a = arms[d][s]
            assert {key(s, d, a["lr"], a["warmup"], k) for k in (3, 4)} <= saved
    # written out: Keel - Pre-LN at 16 and the slope (Keel and Pre-LN at 16 and 64) took seeds 3 and 4, no other test
    assert {tid for tid, t in tests.items() if t["extended"]} == {"pre_ln@16", "slope"}
    extra = {k for k in saved if k.endswith(("seed3", "seed4"))}
    assert extra == {key(s, d, lr, 100, k) for s, lr in (("keel", 0.0333333), ("pre_ln", 0.003)) for d in (16, 64)
                     for k in (3, 4)}

    # a report after each depth (interim after the first, final after the last) and, while a marginal test's seeds
    # 3 and 4 run, one naming it, written before any of them trains
    assert [(s, d, p, n) for s, d, _, p, n in reports] == [
        ("interim", [64], None, 0), ("interim", [64, 16], ["pre_ln@16", "slope"], 0), ("final", [64, 16], None, 8)]
    assert "**INTERIM**" in reports[0][2] and "| interim |" in reports[0][2] and "**FINAL**" in reports[2][2]
    assert "Marginal on seeds [0, 1, 2], so running again with seeds [3, 4] added to both arms: Keel - Pre-LN at " \
        "16; slope of Keel - Pre-LN per doubling of depth over [16, 64]." in reports[1][2]
    assert reports[1][2].count("| interim: marginal, seeds [3, 4] running |") == 2
    # 3 tests at each of two depths and the slope, less DeepNorm at 64 (it does not train: no t-test)
    assert "**INTERIM**: every depth of [64, 16] is in; Holm over the 6 tests run. Marginal on" in reports[1][2]
    assert "Marginal on" not in reports[0][2] + reports[2][2] and "running |" not in reports[0][2] + reports[2][2]
    report = (tmp_path / "report.md").read_text()
    assert "one round of coordinate search" in report and "At this scale, in one minute" in report
    assert "bound at the low edge" in report and "does not train" in report
    assert store.read_results(tmp_path)["results"]["status"] == "final"
    assert not list(tmp_path.glob(".report*"))

    # run again: every point is reused
    fake_point.calls = []
    ds.run(cfg, tmp_path, "keel experiment depth-sweep")
    assert fake_point.calls == []


@pytest.mark.slow  # over a second in tests/durations.json
def test_a_depth_of_lrs_from_previous_starts_each_grid_at_the_choice_before_it(tmp_path, monkeypatch):
    """Rule 21's amendment: at a depth of lrs_from_previous an arm's LR grid starts at its choice at the depth run
    before and that choice's neighbours there (past a bound: by the same factor), then grows by the rule."""
    fake_point.calls = []
    monkeypatch.setattr(ds, "budget_point", fake_point)
    monkeypatch.setattr(ds, "unigram_level", lambda cfg: 3.3)
    res = ds.run(DepthSweepConfig(depths=[64, 16], lrs_from_previous=[16]), tmp_path, "keel experiment depth-sweep")
    at16 = res["arms"][16]
    # written out from the choices at 64 (test_the_sweep_tunes_each_arm_by_the_rule_... checks those): Keel 0.0333333
    # inside [.., 0.01, 0.0333333, 0.111111]; Pre-LN 0.003; Post-LN 0.01 from its grid again at warm-up 3000
    # [0.001, 0.003, 0.01, 0.0333333]; DeepNorm (diverging everywhere) 0.000111111, the low bound, whose neighbour
    # below is 0.000111111^2 / 0.000333333
    assert {s: a["lr_start"] for s, a in at16.items()} == {
        "keel": [0.01, 0.0333333, 0.111111], "pre_ln": [0.001, 0.003, 0.01],
        "post_ln": [0.003, 0.01, 0.0333333], "deepnorm": [3.7037e-05, 0.000111111, 0.000333333]}
    # then the rule, growing through the LRs each arm ran at 64: Keel and Pre-LN interior at once; Post-LN's LR at
    # warm-up 100 falls to its optimum 0.003 (0.001 added, 64's value below it, not 0.003 / 3.33), its warm-up goes
    # to 3000, its LR again from the same start is 0.01; DeepNorm climbs through 64's 0.001 and 0.003 to 0.001
    assert (at16["keel"]["lr"], at16["keel"]["lr_grid"]["added"], at16["pre_ln"]["lr"]) == (0.0333333, [], 0.003)
    post = at16["post_ln"]
    assert (post["lr"], post["warmup"], post["warmup_chosen_at_lr"]) == (0.01, 3000, 0.003)
    assert post["lr_grid"]["added"] == [0.001] and post["lr_grid_again"]["added"] == []
    assert (at16["deepnorm"]["lr"], at16["deepnorm"]["lr_grid"]["added"]) == (0.001, [0.001, 0.003])
    ran16 = {(s, lr) for s, d, lr, w, seed in fake_point.calls if d == 16}
    assert ("keel", 0.001) not in ran16 and ("deepnorm", 0.01) not in ran16  # the fixed grid's ends, not run
    report = (tmp_path / "report.md").read_text()
    assert "| 16 | Keel | 0.0333333; grid from 0.01, 0.0333333, 0.111111 |" in report
    assert "(at 16 sub-layers: from the arm's choice at the depth run before" in report
    assert "| 64 | Keel | 0.0333333; added 0.0333333, 0.111111 |" in report  # 64 from `lrs`, as before
    assert "| 16 | Post-LN | 0.01 (chosen again at warm-up 3000; first 0.003 at warm-up 100; added 0.001); both " \
           "grids from 0.003, 0.01, 0.0333333 |" in report
    with pytest.raises(ConfigError, match="lrs_from_previous cannot hold the first depth run"):
        ds.check(DepthSweepConfig(depths=[64, 16], lrs_from_previous=[64]))


def test_a_start_from_the_depth_before_takes_post_lns_last_grid_and_grows_through_that_depths_values():
    cfg = DepthSweepConfig(depths=[128, 256])
    grids = {"keel": ([0.001, 0.003, 0.01], 0.003, None),
             "pre_ln": ([0.000333333, 0.001, 0.003, 0.01], 0.001, None),
             # Post-LN: first 1e-3 at warm-up 100, then 3.33e-2 from its grid run again at a longer warm-up
             "post_ln": ([0.000333333, 0.001, 0.003, 0.01], 0.001, [0.001, 0.003, 0.01, 0.0333333, 0.111111]),
             "deepnorm": ([0.000111111, 0.000333333, 0.001, 0.003, 0.01], 0.000111111, None)}  # a bound
    tuned = {128: {s: {"lr": (lr if again is None else again[3]), "lr_grid": {"values": first}}
                   | ({} if again is None else {"lr_grid_again": {"values": again}})
                   for s, (first, lr, again) in grids.items()}}
    starts = ds.start_lrs(cfg, 256, tuned)
    assert {s: start for s, (start, _) in starts.items()} == {
        "keel": [0.001, 0.003, 0.01], "pre_ln": [0.000333333, 0.001, 0.003],
        "post_ln": [0.01, 0.0333333, 0.111111], "deepnorm": [3.7037e-05, 0.000111111, 0.000333333]}
    assert starts["post_ln"][1] == [0.000333333, 0.001, 0.003, 0.01, 0.0333333, 0.111111]  # both its grids' values
    assert ds.start_lrs(cfg, 128, {}) == {s: ([0.001, 0.003, 0.01], []) for s in cfg.schemes}
    # growth takes the values run before (their spacing is x3 then x3.33), then the factor past the last of them
    up = ds.Grid([0.000333333, 0.001, 0.003], 3, known=[0.000333333, 0.001, 0.003, 0.01, 0.0333333])
    assert [up.extend(lambda v: -v) for _ in range(4)] == [0.01, 0.0333333, 0.111111, None] and up.bound == "high"
    down = ds.Grid([0.001, 0.003, 0.01], 2, known=[0.000333333, 0.001, 0.003, 0.01])
    assert [down.extend(lambda v: v) for _ in range(3)] == [0.000333333, 0.000111111, None]


@pytest.mark.slow  # over a second in tests/durations.json
def test_an_arm_whose_round_is_done_goes_on_while_another_arms_last_point_still_trains(tmp_path, monkeypatch):
    """Two processes (here threads) share a depth's points: while one trains DeepNorm's last first-round point, the
    other must go on to Keel's next LR (its first round done, at the grid's top) rather than wait for it; each arm's
    choice is the same as one process running everything in order."""
    from keel.experiments.sweep import Sweep

    fake_point.calls, started = [], threading.Event()

    def point(cfg, model_cfg, lr, seed):
        if (model_cfg.scheme, lr, seed) == ("keel", 0.0333333, 0):  # Keel's grown LR: only after its first round
            started.set()
        if (model_cfg.scheme, lr, seed) == ("deepnorm", 0.01, 2):  # DeepNorm's last first-round point, slow
            point.waited = not started.wait(timeout=30)
        return fake_point(cfg, model_cfg, lr, seed)
    point.waited = None
    monkeypatch.setattr(ds, "budget_point", point)
    cfg, tuned = DepthSweepConfig(depths=[16]), [None, None]

    def process(i):
        tuned[i] = ds.tune_depth(cfg, Sweep(tmp_path / "shared", cfg, poll_seconds=0.01), 16, {})
    threads = [threading.Thread(target=process, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert point.waited is False  # Keel's grown point started while DeepNorm's last point trained
    assert len(fake_point.calls) == len(set(fake_point.calls))  # every point trained once between the two

    monkeypatch.setattr(ds, "budget_point", fake_point)
    alone = ds.tune_depth(cfg, Sweep(tmp_path / "alone", cfg, poll_seconds=0.01), 16, {})
    assert tuned[0] == tuned[1] == alone
    assert alone["keel"]["lr"] == 0.0333333 and alone["deepnorm"]["lr_grid"]["added"] == [0.000333333]


@pytest.mark.slow
def test_quick_depth_sweep_trains_end_to_end(tmp_path):
    import argparse
    import inspect

    from keel.cli.experiment import build
    (tmp_path / "text.txt").write_text(inspect.getsource(argparse) * 2)
    cfg = build("depth-sweep", True, ["model.d_model=16", "model.n_heads=2", "model.n_kv_heads=1", "run.seq_len=16",
                                      "run.batch_size=2", f"data.source={tmp_path / 'text.txt'}",
                                      f"data.cache_dir={tmp_path / 'cache'}"])
    out = tmp_path / "out"
    out.mkdir()
    res = ds.run(cfg, out, "keel experiment depth-sweep --quick")
    assert res["status"] == "final" and list(res["arms"]) == [2, 4]
    for d in (2, 4):
        post = res["arms"][d]["post_ln"]
        assert post["warmup_grid"]["values"][:3] == [1, 2, 3] or post["warmup_grid"]["values"][:3] == [2, 3, 4]
        for s in cfg.schemes:
            assert len(res["arms"][d][s]["report_losses"]) == 2
    assert len([t for t in res["tests"] if t["id"] != "slope"]) == 6 and res["tests"][-1]["id"] == "slope"
    assert (out / "depth-sweep.png").exists() and "**FINAL**" in (out / "report.md").read_text()
