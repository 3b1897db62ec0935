"""frontier's rule 27 (a scheme's warm-up tuned too at deep depths, one round of coordinate search): the points it
runs, written out from made-up select losses (no training); the committed results/frontier replayed unchanged;
the ladder running out is a bound; the config check."""

import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from keel.config import OptimConfig
from keel.errors import ConfigError
from keel.experiments import store
from keel.experiments.grid import LadderGrid
from keel_studies import frontier as fr
from keel_studies.frontier import FrontierConfig, key

RESULTS = Path(__file__).parent.parent / "results" / "frontier"


def made_up(scheme: str, lr: float, warmup: int, seed: int) -> dict:
    """Select loss (log10 lr - log10 best)^2 + 5 ln(warmup / best warm-up)^2: Keel's best is LR 5e-3 at the base
    warm-up 3; Post-LN's best warm-up is 5, where its best LR moves from 2e-3 to 8e-3. The report loss names the
    point it came from."""
    best_lr, best_wu = (5e-3, 3) if scheme == "keel" else (2e-3 if warmup <= 4 else 8e-3, 5)
    select = 3.0 + math.log10(lr / best_lr) ** 2 + 5 * math.log(warmup / best_wu) ** 2 + 0.001 * seed
    return {"select_loss": select, "report_loss": 2.0 + lr + 0.01 * warmup + 0.001 * seed,
            "grad_bottom_over_top": 1.0}


@pytest.fixture
def fake(monkeypatch):
    """frontier with made-up points (each call recorded as (scheme, depth, lr, warm-up, seed)), no plot, and
    every sweep.run call's point names recorded."""
    calls, rounds = [], []

    def budget_point(cfg, model_cfg, lr, seed, extra=None):
        calls.append((model_cfg.scheme, model_cfg.n_sublayers, lr, cfg.optim.warmup_steps, seed))
        return made_up(model_cfg.scheme, lr, cfg.optim.warmup_steps, seed)

    run = fr.Sweep.run

    def sweep_run(self, points, desc):
        rounds.append((desc, list(points)))
        return run(self, points, desc)
    monkeypatch.setattr(fr, "budget_point", budget_point)
    monkeypatch.setattr(fr, "unigram_level", lambda cfg: 3.3)
    monkeypatch.setattr(fr, "_plot", lambda cfg, res, out: "frontier.png")
    monkeypatch.setattr(fr.Sweep, "run", sweep_run)
    return calls, rounds


def quick(**fields) -> FrontierConfig:
    """The --quick config (d=32, 6 steps, depths 4 and 8, seeds 0 and 1) at base warm-up 3, each LR grid whole
    at depth 8 too, grown up to 2 values a side."""
    q = FrontierConfig.quick()
    return replace(q, optim=replace(q.optim, warmup_steps=3), deep_grid=2, grow=2, **fields)


def test_a_warmup_at_the_high_edge_grows_through_the_ladder_then_the_lr_grid_runs_again(fake, tmp_path):
    calls, rounds = fake
    cfg = quick(warmup_schemes=["post_ln", "keel"], warmup_from=8, warmups=[2, 3, 4], warmups_below=[1],
                warmups_above=[5, 6])
    res = fr.run(cfg, tmp_path, "keel experiment frontier --quick")

    # written out from the made-up optima: every arm's LR grid at warm-up 3 grown by rule 22 (Post-LN's 3e-3 at
    # the high edge adds 9e-3, Keel's at the low edge adds 9e-4); at 8 sub-layers Keel's warm-up 3 is interior,
    # Post-LN's grows through 5 and 6 (5 interior), then its LR grid again at warm-up 5 grows through 9e-3 and
    # 2.7e-2 (9e-3 interior)
    post_base, keel_base = [(lr, 3) for lr in (1e-3, 3e-3, 9e-3)], [(lr, 3) for lr in (9e-4, 3e-3, 1e-2)]
    ran = {("post_ln", 4): post_base, ("keel", 4): keel_base,
           ("keel", 8): keel_base + [(3e-3, 2), (3e-3, 4)],
           ("post_ln", 8): post_base + [(3e-3, w) for w in (2, 4, 5, 6)] + [(lr, 5) for lr in (1e-3, 9e-3, 2.7e-2)]}
    expected = {(s, d, lr, w, seed) for (s, d), hps in ran.items() for lr, w in hps for seed in (0, 1)}
    assert len(calls) == len(set(calls)) and set(calls) == expected  # each point once (9e-3 is float('0.009'))
    saved = set(store.keys(tmp_path / "points"))
    assert len(saved) == len(expected)
    assert "post_ln-8-lr0.003-seed0" in saved and "post_ln-8-lr0.009-wu5-seed1" in saved  # base keeps its names
    assert not any("-wu3-" in k for k in saved) and {k for k in saved if "-wu" in k} == {
        f"{s}-8-lr{lr:g}-wu{w}-seed{k}" for s, d, lr, w, k in expected if w != 3}

    # each round of the searches in one sweep.run: both arms' first warm-up grids together
    wu_rounds = [names for desc, names in rounds if desc == "warm-ups"]
    assert set(wu_rounds[0]) == {key(s, 8, 3e-3, k) if w == 3 else f"{s}-8-lr0.003-wu{w}-seed{k}"
                                 for s in ("post_ln", "keel") for w in (2, 3, 4) for k in (0, 1)}
    assert len(wu_rounds) == 6  # then Post-LN alone: warm-up 5, 6, the LR grid at 5, 9e-3, 2.7e-2

    post, keel = res["arms"]["post_ln-8"], res["arms"]["keel-8"]
    assert (post["lr"], post["warmup"], post["warmup_chosen_at_lr"]) == (0.009, 5, 0.003)
    assert post["warmup_grid"] == {"values": [2, 3, 4, 5, 6], "added": [5, 6], "bound": None}
    assert post["lr_grid_again"] == {"values": [0.001, 0.003, 0.009, 0.027], "added": [0.009, 0.027], "bound": None}
    assert post["report_losses"] == [pytest.approx(2.0 + 0.009 + 0.05 + 0.001 * k) for k in (0, 1)]
    assert list(post["select_by_hp"]) == ["0.001@3", "0.003@3", "0.009@3", "0.003@2", "0.003@4", "0.003@5",
                                          "0.003@6", "0.001@5", "0.009@5", "0.027@5"]
    assert (keel["lr"], keel["warmup"], keel["warmup_grid"]["added"]) == (0.003, 3, []) and "lr_grid_again" not in keel
    assert "warmup" not in res["arms"]["post_ln-4"]  # below warmup_from: rule 22 only
    assert res["arms"]["post_ln-4"]["report_losses"] == [pytest.approx(2.0 + 0.003 + 0.03 + 0.001 * k) for k in (0, 1)]

    report = (tmp_path / "report.md").read_text()
    assert "@ 0.009, wu 5 (" in report and "@ 0.003 (" in report and "wu 3" not in report
    assert "| post_ln-8 | 0.003 | 2, 3, 4, 5, 6 (added 5, 6) | 0.001, 0.003, 0.009, 0.027 (added 0.009, 0.027) | " \
           "0.009 at warm-up 5 |" in report
    saved_res = store.read_results(tmp_path)["results"]
    assert saved_res["arms"]["post_ln-8"]["warmup_grid"]["added"] == [5, 6]

    calls.clear()  # run again: every point reused
    fr.run(cfg, tmp_path, "keel experiment frontier --quick")
    assert calls == []


def test_a_ladder_that_runs_out_leaves_the_warmup_at_a_bound(fake, tmp_path, monkeypatch):
    up = LadderGrid([2, 3, 4], 2, below=[1], above=[6])  # one value above: it runs out before max_extensions
    assert [up.extend(lambda w: -w) for _ in range(2)] == [6, None] and up.describe() == {
        "values": [2, 3, 4, 6], "added": [6], "bound": "high"}

    ran = []

    def longer_is_better(cfg, model_cfg, lr, seed, extra=None):  # best LR 2e-3 at every warm-up
        ran.append((model_cfg.scheme, model_cfg.n_sublayers, lr, cfg.optim.warmup_steps))
        select = 3.0 + math.log10(lr / 2e-3) ** 2 - 0.01 * cfg.optim.warmup_steps
        return {"select_loss": select, "report_loss": 2.5, "grad_bottom_over_top": 1.0}
    monkeypatch.setattr(fr, "budget_point", longer_is_better)
    cfg = quick(warmup_schemes=["post_ln"], warmup_from=8, warmups=[2, 3, 4], warmups_below=[1], warmups_above=[6])
    res = fr.run(cfg, tmp_path, "keel experiment frontier --quick")
    post = res["arms"]["post_ln-8"]
    assert (post["lr"], post["warmup"]) == (0.003, 6)
    assert post["warmup_grid"] == {"values": [2, 3, 4, 6], "added": [6], "bound": "high"}
    assert {(lr, w) for s, d, lr, w in ran if (s, d) == ("post_ln", 8) and w != 3} == {
        (3e-3, 2), (3e-3, 4), (3e-3, 6), (1e-3, 6), (9e-3, 6)}  # the LR grid again at 6, grown by 9e-3
    assert "2, 3, 4, 6 (added 6; bound at the high edge)" in (tmp_path / "report.md").read_text()


def test_the_default_config_runs_the_points_it_ran_before(fake, tmp_path):
    calls, rounds = fake
    cfg = FrontierConfig.quick()  # no warm-up tuned: every LR of each grid with every seed (grow=0)
    res = fr.run(cfg, tmp_path, "keel experiment frontier --quick")
    saved = set(store.keys(tmp_path / "points"))
    grids = {("post_ln", 4): (0.001, 0.003), ("post_ln", 8): (0.001,), ("keel", 4): (0.003, 0.01),
             ("keel", 8): (0.003,)}
    assert saved == {f"{s}-{d}-lr{lr}-seed{k}" for (s, d), grid in grids.items() for lr in grid for k in (0, 1)}
    assert {w for *_, w, _ in calls} == {cfg.optim.warmup_steps} and [d for d, _ in rounds] == ["frontier"]
    assert all(set(a) == {"lr", "report_losses", "class", "grad_bottom_over_top", "select_by_lr"}
               for a in res["arms"].values())
    assert "Warm-up tuned" not in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_the_committed_frontier_replays_to_its_report_from_its_points(tmp_path, monkeypatch):
    """The committed report's command, merged as `keel experiment` merges it, run on a copy of its points (no
    point may train): the same report.md and the same results, word for word and number for number."""
    from keel.cli.experiment import build, read_study

    committed = store.read_results(RESULTS)
    kind, fields = read_study(str(RESULTS / "study.yaml"))
    shutil.copytree(RESULTS / "points", tmp_path / "points")
    monkeypatch.setattr(fr, "unigram_level", lambda cfg: committed["results"]["unigram"])
    monkeypatch.setattr(fr, "budget_point", lambda *a, **k: pytest.fail("a committed point is missing"))
    fr.run(build(kind, False, fields), tmp_path, committed["command"])
    assert (tmp_path / "report.md").read_text() == (RESULTS / "report.md").read_text()
    assert store.read_results(tmp_path)["results"] == committed["results"]


def test_the_config_check_refuses_what_rule_27_cannot_run():
    fr.check(FrontierConfig(optim=OptimConfig(warmup_steps=40)))  # nothing tuned: the warm-up fields are not read
    fr.check(FrontierConfig(warmup_schemes=["post_ln", "deepnorm"]))
    fr.check(replace(FrontierConfig.quick(), warmup_schemes=["post_ln"]))
    tuned = FrontierConfig(warmup_schemes=["post_ln"])
    for fields, message in [({"warmup_schemes": ["post_ln", "rezero"]}, r"warmup_schemes holds \['rezero'\]"),
                            ({"warmups": [10, 100]}, r"warmups must hold optim.warmup_steps \(30"),
                            ({"warmups": [30]}, "warmups needs two values"),
                            ({"warmups_below": [10, 3]}, "warmups_below must fall"),
                            ({"warmups_below": [3, 5]}, "warmups_below must fall"),
                            ({"warmups_above": [100, 300]}, "warmups_above .* must rise"),
                            ({"warmups_above": [300, 1000]}, "warmups_above .* must rise")]:  # 1000 capped at 300
        with pytest.raises(ConfigError, match=f"^frontier: {message}"):
            fr.check(replace(tuned, **fields))
