"""tuned: does Post-LN still beat Keel at 64 sub-layers and ~1M tokens when Keel's LR *and* alpha are tuned as
carefully as Post-LN's? (issue 21 item 5; results/README.md, rule 19, written before the runs.)

`depth-long/` found Post-LN with warm-up better than Keel at 64 sub-layers and 1.02M tokens, both at the LR the
short `depth/` runs chose (3e-3), while the ablations found alpha = sqrtL better than alpha = L at 153,600 tokens.
Here every arm (a scheme plus an alpha) at one depth runs every LR of one grid with every seed, for the same
budget:
  - the LR of each arm is the one with the lowest mean select-half loss over *all* seeds (a diverged seed counts
    as +inf; keel.experiments.frontier.choose);
  - "tuned Keel" is the Keel arm (alpha = L or sqrtL) whose chosen LR has the lowest mean select-half loss: alpha
    is chosen on the select half exactly as the LR is;
  - every reported loss is on the whole report half (`run.eval_batches` covers all of its windows), at the chosen
    LR, for every seed; verdicts are paired two-sided t-tests over the seeds (keel.experiments.stats).
`grow` > 0 (rule 23): an arm's LR chosen at an edge of its grid is a bound, so the grid grows past that edge
(keel.experiments.frontier.grow_grids) until the choice is interior or `grow` values were added on that side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

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
from keel.experiments.frontier import choose, grow_grids, key
from keel.experiments.grid import Grid, grown_note
from keel.experiments.sweep import Sweep
from keel.train.config import OptimConfig, RunConfig


@dataclass
class TunedConfig(ExperimentConfig):
    arms: dict[str, str] = field(default_factory=lambda: {"post_ln": "post_ln", "keel": "keel",
                                                          "keel-sqrtL": "keel"})  # label -> scheme
    alphas: dict[str, str] = field(default_factory=lambda: {"keel-sqrtL": "sqrtL"})  # label -> alpha (default: L)
    baseline: str = "post_ln"  # the arm tuned Keel is judged against
    depths: list[int] = field(default_factory=lambda: [64])  # sub-layers (one depth carries the verdict)
    lrs: dict[str, list[float]] = field(default_factory=lambda: {a: [1e-3, 3e-3, 1e-2]
                                                                 for a in ("post_ln", "keel", "keel-sqrtL")})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(warmup_steps=100))
    # 2,000 x 8 x 64 = 1.02M tokens (depth-long's budget); 448 batches = every window of the report half
    run: RunConfig = field(default_factory=lambda: experiment_run(steps=2000, eval_batches=448))
    curve_every: int = 250  # report-half loss on `curve_batches` batches every this many steps (0: off)
    curve_batches: int = 4
    probe: bool = False  # budget_point's effective-depth probe (not part of this experiment's rules)
    probe_batches: int = 4
    grow: int = 0  # LR values added past one edge of an arm's grid before its choice is a bound (0: rule 19)

    PER_POINT: ClassVar[dict[str, str]] = ExperimentConfig.PER_POINT | {"model.scheme": "arms",
                                                                        "model.alpha": "alphas"}

    @classmethod
    def quick(cls) -> TunedConfig:
        return tiny_quick(cls, 6, depths=[4], seeds=[0, 1], curve_every=3, curve_batches=1,
                          lrs={a: [3e-3, 1e-2] for a in ("post_ln", "keel", "keel-sqrtL")})

    def grid(self, arm: str, depth: int) -> list[float]:  # every depth runs the whole grid
        return sorted(self.lrs[arm])

    def arm_model(self, label: str, depth: int):
        return self.point_model(self.arms[label], depth, alpha=self.alphas.get(label))


def analyse(cfg: TunedConfig, points: dict, unigram: float, grids: dict[str, Grid] | None = None) -> dict:
    """Chosen LRs per arm, the tuned Keel arm, and the pre-registered verdicts, per depth; `grids` ("arm-depth" ->
    Grid) the grown grids where rule 23 grew them."""
    out = {"unigram": unigram, "depths": {}}
    keels = [a for a in cfg.arms if cfg.arms[a] == "keel"]
    for d in cfg.depths:
        arms = {}
        for a in cfg.arms:
            grown = (grids or {}).get(f"{a}-{d}")
            values = grown.values if grown else cfg.grid(a, d)
            lr = choose(cfg, points, a, d, values)
            sel = [points[key(a, d, lr, s)].get("select_loss") for s in cfg.seeds]
            arms[a] = {"lr": lr, "report_losses": [points[key(a, d, lr, s)]["report_loss"] for s in cfg.seeds],
                       "mean_select": float(np.mean([v if v is not None and math.isfinite(v) else math.inf
                                                     for v in sel])),
                       "select_by_lr": {f"{g:g}": [points[key(a, d, g, s)].get("select_loss") for s in cfg.seeds]
                                        for g in values},
                       "diverged": {f"{g:g}": sum(points[key(a, d, g, s)]["diverged"] for s in cfg.seeds)
                                    for g in values}}
            if grown:
                arms[a]["lr_grid"] = grown.describe()
        res = {"arms": arms}
        if keels:
            tuned = min(keels, key=lambda a: arms[a]["mean_select"])
            vs = stats.paired(arms[tuned]["report_losses"], arms[cfg.baseline]["report_losses"])
            res |= {"tuned_keel": tuned, "tuned_vs_baseline": vs,
                    "verdict": stats.verdict(vs, "Keel wins", f"{cfg.baseline} still wins"),
                    "each_keel_vs_baseline": {a: stats.paired(arms[a]["report_losses"],
                                                              arms[cfg.baseline]["report_losses"]) for a in keels}}
            if {"keel", "keel-sqrtL"} <= set(keels):
                sq = stats.paired(arms["keel-sqrtL"]["report_losses"], arms["keel"]["report_losses"])
                res |= {"sqrtL_vs_L": sq, "sqrtL_verdict": stats.verdict(sq, "agrees (sqrtL better)",
                                                                         "disagrees (alpha = L better)")}
        out["depths"][d] = res
    return out


def run(cfg: TunedConfig, out: Path, command: str) -> dict:
    def job(label, depth, lr, seed):
        return lambda: budget_point(cfg, cfg.arm_model(label, depth), lr, seed)
    jobs = {key(a, d, lr, seed): job(a, d, lr, seed)
            for d in sorted(cfg.depths) for seed in cfg.seeds for a in cfg.arms for lr in cfg.grid(a, d)}
    sweep = Sweep(out, cfg)
    points = sweep.run(jobs, "tuned")
    grids = grow_grids(cfg, sweep, points, job, list(cfg.arms)) if cfg.grow else None
    res = analyse(cfg, points, unigram_level(cfg), grids)
    rows, vrows = [], []
    for d, r in res["depths"].items():
        for a, arm in r["arms"].items():
            grid = ", ".join(f"{lr}: {pm(v)}" + (f" ({arm['diverged'][lr]} diverged)" if arm["diverged"][lr] else "")
                             for lr, v in arm["select_by_lr"].items())
            rows.append([d, a, f"{arm['lr']:g}", pm(arm["report_losses"]), grid])
        if "tuned_keel" in r:
            vrows.append([d, f"tuned Keel ({r['tuned_keel']}) - {cfg.baseline}", stats.describe(r["tuned_vs_baseline"]),
                          r["verdict"]])
            vrows += [[d, f"{a} - {cfg.baseline}", stats.describe(t), "(reported)"]
                      for a, t in r["each_keel_vs_baseline"].items()]
            if "sqrtL_vs_L" in r:
                vrows.append([d, "keel-sqrtL - keel", stats.describe(r["sqrtL_vs_L"]), r["sqrtL_verdict"]])
    table = markdown_table(["sub-layers", "arm", "chosen LR", "report loss (mean ± SD over seeds)",
                            "select loss per LR"], rows)
    verdicts = markdown_table(["sub-layers", "pair", "paired report-loss gap [95% CI], p", "verdict"], vrows)
    notes = (f"Each run: {cfg.run.steps} steps x {cfg.run.batch_size}x{cfg.run.seq_len} = {tokens(cfg):,} tokens, "
             f"d={cfg.model.d_model}, warm-up {cfg.optim.warmup_steps} then cosine; arms {dict(cfg.arms)} with "
             f"alphas {dict(cfg.alphas)} (others alpha = L); every LR of {dict(cfg.lrs)} with every seed {cfg.seeds}; "
             f"LR per arm, and tuned Keel's alpha, chosen by the mean select-half loss over all seeds; report loss on "
             f"{cfg.run.eval_batches} report-half batches. Unigram level {res['unigram']:.3f} nats.\n\n{verdicts}")
    if cfg.grow:
        grown = [(f"{a}-{d}", arm["lr_grid"]) for d, r in res["depths"].items() for a, arm in r["arms"].items()
                 if arm.get("lr_grid", {}).get("added")]
        notes += "\n\n" + grown_note("rule 23", cfg.grow, grown)
    write_outputs(out, "tuned", cfg, command, {"points": points, **res}, table, [_plot(cfg, res, points, out)], notes)
    return res


def _plot(cfg: TunedConfig, res: dict, points: dict, out: Path) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    d = max(cfg.depths)
    arms = res["depths"][d]["arms"]
    for i, (a, arm) in enumerate(arms.items()):
        lrs = [float(g) for g in arm["select_by_lr"]]
        vals = np.array([[v if v is not None and math.isfinite(v) else np.nan for v in arm["select_by_lr"][g]]
                         for g in arm["select_by_lr"]])
        axes[0].plot(lrs, np.nanmean(vals, 1), marker="o", color=f"C{i}", label=a)
        axes[0].fill_between(lrs, np.nanmin(vals, 1), np.nanmax(vals, 1), color=f"C{i}", alpha=0.2)
        curves = [points[key(a, d, arm["lr"], s)]["evals"] for s in cfg.seeds]
        curves = [c for c in curves if len(c["loss"]) == len(curves[0]["loss"]) and c["loss"]]
        if curves:
            steps = np.array(curves[0]["step"]) + 1
            losses = np.array([c["loss"] for c in curves])
            axes[1].plot(steps, losses.mean(0), color=f"C{i}", label=f"{a} @ {arm['lr']:g}")
            axes[1].fill_between(steps, losses.min(0), losses.max(0), color=f"C{i}", alpha=0.2)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("peak LR")
    axes[0].set_ylabel("select-half loss (mean, band: seed min..max)")
    axes[1].axhline(res["unigram"], color="grey", ls="--", lw=0.8, label="unigram level")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel(f"report-half loss ({cfg.curve_batches} batches) at the chosen LR")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"tuned arms at {d} sub-layers, d={cfg.model.d_model}, {tokens(cfg):,} tokens per run", fontsize=10)
    return save(fig, out, "tuned.png")
