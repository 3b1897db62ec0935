"""depth-sweep: which scheme wins at each depth, at the budget where added depth pays (the depth pilot's answer;
method written before the runs, results/PROTOCOL.md).

Keel, Pre-LN, Post-LN and DeepNorm at each depth of `depths`, in that order, one depth finished (grid growth and
marginal seeds included) before the next starts, so a partial sweep still answers whole depths:
  - every arm's LR comes from `lrs` with every seed, chosen by the mean select-half loss over the seeds (a
    diverged seed counts as +inf), the grid grown past an edge choice (keel.experiments.grid); at a depth of
    `lrs_from_previous` the grid starts instead at the arm's choice at the depth run before and its two
    neighbours on that depth's grid (`start_lrs`);
  - Post-LN's warm-up is tuned too, one round of coordinate search: its LR at the base warm-up, then at that LR
    the warm-up grid `warmups` (grown past an edge through `warmups_below` / `warmups_above`, capped at the
    run), then, if the warm-up moved, its LR grid again at the new warm-up;
  - Keel - X on the report half per depth (paired over seeds), and per seed the least-squares slope of
    Keel - Pre-LN over log2(sub-layers), tested against 0; Holm over the tests run so far ("interim" until every
    depth and every marginal test's added seeds are in); a marginal test gets `marginal_seeds` on both arms at
    their chosen hyper-parameters and is run again on all seeds.
The report (report.md, results.json, plot; keel_studies.depth_sweep_report) is written after every finished
depth, and before a newly marginal test's added seeds run (naming it, its rows still on `seeds`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import numpy as np

from keel.config import OptimConfig, RunConfig
from keel.errors import ConfigError
from keel.experiments import stats
from keel.experiments.budget import budget_point
from keel.experiments.common import experiment_run
from keel.experiments.grid import Grid, LadderGrid, Search, _finite, run_searches, search_grid
from keel.experiments.sweep import Sweep
from keel_studies.common import ExperimentConfig, tiny_quick, unigram_level

REF, SLOPE_VS = "keel", "pre_ln"  # every test is Keel - X; the growth test is Keel's lead over Pre-LN
NAMES = {"keel": "Keel", "pre_ln": "Pre-LN", "post_ln": "Post-LN", "deepnorm": "DeepNorm"}
MARGINAL_BELOW = 0.20  # an adjusted p in [ALPHA, this) is marginal (so is a raw p < ALPHA that Holm lifts)


@dataclass
class DepthSweepConfig(ExperimentConfig):
    # fields that only add points (warm-ups, where LR grids start: points named by their values; keel.experiments.sweep)
    ADDS_POINTS: ClassVar[tuple] = ("warmups", "warmups_below", "warmups_above", "lrs_from_previous")
    schemes: list[str] = field(default_factory=lambda: ["keel", "pre_ln", "post_ln", "deepnorm"])
    depths: list[int] = field(default_factory=lambda: [16, 64, 32, 128, 256])  # sub-layers, run in this order
    lrs: list[float] = field(default_factory=lambda: [1e-3, 3e-3, 1e-2])  # the starting LR grid of every arm
    # depths whose LR grids start at each arm's choice at the depth run before and its neighbours there, not at
    # `lrs`: for cost, where a run is hours long. Both starts walk the same values, so for a select loss with one
    # minimum in log LR they end at the same interior choice unless a bound stops one first; this one skips LRs
    # the depths before ruled out (at 32, 64 and 128 sub-layers the grid's top, 1e-2, left Post-LN and DeepNorm at
    # the unigram level on every seed, and the choices fell towards its low edge)
    lrs_from_previous: list[int] = field(default_factory=lambda: [256])
    max_extensions: int = 2  # values added past one edge of a grid before the choice is called a bound
    warmup_scheme: str = "post_ln"  # the arm whose warm-up is tuned too (every other arm: optim.warmup_steps)
    warmups: list[int] = field(default_factory=lambda: [100, 300, 1000])  # holds optim.warmup_steps
    warmups_below: list[int] = field(default_factory=lambda: [30, 10])  # the rule's values past the low edge
    warmups_above: list[int] = field(default_factory=lambda: [3000, 9000])  # past the high edge; capped at run.steps
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # choose the hyper-parameters and test
    marginal_seeds: list[int] = field(default_factory=lambda: [3, 4])  # added to both arms of a marginal test
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(warmup_steps=100))
    run: RunConfig = field(default_factory=lambda: experiment_run(steps=8000, eval_batches=448))  # whole report half
    curve_every: int = 500
    curve_batches: int = 4
    probe: bool = False  # budget_point's probe (not part of this experiment's rules)
    probe_batches: int = 4

    PER_POINT: ClassVar[dict[str, str]] = ExperimentConfig.PER_POINT | {"model.scheme": "schemes"}

    @classmethod
    def quick(cls) -> DepthSweepConfig:
        return tiny_quick(cls, 6, depths=[2, 4], seeds=[0, 1], marginal_seeds=[2], lrs=[3e-3, 1e-2],
                          max_extensions=1, warmups=[2, 3, 4], warmups_below=[1], warmups_above=[6], curve_every=2,
                          curve_batches=1)

    def warmup_ladders(self) -> tuple[list[int], list[int]]:
        """The values past the warm-up grid's low and high edges, the high ones capped at the whole run."""
        return list(self.warmups_below), [min(w, self.run.steps) for w in self.warmups_above]


def check(cfg: DepthSweepConfig) -> None:
    below, above = cfg.warmup_ladders()
    problems = [
        (REF not in cfg.schemes or SLOPE_VS not in cfg.schemes, f"schemes must hold {REF} and {SLOPE_VS}"),
        (cfg.optim.warmup_steps not in cfg.warmups, "warmups must hold optim.warmup_steps (every arm's warm-up)"),
        (min(len(below), len(above)) < cfg.max_extensions, "warmups_below/above need max_extensions values each"),
        (not all(a > b for a, b in zip([min(cfg.warmups), *below], below)),
         "warmups_below must fall from below the lowest warm-up"),
        (not all(b > a for a, b in zip([max(cfg.warmups), *above], above)),
         "warmups_above (capped at run.steps) must rise from above the highest warm-up"),
        (bool(set(cfg.seeds) & set(cfg.marginal_seeds)), "marginal_seeds must be new seeds"),
        (bool(cfg.depths) and cfg.depths[0] in cfg.lrs_from_previous,
         f"lrs_from_previous cannot hold the first depth run ({cfg.depths[0] if cfg.depths else ''}): no depth "
         "runs before it"),
    ]
    for bad, why in problems:
        if bad:
            raise ConfigError(f"depth-sweep: {why}")


def key(scheme: str, depth: int, lr: float, warmup: int, seed: int) -> str:
    return f"{scheme}-{depth}-lr{lr:g}-wu{warmup}-seed{seed}"


def mean_select(cfg: DepthSweepConfig, points: dict, scheme: str, depth: int, lr: float, warmup: int) -> float:
    return float(np.mean([_finite(points[key(scheme, depth, lr, warmup, s)].get("select_loss")) for s in cfg.seeds]))


# ---- choosing the hyper-parameters -------------------------------------------------------------------------
# An arm's search is a generator (keel.experiments.grid.Search): it yields the (lr, warm-up) pairs it needs next
# and returns its choice; a depth's driver runs what all arms ask for at once (two processes share those points).
def start_lrs(cfg: DepthSweepConfig, depth: int, tuned: dict[int, dict]) -> dict[str, tuple[list[float], list[float]]]:
    """Each arm's starting LR grid at `depth` and the values its growth takes first (`Grid.known`): `lrs`, or at a
    depth of `lrs_from_previous` its choice at the depth run before and that choice's neighbours on the grid it was
    chosen from (Post-LN: the grid of its last LR search; a neighbour the grid lacks, at a bound, is the value past
    the edge by the same factor), growing through that arm's LRs there."""
    if depth not in cfg.lrs_from_previous:
        return {s: (list(cfg.lrs), []) for s in cfg.schemes}
    before = tuned[cfg.depths[cfg.depths.index(depth) - 1]]
    starts = {}
    for s in cfg.schemes:
        arm = before[s]
        values, lr = sorted(arm.get("lr_grid_again", arm["lr_grid"])["values"]), arm["lr"]
        i = values.index(lr)
        lo = values[i - 1] if i > 0 else Grid(values).beyond("low", 0)
        hi = values[i + 1] if i + 1 < len(values) else Grid(values).beyond("high", 0)
        lattice = sorted({*arm["lr_grid"]["values"], *arm.get("lr_grid_again", {}).get("values", [])})
        starts[s] = ([lo, lr, hi], lattice)
    return starts


def tune_arm(cfg: DepthSweepConfig, scheme: str, score: Callable[[float, int], float],
             lrs: list[float] | None = None, lattice: list[float] | None = None,
             tune_warmup: bool | None = None) -> Search:
    """The hyper-parameter choice for one arm at one depth; `score(lr, warmup)` is the mean select-half loss over seeds;
    `lrs` the starting LR grid (default `cfg.lrs`), `lattice` the values its growth takes first (`start_lrs`);
    the warm-up is tuned too where `tune_warmup` says (default: for `cfg.warmup_scheme` only)."""
    base, lrs, lattice = cfg.optim.warmup_steps, list(cfg.lrs if lrs is None else lrs), list(lattice or [])
    lr_grid = Grid(list(lrs), cfg.max_extensions, known=lattice)
    lr = yield from search_grid(lr_grid, lambda v: (v, base), score)
    tuned = {"lr": lr, "warmup": base, "lr_start": lrs, "lr_grid": lr_grid.describe()}
    if not (scheme == cfg.warmup_scheme if tune_warmup is None else tune_warmup):
        return tuned
    below, above = cfg.warmup_ladders()
    wu_grid = LadderGrid([float(w) for w in cfg.warmups], cfg.max_extensions, ties="high", below=below, above=above)
    warmup = int((yield from search_grid(wu_grid, lambda w: (lr, int(w)), score)))
    tuned |= {"warmup": warmup, "warmup_grid": wu_grid.describe(), "warmup_chosen_at_lr": lr}
    if warmup != base:  # one round of coordinate search: the LR again at the new warm-up, and that is final
        again = Grid(list(lrs), cfg.max_extensions, known=lattice)
        lr = yield from search_grid(again, lambda v: (v, warmup), score)
        tuned |= {"lr": lr, "lr_grid_again": again.describe()}
    return tuned


def _job(cfg: DepthSweepConfig, scheme: str, depth: int, lr: float, warmup: int, seed: int):
    at = replace(cfg, optim=replace(cfg.optim, warmup_steps=warmup))
    return lambda: budget_point(at, at.point_model(scheme, depth), lr, seed)


def tune_depth(cfg: DepthSweepConfig, sweep: Sweep, depth: int, points: dict,
               starts: dict[str, tuple[list[float], list[float]]] | None = None) -> dict[str, dict]:
    """Every arm's search at `depth` from its starting LR grid and lattice in `starts` (`start_lrs`; default
    `cfg.lrs`), run side by side; adds the points to `points`, returns each arm's choice with the (lr, warm-up)
    pairs it tried."""
    starts = starts or {}
    searches = {s: tune_arm(cfg, s, lambda lr, w, s=s: mean_select(cfg, points, s, depth, lr, w),
                            *starts.get(s, (None, None))) for s in cfg.schemes}

    def run_round(asked: dict[str, list[tuple[float, int]]]) -> set[str]:
        # returns once some arm has all its points (run_searches advances that one), so a process never waits
        # for another arm's last point while an arm whose round is done has new points to run
        jobs = {s: {key(s, depth, lr, w, seed): _job(cfg, s, depth, lr, w, seed) for lr, w in hps for seed in cfg.seeds}
                for s, hps in asked.items()}
        def complete(done: dict) -> set[str]:
            return {s for s, arm in jobs.items() if arm.keys() <= done.keys()}
        got = sweep.run({k: job for arm in jobs.values() for k, job in arm.items()}, f"depth-sweep {depth} sub-layers",
                        enough=lambda done: bool(complete(done)))
        points.update(got)
        return complete(got)
    return run_searches(searches, run_round)


# ---- the tests -----------------------------------------------------------------------------------------------
def marginal(p: float | None, p_holm: float | None) -> bool:
    """Whether a test is marginal, so that it runs again with `marginal_seeds` added: raw p < 0.05 that Holm lifts
    to >= 0.05, or an adjusted p in [0.05, 0.20)."""
    if p is None or p_holm is None:
        return False
    return p_holm >= stats.ALPHA and (p < stats.ALPHA or p_holm < MARGINAL_BELOW)


def slope(x: list[float], y: list[float]) -> float:
    """The least-squares slope of y against x (NaN if a y is not finite)."""
    if not all(stats._finite(v) for v in y):
        return math.nan
    xm, ym = np.mean(x), np.mean(y)
    return float(np.sum((np.array(x) - xm) * (np.array(y) - ym)) / np.sum((np.array(x) - xm) ** 2))


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def summarise_arm(cfg: DepthSweepConfig, points: dict, scheme: str, depth: int, tuned: dict) -> dict:
    lr, warmup = tuned["lr"], tuned["warmup"]
    chosen = {s: points[k]["report_loss"] for s in [*cfg.seeds, *cfg.marginal_seeds]
              if (k := key(scheme, depth, lr, warmup, s)) in points}
    tried = [points[key(scheme, depth, *hp, s)] for hp in tuned["tried"] for s in cfg.seeds]
    extra = [points[key(scheme, depth, lr, warmup, s)] for s in cfg.marginal_seeds if s in chosen]
    return tuned | {"trains": trains(cfg, points, scheme, depth, tuned),
                    "report_by_seed": chosen, "report_losses": [chosen[s] for s in cfg.seeds],
                    "select_by_hp": {f"{lr_:g}@{w}": mean_select(cfg, points, scheme, depth, lr_, w)
                                     for lr_, w in tuned["tried"]},
                    "core_seconds": sum(p["seconds"] for p in tried + extra)}


def trains(cfg: DepthSweepConfig, points: dict, scheme: str, depth: int, tuned: dict) -> bool:
    """False when every seed diverged at every (lr, warm-up) the arm tried: it "does not train" (no t-test)."""
    return any(stats._finite(points[key(scheme, depth, *hp, s)].get("select_loss"))
               for hp in tuned["tried"] for s in cfg.seeds)


def slope_depths(cfg: DepthSweepConfig, points: dict, tuned: dict[int, dict]) -> list[int]:
    """The depths the growth test spans: those run so far at which Keel and Pre-LN both train."""
    return sorted(d for d in tuned if all(trains(cfg, points, s, d, tuned[d][s]) for s in (REF, SLOPE_VS)))


def test_arms(test_id: str, slope_depths: list[int]) -> list[tuple[str, int]]:
    """The (scheme, depth) arms a test compares: `<scheme>@<depth>` is Keel - scheme there; `slope` every depth."""
    if test_id == "slope":
        return [(s, d) for d in slope_depths for s in (REF, SLOPE_VS)]
    scheme, depth = test_id.split("@")
    return [(REF, int(depth)), (scheme, int(depth))]


def _paired(cfg: DepthSweepConfig, seeds: list[int], a: list, b: list) -> dict:
    """The test on `seeds`; on more seeds than `cfg.seeds` (a marginal test run again) also the first test."""
    n = len(cfg.seeds)
    return {"test": stats.paired(a, b)} | ({"test_first": stats.paired(a[:n], b[:n])} if len(seeds) > n else {})


def analyse(cfg: DepthSweepConfig, points: dict, tuned: dict[int, dict], extended: set[str], unigram: float) -> dict:
    """Every arm of the depths in `tuned` and the tests among them, Holm-adjusted over the tests run so far; a
    test in `extended` is on `seeds` + `marginal_seeds`."""
    arms = {d: {s: summarise_arm(cfg, points, s, d, t) for s, t in tuned[d].items()} for d in tuned}
    tests = []
    for d in tuned:
        for x in [s for s in cfg.schemes if s != REF]:
            tid = f"{x}@{d}"
            seeds = cfg.seeds + (cfg.marginal_seeds if tid in extended else [])
            idle = [s for s in (REF, x) if not arms[d][s]["trains"]]
            tests.append({"id": tid, "what": f"Keel - {NAMES.get(x, x)} at {d}", "seeds": seeds,
                          "does_not_train": idle} | ({} if idle else _paired(
                              cfg, seeds, [arms[d][REF]["report_by_seed"].get(s) for s in seeds],
                              [arms[d][x]["report_by_seed"].get(s) for s in seeds])))
    spans = slope_depths(cfg, points, tuned)
    seeds = cfg.seeds + (cfg.marginal_seeds if "slope" in extended else [])
    if len(spans) >= 2:
        gaps = {s: [_minus(arms[d][REF]["report_by_seed"][s], arms[d][SLOPE_VS]["report_by_seed"][s])
                    for d in spans] for s in seeds}
        slopes = [slope([math.log2(d) for d in spans], gaps[s]) for s in seeds]
        tests.append({"id": "slope", "what": f"slope of Keel - Pre-LN per doubling of depth over {spans}",
                      "seeds": seeds, "does_not_train": [], "slopes": slopes, "depths": spans}
                     | _paired(cfg, seeds, slopes, [0.0] * len(slopes)))
    for t in tests:
        t.setdefault("test", None)
    for t, p_holm in zip(tests, stats.holm([t["test"]["p"] if t["test"] else None for t in tests])):
        p = t["test"]["p"] if t["test"] else None
        t |= {"p": p, "p_holm": p_holm, "marginal": marginal(p, p_holm), "extended": t["id"] in extended,
              "verdict": (f"{' and '.join(NAMES.get(s, s) for s in t['does_not_train'])} does not train (no t-test)"
                          if t["does_not_train"] else "inconclusive" if p_holm is None or p_holm >= stats.ALPHA
                          else "Keel better" if t["test"]["mean"] < 0 else "Keel worse")
              + (_slope_reading(t["test"]["mean"]) if t["id"] == "slope" and p_holm is not None
                 and p_holm < stats.ALPHA else "")}
    final = all(d in tuned for d in cfg.depths)
    return {"status": "final" if final else "interim", "depths_done": list(tuned), "unigram": unigram,
            "arms": arms, "tests": tests, "family_size": sum(t["p"] is not None for t in tests),
            "core_hours": sum(a["core_seconds"] for by in arms.values() for a in by.values()) / 3600}


def _slope_reading(mean: float) -> str:
    # the rule's words are Keel - X's; for the slope they say which way Keel - Pre-LN moves with depth (whether
    # Keel is ahead or behind)
    return f" (Keel {'gains on' if mean < 0 else 'loses ground to'} Pre-LN with depth)"


def settle(cfg: DepthSweepConfig, sweep: Sweep, tuned: dict, points: dict, extended: set[str],
           unigram: float, on_pending: Callable[[dict], None] | None = None) -> dict:
    """The marginal rule over the tests run so far: every marginal test (once) gets `marginal_seeds` on both
    arms at their chosen hyper-parameters, until no test newly turns marginal. An extended test stays on all
    seeds (for the slope: at every later depth too). Before the runs a newly marginal test needs, `on_pending`
    gets the analysis so far, its status "interim" and "pending" naming those tests (the report while they run)."""
    while True:
        jobs, spans = {}, slope_depths(cfg, points, tuned)
        for tid in extended:
            for s, d in test_arms(tid, spans):
                lr, w = tuned[d][s]["lr"], tuned[d][s]["warmup"]
                jobs |= {key(s, d, lr, w, seed): _job(cfg, s, d, lr, w, seed) for seed in cfg.marginal_seeds
                         if key(s, d, lr, w, seed) not in points}
        if jobs:
            points |= sweep.run(jobs, "depth-sweep marginal seeds")
        res = analyse(cfg, points, tuned, extended, unigram)
        new = {t["id"] for t in res["tests"] if t["marginal"]} - extended
        if not new:
            return res
        if on_pending is not None:
            on_pending(res | {"status": "interim", "pending": sorted(new)})
        extended |= new


def run(cfg: DepthSweepConfig, out: Path, command: str) -> dict:
    from keel_studies import depth_sweep_report  # noqa: PLC0415 (it reads this module's rule constants)

    check(cfg)
    sweep, points, tuned, extended, unigram = Sweep(out, cfg), {}, {}, set(), unigram_level(cfg)
    for depth in cfg.depths:  # each depth whole (its marginal seeds included) before the next
        tuned[depth] = tune_depth(cfg, sweep, depth, points, start_lrs(cfg, depth, tuned))
        res = settle(cfg, sweep, tuned, points, extended, unigram,
                     lambda pending: depth_sweep_report.write_report(cfg, out, command, points, pending))
        depth_sweep_report.write_report(cfg, out, command, points, res)
    return res
