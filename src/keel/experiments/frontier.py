"""frontier: the deepest model each scheme still trains, at one token budget (issue 21; the paper's central claim,
which no table of the paper isolates).

Every scheme x depth x LR x seed trains from scratch for the same `run.steps` steps of `run.batch_size x
run.seq_len` tokens (default 300 x 4 x 64 = 76,800, the budget of benchmarks/deep-1024-learn), points in
order of depth so the cheap depths finish first. Method (results/README.md, "Round 3 rules", written before
the runs):
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
`grow` > 0 (rule 22, issue 38 item 2): an LR chosen at an edge of its grid is a bound, not a choice, so the grid
grows past that edge by the same factor (keel.experiments.grid) with every seed, until the choice is interior or
`grow` values were added on that side; the choice and the verdicts are then made on the grown grids. `grow=0` is
rule 15 as written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from keel.experiments import stats
from keel.experiments.budget import budget_point, tokens, unigram_level
from keel.experiments.common import (
    ExperimentConfig,
    experiment_run,
    markdown_table,
    pm,
    pyplot,
    save,
    tiny_quick,
    write_outputs,
)
from keel.experiments.gradflow import measure
from keel.experiments.grid import Grid, grown_note
from keel.experiments.sweep import Sweep
from keel.train.config import OptimConfig, RunConfig


def _grids() -> dict[str, list[float]]:
    low, high = [3e-4, 1e-3, 3e-3], [1e-3, 3e-3, 1e-2]  # Post-LN-like schemes tolerate ~10x less (Table 1)
    return {"post_ln": low, "deepnorm": low, "pre_ln": high, "keel": high}


@dataclass
class FrontierConfig(ExperimentConfig):
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
    grow: int = 0  # LR values added past one edge of an arm's grid before its choice is a bound (0: rule 15)

    @classmethod
    def quick(cls) -> FrontierConfig:
        return tiny_quick(cls, 6, schemes=["post_ln", "keel"], depths=[4, 8], seeds=[0, 1], deep_from=8,
                          lrs={"post_ln": [1e-3, 3e-3], "keel": [3e-3, 1e-2]}, deep_grid=1, curve_every=3,
                          curve_batches=1)

    def grid(self, scheme: str, depth: int) -> list[float]:
        grid = sorted(self.lrs[scheme])
        return grid[:self.deep_grid] if depth >= self.deep_from else grid


def gradient_profile(model, batches: list) -> dict:
    """Per-sub-layer parameter-gradient norms on one report batch, and bottom-eighth / top-eighth."""
    x, y = batches[0]
    grads = measure(model, x, y)["grad_params"]
    k = max(1, len(grads) // 8)
    bottom, top = np.mean(grads[:k]), np.mean(grads[-k:])
    return {"grad_params": grads, "grad_bottom_over_top": float(bottom / top) if top > 0 else float("inf")}


def mean_select(cfg: FrontierConfig, points: dict, scheme: str, depth: int, lr: float) -> float:
    """The mean select-half loss over all seeds at one LR (a diverged seed counts as +inf)."""
    vals = [points[key(scheme, depth, lr, s)].get("select_loss") for s in cfg.seeds]
    return float(np.mean([v if v is not None and math.isfinite(v) else math.inf for v in vals]))


def choose(cfg: FrontierConfig, points: dict, scheme: str, depth: int, grid: list[float] | None = None) -> float:
    """The LR of `grid` (default: the arm's starting grid) with the lowest mean select-half loss over all seeds."""
    return min(grid or cfg.grid(scheme, depth), key=lambda lr: mean_select(cfg, points, scheme, depth, lr))


def key(scheme: str, depth: int, lr: float, seed: int) -> str:
    return f"{scheme}-{depth}-lr{lr:g}-seed{seed}"


def classify(losses: list[float | None], unigram: float, cfg: FrontierConfig) -> str:
    """"learns", "stuck" or "between" for one scheme at one depth, over every seed's report loss."""
    vals = [v if v is not None and math.isfinite(v) else math.inf for v in losses]
    if all(v <= unigram - cfg.learn_margin for v in vals):
        return "learns"
    if all(v >= unigram - cfg.stuck_margin for v in vals):
        return "stuck"
    return "between"


def analyse(cfg: FrontierConfig, points: dict, unigram: float, grids: dict[str, Grid] | None = None) -> dict:
    """Chosen LRs, report losses, classes, the frontier and the pre-registered verdicts; `grids` ("scheme-depth"
    -> Grid) the grown grids where rule 22 grew them."""
    arms = {}
    for d in cfg.depths:
        for s in cfg.schemes:
            grown = (grids or {}).get(f"{s}-{d}")
            values = grown.values if grown else cfg.grid(s, d)
            lr = choose(cfg, points, s, d, values)
            runs = [points[key(s, d, lr, seed)] for seed in cfg.seeds]
            losses = [r["report_loss"] for r in runs]
            arms[f"{s}-{d}"] = {"lr": lr, "report_losses": losses, "class": classify(losses, unigram, cfg),
                                "grad_bottom_over_top": [r.get("grad_bottom_over_top") for r in runs],
                                "select_by_lr": {f"{g:g}": [points[key(s, d, g, seed)]["select_loss"]
                                                            for seed in cfg.seeds] for g in values}}
            if grown:
                arms[f"{s}-{d}"]["lr_grid"] = grown.describe()
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
    def job(scheme, depth, lr, seed):
        return lambda: budget_point(cfg, cfg.point_model(scheme, depth), lr, seed, extra=gradient_profile)
    jobs = {key(s, d, lr, seed): job(s, d, lr, seed)
            for d in sorted(cfg.depths) for s in cfg.schemes for lr in cfg.grid(s, d) for seed in cfg.seeds}
    sweep = Sweep(out, cfg)
    points = sweep.run(jobs, "frontier")
    grids = grow_grids(cfg, sweep, points, job, cfg.schemes) if cfg.grow else None
    res = analyse(cfg, points, unigram_level(cfg), grids)
    a = res["arms"]
    rows = [[d] + [f"{pm(a[f'{s}-{d}']['report_losses'])} @ {a[f'{s}-{d}']['lr']:g} ({a[f'{s}-{d}']['class']})"
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
    notes = (f"Each run: {cfg.run.steps} steps x {cfg.run.batch_size}x{cfg.run.seq_len} = {tokens(cfg):,} tokens, "
             f"d={cfg.model.d_model}, warm-up {cfg.optim.warmup_steps} then cosine; LR per scheme and depth chosen "
             f"from {dict(cfg.lrs)} (at >= {cfg.deep_from} sub-layers the lowest {cfg.deep_grid}) by the mean "
             f"select-half loss over seeds {cfg.seeds}; report loss on {cfg.run.eval_batches} report-half batches. "
             f"Unigram level {res['unigram']:.3f} nats; learns = >= {cfg.learn_margin} below it in every seed, stuck "
             f"= within {cfg.stuck_margin} of it in every seed.\n\nFrontier (deepest depth that learns): "
             f"{frontier}.\n\n{verdict_table}\n\n{grows}")
    if cfg.grow:
        notes += "\n\n" + grown_note("rule 22", cfg.grow, [(arm, a["lr_grid"]) for arm, a in res["arms"].items()
                                                              if a.get("lr_grid", {}).get("added")])
    plots = [_plot(cfg, res, out)]
    write_outputs(out, "frontier", cfg, command, {"points": points, **res}, table, plots, notes)
    return res


def grow_grids(cfg, sweep: Sweep, points: dict, job, arms: list[str]) -> dict[str, Grid]:
    """Rules 22 and 23: every arm's LR grid (`cfg.grid(arm, depth)`, `arms` at each of `cfg.depths`) grown past an
    edge choice by `cfg.grow` values at most, a round at a time (each round's new LRs, every seed, shallow depths
    first, run together so two processes share them), until every choice is interior or at its bound; `job(arm,
    depth, lr, seed)` makes a point. Adds the new points to `points`; returns "arm-depth" -> Grid. A one-value
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
    axes[0].set_ylabel("report-half loss at the chosen LR (band: seed min..max)")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("grad norm, bottom eighth / top eighth (trained)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sub-layers (L)")
        ax.legend(fontsize=8)
    fig.suptitle(f"depth frontier, d={cfg.model.d_model}, {tokens(cfg):,} tokens per run", fontsize=10)
    return save(fig, out, "frontier.png")
