"""frontier: the deepest model each scheme still trains, at one token budget (the paper's central claim, which no
table of the paper isolates).

Every scheme x depth x LR x seed trains from scratch for the same `run.steps` steps of `run.batch_size x
run.seq_len` tokens (default 300 x 4 x 64 = 76,800, the budget of benchmarks/deep-1024-learn), points in
order of depth so the cheap depths finish first. Method (written before the runs; results/PROTOCOL.md):
  - the LR of each scheme at each depth is chosen from its grid `lrs[scheme]` by the mean select-half loss over
    *all* seeds (at depths >= `deep_from` only the lowest `deep_grid` LRs of the grid run);
  - every reported loss is on `run.eval_batches` batches of the report half, at the chosen LR, every seed;
  - "learns": report loss >= `learn_margin` nats below the unigram level in every seed; "stuck": within
    `stuck_margin` nats of it (or above, or diverged) in every seed;
  - "Keel trains where X does not" at a depth: Keel learns and X is stuck there;
  - "Keel's advantage over X grows with depth": the per-seed gap Keel - X at the deepest depth minus the gap at
    the shallowest is negative at p < 0.05 (paired two-sided t-test, keel.experiments.stats);
  - each trained point also records its gradient profile (one forward/backward on a report batch): the mean
    parameter-gradient norm of the bottom eighth of the sub-layers over the top eighth.
`grow` > 0: an LR chosen at an edge of its grid is a bound, not a choice, so the grid grows past that edge by the
same factor (keel.experiments.grid) with every seed, until the choice is interior or `grow` values were added on
that side; the choice and the verdicts are then made on the grown grids. `grow=0` chooses from the starting grids
as they are, an edge included.
`warmup_schemes`: those schemes' warm-up is tuned too at depths >= `warmup_from` (a warm-up nobody tuned can be
what keeps a scheme from learning: Post-LN collapses without one), one round of coordinate search as depth-sweep
tunes Post-LN's: (1) the LR at the base warm-up `optim.warmup_steps`, as above;
(2) at that LR the warm-up grid `warmups` with every seed, grown past an edge choice through `warmups_below` /
`warmups_above` (capped at the run) until interior, `grow` values were added on that side or the ladder ran out
(a bound); (3) if the warm-up moved, the LR grid again at the new warm-up (grown the same way) and the LR chosen
again. That (LR, warm-up) is the arm's, for every reported number. A point at a warm-up other than the base is
named by it (`-wu<steps>`); the base points keep their names.
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
from keel.experiments.common import experiment_run, markdown_table, pm, pyplot, save, write_outputs
from keel.experiments.grid import Grid, LadderGrid, Search, _finite, grid_note, run_searches, search_grid
from keel.experiments.sweep import Sweep
from keel_studies.common import ExperimentConfig, grown_note, tiny_quick, tokens, unigram_level
from keel_studies.gradflow import measure


def _grids() -> dict[str, list[float]]:
    low, high = [3e-4, 1e-3, 3e-3], [1e-3, 3e-3, 1e-2]  # Post-LN-like schemes tolerate ~10x less (Table 1)
    return {"post_ln": low, "deepnorm": low, "pre_ln": high, "keel": high}


@dataclass
class FrontierConfig(ExperimentConfig):
    # fields that only add points (grid growth, tuned warm-ups: points named by their values; keel.experiments.sweep)
    ADDS_POINTS: ClassVar[tuple] = ("grow", "warmup_schemes", "warmup_from", "warmups", "warmups_below",
                                   "warmups_above")
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(warmup_steps=30))
    run: RunConfig = field(default_factory=lambda: experiment_run(steps=300, batch_size=4, eval_batches=128))
    schemes: list[str] = field(default_factory=lambda: ["post_ln", "deepnorm", "pre_ln", "keel"])
    depths: list[int] = field(default_factory=lambda: [64, 256, 1024])  # sub-layers
    lrs: dict[str, list[float]] = field(default_factory=_grids)  # the LR grid of each scheme
    deep_from: int = 1024  # at this depth and deeper, only the lowest `deep_grid` LRs of each grid run
    deep_grid: int = 2
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    learn_margin: float = 0.5  # nats below the unigram level that "learns" needs, in every seed
    stuck_margin: float = 0.1  # within this of the unigram level (or above) is "stuck"
    curve_every: int = 50  # report-half loss on `curve_batches` batches every this many steps (0: off)
    curve_batches: int = 2
    probe: bool = False  # budget_point's effective-depth probe (not part of this experiment's rules)
    probe_batches: int = 4
    grow: int = 0  # LR values added past one edge of an arm's grid before its choice is a bound (0: the grid as given)
    warmup_schemes: list[str] = field(default_factory=list)  # schemes whose warm-up is tuned too ...
    warmup_from: int = 1024  # ... at this depth and deeper
    warmups: list[int] = field(default_factory=lambda: [10, 30, 100])  # holds optim.warmup_steps
    warmups_below: list[int] = field(default_factory=lambda: [3, 1])  # the rule's values past the low edge
    warmups_above: list[int] = field(default_factory=lambda: [300])  # past the high edge; capped at run.steps

    @classmethod
    def quick(cls) -> FrontierConfig:
        return tiny_quick(cls, 6, schemes=["post_ln", "keel"], depths=[4, 8], seeds=[0, 1], deep_from=8,
                          lrs={"post_ln": [1e-3, 3e-3], "keel": [3e-3, 1e-2]}, deep_grid=1, curve_every=3,
                          curve_batches=1, warmup_from=8, warmups=[2, 3, 4], warmups_below=[1], warmups_above=[6])

    def grid(self, scheme: str, depth: int) -> list[float]:
        grid = sorted(self.lrs[scheme])
        return grid[:self.deep_grid] if depth >= self.deep_from else grid

    def warmup_ladders(self) -> tuple[list[int], list[int]]:
        """The values past the warm-up grid's low and high edges, the high ones capped at the whole run."""
        return list(self.warmups_below), [min(w, self.run.steps) for w in self.warmups_above]

    def tunes_warmup(self, scheme: str, depth: int) -> bool:
        return scheme in self.warmup_schemes and depth >= self.warmup_from


def check(cfg: FrontierConfig) -> None:
    """Refuses a warm-up search that cannot run (nothing to check while no warm-up is tuned)."""
    if not cfg.warmup_schemes:
        return
    below, above = cfg.warmup_ladders()
    lowest, highest = min(cfg.warmups, default=0), max(cfg.warmups, default=0)
    stray = [s for s in cfg.warmup_schemes if s not in cfg.schemes]
    problems = [
        (bool(stray), f"warmup_schemes holds {stray}, not among schemes {cfg.schemes}"),
        (len(set(cfg.warmups)) < 2, "warmups needs two values at least (a grid with an edge on each side)"),
        (cfg.optim.warmup_steps not in cfg.warmups,
         f"warmups must hold optim.warmup_steps ({cfg.optim.warmup_steps}, the warm-up every LR is first chosen at)"),
        (not all(a > b for a, b in zip([lowest, *below], below)), "warmups_below must fall from below the lowest "
                                                                   "warm-up"),
        (not all(b > a for a, b in zip([highest, *above], above)),
         "warmups_above (capped at run.steps) must rise from above the highest warm-up"),
    ]
    for bad, why in problems:
        if bad:
            raise ConfigError(f"frontier: {why}")


def gradient_profile(model, batches: list) -> dict:
    """Per-sub-layer parameter-gradient norms on one report batch, and bottom-eighth / top-eighth."""
    x, y = batches[0]
    grads = measure(model, x, y)["grad_params"]
    k = max(1, len(grads) // 8)
    bottom, top = np.mean(grads[:k]), np.mean(grads[-k:])
    return {"grad_params": grads, "grad_bottom_over_top": float(bottom / top) if top > 0 else float("inf")}


def mean_select(cfg: FrontierConfig, points: dict, scheme: str, depth: int, lr: float,
                warmup: int | None = None) -> float:
    """The mean select-half loss over all seeds at one LR and warm-up (default: the base warm-up); a diverged seed
    counts as +inf."""
    vals = [points[key_at(cfg, scheme, depth, lr, warmup, s)].get("select_loss") for s in cfg.seeds]
    return float(np.mean([v if v is not None and math.isfinite(v) else math.inf for v in vals]))


def choose(cfg: FrontierConfig, points: dict, scheme: str, depth: int, grid: list[float] | None = None) -> float:
    """The LR of `grid` (default: the arm's starting grid) with the lowest mean select-half loss over all seeds."""
    return min(grid or cfg.grid(scheme, depth), key=lambda lr: mean_select(cfg, points, scheme, depth, lr))


def key(scheme: str, depth: int, lr: float, seed: int) -> str:
    return f"{scheme}-{depth}-lr{lr:g}-seed{seed}"


def key_at(cfg: FrontierConfig, scheme: str, depth: int, lr: float, warmup: int | None, seed: int) -> str:
    """A point's name at a warm-up: `key`'s at the base warm-up (None or optim.warmup_steps: the names every point
    ran under before any warm-up was tuned), else with the warm-up in it."""
    if warmup is None or warmup == cfg.optim.warmup_steps:
        return key(scheme, depth, lr, seed)
    return f"{scheme}-{depth}-lr{lr:g}-wu{warmup}-seed{seed}"


def classify(losses: list[float | None], unigram: float, cfg: FrontierConfig) -> str:
    """"learns", "stuck" or "between" for one scheme at one depth, over every seed's report loss."""
    vals = [v if v is not None and math.isfinite(v) else math.inf for v in losses]
    if all(v <= unigram - cfg.learn_margin for v in vals):
        return "learns"
    if all(v >= unigram - cfg.stuck_margin for v in vals):
        return "stuck"
    return "between"


def lr_values(cfg: FrontierConfig, grids: dict[str, Grid] | None, scheme: str, depth: int) -> list[float]:
    """The LRs an arm chooses from at the base warm-up: its grid as `grow_grids` grew it, else its starting grid."""
    grown = (grids or {}).get(f"{scheme}-{depth}")
    return grown.values if grown else cfg.grid(scheme, depth)


def analyse(cfg: FrontierConfig, points: dict, unigram: float, grids: dict[str, Grid] | None = None,
            warmups: dict[str, dict] | None = None) -> dict:
    """Chosen LRs, report losses, classes, the frontier and the pre-registered verdicts; `grids` ("scheme-depth"
    -> Grid) the grown grids where `grow_grids` grew them; `warmups` ("scheme-depth" -> `tune_warmups`' result) the
    arms whose warm-up was tuned, each at its final (LR, warm-up)."""
    arms = {}
    for d in cfg.depths:
        for s in cfg.schemes:
            grown, values = (grids or {}).get(f"{s}-{d}"), lr_values(cfg, grids, s, d)
            tuned = (warmups or {}).get(f"{s}-{d}")
            lr, warmup = (tuned["lr"], tuned["warmup"]) if tuned else (choose(cfg, points, s, d, values), None)
            runs = [points[key_at(cfg, s, d, lr, warmup, seed)] for seed in cfg.seeds]
            losses = [r["report_loss"] for r in runs]
            arms[f"{s}-{d}"] = {"lr": lr, "report_losses": losses, "class": classify(losses, unigram, cfg),
                                "grad_bottom_over_top": [r.get("grad_bottom_over_top") for r in runs],
                                "select_by_lr": {f"{g:g}": [points[key(s, d, g, seed)]["select_loss"]
                                                            for seed in cfg.seeds] for g in values}}
            if grown:
                arms[f"{s}-{d}"]["lr_grid"] = grown.describe()
            if tuned:  # every (LR, warm-up) the arm ran: its LR grid at the base warm-up, then its search's
                tried = [(g, cfg.optim.warmup_steps) for g in values] + tuned["tried"]
                arms[f"{s}-{d}"] |= {k: v for k, v in tuned.items() if k not in ("lr", "tried")} | {
                    "select_by_hp": {f"{g:g}@{w}": [points[key_at(cfg, s, d, g, w, seed)]["select_loss"]
                                                    for seed in cfg.seeds] for g, w in tried}}
    frontier = {s: max((d for d in cfg.depths if arms[f"{s}-{d}"]["class"] == "learns"), default=None)
                for s in cfg.schemes}
    verdicts = {}
    if "keel" in cfg.schemes:
        lo, hi = min(cfg.depths), max(cfg.depths)
        for x in (s for s in cfg.schemes if s != "keel"):
            gaps = {d: stats.paired(arms[f"keel-{d}"]["report_losses"], arms[f"{x}-{d}"]["report_losses"])
                    for d in cfg.depths}
            per_seed = {d: [k - b if k is not None and b is not None else None for k, b in
                            zip(arms[f"keel-{d}"]["report_losses"], arms[f"{x}-{d}"]["report_losses"])]
                        for d in (lo, hi)}
            grows = stats.paired(per_seed[hi], per_seed[lo])
            verdicts[x] = {
                "gap": gaps,
                "trains_where_x_does_not": [d for d in cfg.depths if arms[f"keel-{d}"]["class"] == "learns"
                                            and arms[f"{x}-{d}"]["class"] == "stuck"],
                "advantage_grows": grows,
                "advantage_grows_verdict": stats.verdict(grows, "agrees (grows)", "disagrees (shrinks)"),
            }
    return {"arms": arms, "frontier": frontier, "verdicts": verdicts, "unigram": unigram}


def run(cfg: FrontierConfig, out: Path, command: str) -> dict:
    check(cfg)

    def job(scheme, depth, lr, seed, warmup=cfg.optim.warmup_steps):
        at = replace(cfg, optim=replace(cfg.optim, warmup_steps=warmup))
        return lambda: budget_point(at, at.point_model(scheme, depth), lr, seed, extra=gradient_profile)
    jobs = {key(s, d, lr, seed): job(s, d, lr, seed)
            for d in sorted(cfg.depths) for s in cfg.schemes for lr in cfg.grid(s, d) for seed in cfg.seeds}
    sweep = Sweep(out, cfg)
    points = sweep.run(jobs, "frontier")
    grids = grow_grids(cfg, sweep, points, job, cfg.schemes) if cfg.grow else None
    warmups = tune_warmups(cfg, sweep, points, grids, job)
    res = analyse(cfg, points, unigram_level(cfg), grids, warmups)
    a = res["arms"]
    rows = [[d] + [f"{pm(a[f'{s}-{d}']['report_losses'])} @ {_hp(cfg, a[f'{s}-{d}'])} ({a[f'{s}-{d}']['class']})"
                   for s in cfg.schemes] for d in cfg.depths]
    table = markdown_table(["sub-layers"] + [f"{s}: report loss @ LR (class)" for s in cfg.schemes], rows)
    vrows = []
    for x, v in res["verdicts"].items():
        vrows += [[f"keel - {x}", d, stats.describe(v["gap"][d]),
                   "yes" if d in v["trains_where_x_does_not"] else "no"] for d in cfg.depths]
    verdict_table = markdown_table(["pair", "sub-layers", "paired gap [95% CI], p", "Keel trains where X does not"],
                                   vrows) if vrows else ""
    grows = markdown_table(["pair", f"gap at {max(cfg.depths)} minus gap at {min(cfg.depths)}", "verdict"],
                           [[f"keel - {x}", stats.describe(v["advantage_grows"]), v["advantage_grows_verdict"]]
                            for x, v in res["verdicts"].items()]) if res["verdicts"] else ""
    frontier = ", ".join(f"{s}: {d if d is not None else 'none'}" for s, d in res["frontier"].items())
    tuned_note = " (\"wu N\" in the table: that arm's warm-up, tuned)" if cfg.warmup_schemes else ""
    notes = (f"Each run: {cfg.run.steps} steps x {cfg.run.batch_size}x{cfg.run.seq_len} = {tokens(cfg):,} tokens, "
             f"d={cfg.model.d_model}, warm-up {cfg.optim.warmup_steps}{tuned_note} then cosine; "
             f"LR per scheme and depth chosen from {dict(cfg.lrs)} (at >= {cfg.deep_from} sub-layers the lowest "
             f"{cfg.deep_grid}) by the mean "
             f"select-half loss over seeds {cfg.seeds}; report loss on {cfg.run.eval_batches} report-half batches. "
             f"Unigram level {res['unigram']:.3f} nats; learns = >= {cfg.learn_margin} below it in every seed, stuck "
             f"= within {cfg.stuck_margin} of it in every seed.\n\nFrontier (deepest depth that learns): "
             f"{frontier}.\n\n{verdict_table}\n\n{grows}")
    if cfg.grow:
        notes += "\n\n" + grown_note(cfg.grow, [(arm, a["lr_grid"]) for arm, a in res["arms"].items()
                                                 if a.get("lr_grid", {}).get("added")])
    if cfg.warmup_schemes:
        notes += "\n\n" + warmup_note(cfg, res["arms"])
    plots = [_plot(cfg, res, out)]
    write_outputs(out, "frontier", cfg, command, {"points": points, **res}, table, plots, notes)
    return res


def grow_grids(cfg, sweep: Sweep, points: dict, job, arms: list[str]) -> dict[str, Grid]:
    """Every arm's LR grid (`cfg.grid(arm, depth)`, `arms` at each of `cfg.depths`) grown past an edge choice by
    `cfg.grow` values at most, a round at a time (each round's new LRs, every seed, shallow depths first, run
    together so two processes share them), until every choice is interior or at its bound; `job(arm, depth, lr,
    seed)` makes a point. Adds the new points to `points`; returns "arm-depth" -> Grid. A one-value
    grid has no factor to grow by and stays as it is."""
    grids = {f"{s}-{d}": Grid(cfg.grid(s, d), cfg.grow) for d in sorted(cfg.depths) for s in arms
             if len(cfg.grid(s, d)) > 1}
    while True:
        new = {}
        for arm, grid in grids.items():
            s, d = arm.rsplit("-", 1)
            lr = grid.extend(lambda v, s=s, d=int(d): mean_select(cfg, points, s, d, v))
            if lr is not None:
                new |= {key(s, int(d), lr, seed): job(s, int(d), lr, seed) for seed in cfg.seeds}
        if not new:
            return grids
        points.update(sweep.run(new, "grown grids"))


def tune_warmup(cfg: FrontierConfig, scheme: str, depth: int, lr: float,
                score: Callable[[float, int], float]) -> Search:
    """The warm-up search for one arm whose LR `lr` was chosen at the base warm-up: the warm-up grid at that LR,
    grown through the ladders, then (if the warm-up moved) the LR grid again at the new warm-up; yields the (lr,
    warm-up) pairs to run, returns the final choice with its grids. `score(lr, warmup)`: the mean select-half
    loss over seeds."""
    below, above = cfg.warmup_ladders()
    wu_grid = LadderGrid(list(cfg.warmups), cfg.grow, below=below, above=above)
    warmup = yield from search_grid(wu_grid, lambda w: (lr, w), score)
    tuned = {"lr": lr, "warmup": warmup, "warmup_grid": wu_grid.describe(), "warmup_chosen_at_lr": lr}
    if warmup != cfg.optim.warmup_steps:  # one round of coordinate search: the LR again, and that is final
        lrs = cfg.grid(scheme, depth)
        again = Grid(lrs, cfg.grow) if len(lrs) > 1 else None  # one LR: the point just run at the new warm-up
        if again is not None:
            tuned["lr"] = yield from search_grid(again, lambda v: (v, warmup), score)
        tuned["lr_grid_again"] = again.describe() if again else {"values": lrs, "added": [], "bound": None}
    return tuned


def tune_warmups(cfg: FrontierConfig, sweep: Sweep, points: dict, grids: dict[str, Grid] | None,
                 job) -> dict[str, dict]:
    """The warm-up search for every arm of `warmup_schemes` at depths >= `warmup_from`, its LR first chosen at the
    base warm-up (from the grown `grids`); the arms' searches run side by side, each round's new points (every
    seed, shallow depths first) in one `sweep.run`, so two processes share them. `job(scheme, depth, lr, seed,
    warmup)` makes a point. Adds the points to `points`; returns "scheme-depth" -> the arm's final (lr, warmup),
    its grids and the (lr, warm-up) pairs it tried (none when no arm is tuned)."""
    searches = {(s, d): tune_warmup(cfg, s, d, choose(cfg, points, s, d, lr_values(cfg, grids, s, d)),
                                    lambda lr, w, s=s, d=d: mean_select(cfg, points, s, d, lr, w))
                for d in sorted(cfg.depths) for s in cfg.schemes if cfg.tunes_warmup(s, d)}

    def run_round(asked: dict[tuple[str, int], list[tuple[float, int]]]) -> None:
        points.update(sweep.run({key_at(cfg, s, d, lr, w, seed): job(s, d, lr, seed, w)
                                 for (s, d), hps in asked.items() for lr, w in hps for seed in cfg.seeds},
                                "warm-ups"))
    return {f"{s}-{d}": tuned for (s, d), tuned in run_searches(searches, run_round).items()}


def _hp(cfg: FrontierConfig, arm: dict) -> str:
    """An arm's LR for the table, with its warm-up where its search moved it off the base."""
    moved = arm.get("warmup", cfg.optim.warmup_steps) != cfg.optim.warmup_steps
    return f"{arm['lr']:g}" + (f", wu {arm['warmup']}" if moved else "")


def _grown(g: dict) -> str:
    """A grid's values with what was added and any bound, for a table cell."""
    note = grid_note(g)
    return ", ".join(f"{v:g}" for v in g["values"]) + (f" ({note[2:]})" if note else "")


def warmup_note(cfg: FrontierConfig, arms: dict) -> str:
    """The warm-up search in the report: the method, then per tuned arm the warm-ups tried, the LR grid run again,
    the final (LR, warm-up) and the mean select-half loss of every (LR, warm-up) it ran, in the order the search ran
    them."""
    base, (below, above) = cfg.optim.warmup_steps, cfg.warmup_ladders()
    rows = []
    for name, arm in arms.items():
        if "warmup_grid" not in arm:
            continue
        wu, again = arm["warmup_grid"], arm.get("lr_grid_again")
        select = ", ".join(f"{hp}: {np.mean([_finite(v) for v in seeds]):.3f}"
                           for hp, seeds in arm["select_by_hp"].items())
        rows.append([name, f"{arm['warmup_chosen_at_lr']:g}", _grown(wu), _grown(again) if again else "- (unchanged)",
                     f"{arm['lr']:g} at warm-up {arm['warmup']}", select])
    table = markdown_table(["arm", f"LR at warm-up {base}", "warm-ups at that LR", "LR grid again at the new warm-up",
                            "final", "mean select loss per LR@warm-up"], rows) if rows else "No arm at these depths."
    return (f"Warm-up tuned too (one round of coordinate search) for {', '.join(cfg.warmup_schemes)} at >= "
            f"{cfg.warmup_from} sub-layers: at the LR chosen at warm-up {base}, the warm-ups {cfg.warmups} with every "
            f"seed, grown past an edge choice through {below} below / {above} above (capped at the run's "
            f"{cfg.run.steps} steps) until the choice is interior or a bound (grow={cfg.grow} values added on that "
            f"side, or none left there); if the chosen warm-up is not {base}, the LR grid again at it (grown the same "
            f"way) and the LR chosen again. That (LR, warm-up) is the arm's for every number above (\"wu\" in the "
            f"table where it is not {base}).\n\n{table}")


def _plot(cfg: FrontierConfig, res: dict, out: Path) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, s in enumerate(cfg.schemes):
        arms = [res["arms"][f"{s}-{d}"] for d in cfg.depths]
        vals = np.array([[v if v is not None and math.isfinite(v) else np.nan for v in a["report_losses"]]
                         for a in arms])
        axes[0].plot(cfg.depths, np.nanmean(vals, 1), marker="o", color=f"C{i}", label=s)
        axes[0].fill_between(cfg.depths, np.nanmin(vals, 1), np.nanmax(vals, 1), color=f"C{i}", alpha=0.2)
        ratios = np.array([[r if r is not None else np.nan for r in a["grad_bottom_over_top"]] for a in arms])
        axes[1].plot(cfg.depths, np.nanmean(ratios, 1), marker="o", color=f"C{i}", label=s)
    u = res["unigram"]
    axes[0].axhline(u, color="grey", ls="--", lw=0.8, label="unigram level")
    axes[0].axhline(u - cfg.learn_margin, color="grey", ls=":", lw=0.8, label="learns below this")
    axes[0].set_ylabel(f"report-half loss at the chosen LR{' (and warm-up)' if cfg.warmup_schemes else ''} "
                       "(band: seed min..max)")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("grad norm, bottom eighth / top eighth (trained)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sub-layers (L)")
        ax.legend(fontsize=8)
    fig.suptitle(f"depth frontier, d={cfg.model.d_model}, {tokens(cfg):,} tokens per run", fontsize=10)
    return save(fig, out, "frontier.png")
