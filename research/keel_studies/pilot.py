"""depth-pilot: at what token budget does added depth help the best-tuned Pre-LN? (Method written before the runs;
results/PROTOCOL.md.)

Every "Keel wins at depth" row so far was measured where extra depth makes every scheme worse. Before a
depth sweep can say where Keel pays, it needs a budget at which depth pays at all. Here one scheme (Pre-LN,
the field's default) at a shallow and a deep depth is trained at each budget of `budgets`, in order:
  - every LR of the arm's grid runs with every seed; the LR is the one with the lowest mean select-half loss
    over all seeds (a diverged seed counts as +inf); a choice at the grid's edge grows the grid past that edge
    (keel.experiments.grid) until it is interior or `max_extensions` values were added on that side;
  - the deep - shallow report-half loss is judged per budget by a paired two-sided t-test over the seeds,
    Holm-adjusted over the budgets run; depth helps at a budget when the adjusted p < 0.05 and the gap is
    negative. The pilot's answer is the smallest such budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import numpy as np

from keel.config import OptimConfig, RunConfig
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
from keel.experiments.grid import Grid, _finite
from keel.experiments.sweep import Sweep


@dataclass
class PilotConfig(ExperimentConfig):
    scheme: str = "pre_ln"
    depths: list[int] = field(default_factory=lambda: [16, 64])  # sub-layers: shallow, deep
    budgets: list[int] = field(default_factory=lambda: [2000, 8000])  # steps of run.batch_size x run.seq_len
    lrs: list[float] = field(default_factory=lambda: [1e-3, 3e-3, 1e-2])  # the starting grid of every arm
    max_extensions: int = 2  # values added past one edge of an arm's grid before the choice is called a bound
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(warmup_steps=100))
    run: RunConfig = field(default_factory=lambda: experiment_run(eval_batches=448))  # the whole report half
    curve_every: int = 500
    curve_batches: int = 4
    probe: bool = False  # budget_point's probe (not part of this experiment's rules)
    probe_batches: int = 4

    PER_POINT: ClassVar[dict[str, str]] = ExperimentConfig.PER_POINT | {"model.scheme": "scheme",
                                                                        "run.steps": "budgets"}

    @classmethod
    def quick(cls) -> PilotConfig:
        return tiny_quick(cls, 6, depths=[2, 4], budgets=[4, 8], seeds=[0, 1], lrs=[3e-3, 1e-2], max_extensions=1,
                          curve_every=2, curve_batches=1)

    def at_budget(self, steps: int) -> PilotConfig:
        return replace(self, run=replace(self.run, steps=steps))


def key(steps: int, depth: int, lr: float, seed: int) -> str:
    return f"{steps}-{depth}-lr{lr:g}-seed{seed}"


def mean_select(cfg: PilotConfig, points: dict, steps: int, depth: int, lr: float) -> float:
    vals = [points[key(steps, depth, lr, s)].get("select_loss") for s in cfg.seeds]
    return float(np.mean([_finite(v) for v in vals]))


def sweep_budget(cfg: PilotConfig, sweep: Sweep, steps: int) -> tuple[dict, dict[int, Grid]]:
    """Every depth at `steps`, each on its own growing LR grid, all seeds; returns the points and the grids."""
    at = cfg.at_budget(steps)
    grids = {d: Grid(list(cfg.lrs), cfg.max_extensions) for d in cfg.depths}
    points: dict = {}

    def job(depth, lr, seed):
        return lambda: budget_point(at, at.point_model(cfg.scheme, depth), lr, seed)
    todo = {d: list(grids[d].values) for d in cfg.depths}
    while todo:
        jobs = {key(steps, d, lr, s): job(d, lr, s) for d in todo for lr in todo[d] for s in cfg.seeds}
        points |= sweep.run(jobs, f"depth-pilot {tokens(at):,} tokens")
        todo = {}
        for d, grid in grids.items():
            new = grid.extend(lambda lr, d=d, got=points: mean_select(cfg, got, steps, d, lr))
            if new is not None:
                todo[d] = [new]
    return points, grids


def analyse(cfg: PilotConfig, points: dict, grids: dict, unigram: float) -> dict:
    """Per budget: each depth's chosen LR and report losses, deep - shallow paired; Holm over the budgets."""
    shallow, deep = min(cfg.depths), max(cfg.depths)
    budgets = {}
    for steps in cfg.budgets:
        arms = {}
        for d in cfg.depths:
            grid = grids[steps][d]
            lr = grid.choice(lambda v, d=d, steps=steps: mean_select(cfg, points, steps, d, v))
            runs = [points[key(steps, d, lr, s)] for s in cfg.seeds]
            arms[d] = {"lr": lr, "grid": grid.describe(), "report_losses": [r["report_loss"] for r in runs],
                       "select_by_lr": {f"{v:g}": mean_select(cfg, points, steps, d, v) for v in grid.values},
                       "core_seconds": sum(points[key(steps, d, v, s)]["seconds"]
                                           for v in grid.values for s in cfg.seeds)}
        test = stats.paired(arms[deep]["report_losses"], arms[shallow]["report_losses"])
        budgets[steps] = {"tokens": steps * cfg.tokens_per_step(), "arms": arms, "deep_vs_shallow": test}
    adjusted = stats.holm([b["deep_vs_shallow"]["p"] for b in budgets.values()])
    for b, p in zip(budgets.values(), adjusted):
        t = b["deep_vs_shallow"]
        b["p_holm"] = p
        b["verdict"] = ("inconclusive" if p is None or p >= stats.ALPHA
                        else "depth helps" if t["mean"] < 0 else "depth hurts")
    helps = [s for s, b in budgets.items() if b["verdict"] == "depth helps"]
    return {"unigram": unigram, "shallow": shallow, "deep": deep, "budgets": budgets,
            "answer_steps": min(helps) if helps else None,
            "core_hours": sum(a["core_seconds"] for b in budgets.values() for a in b["arms"].values()) / 3600}


def run(cfg: PilotConfig, out: Path, command: str) -> dict:
    sweep, points, grids = Sweep(out, cfg), {}, {}
    for steps in cfg.budgets:  # cheapest first: its answer is known before the next budget starts
        got, grids[steps] = sweep_budget(cfg, sweep, steps)
        points |= got
    res = analyse(cfg, points, grids, unigram_level(cfg))
    rows, vrows = [], []
    for b in res["budgets"].values():
        for d, arm in b["arms"].items():
            g = arm["grid"]
            note = (f"; bound at the {g['bound']} edge" if g["bound"] else "") + (
                f"; added {g['added']}" if g["added"] else "")
            rows.append([f"{b['tokens']:,}", d, f"{arm['lr']:g}{note}", pm(arm["report_losses"]),
                         ", ".join(f"{lr}: {v:.3f}" for lr, v in arm["select_by_lr"].items()),
                         f"{arm['core_seconds'] / 3600:.2f}"])
        p = b["p_holm"]
        vrows.append([f"{b['tokens']:,}", f"{res['deep']} - {res['shallow']}", stats.describe(b["deep_vs_shallow"]),
                      "n/a" if p is None else f"{p:.2g}", b["verdict"]])
    table = markdown_table(["tokens", "sub-layers", "chosen LR", "report loss (mean ± SD over seeds)",
                            "mean select loss per LR", "core-hours"], rows)
    verdicts = markdown_table(["tokens", "pair", "paired report-loss gap [95% CI], raw p", "Holm p (over budgets)",
                               "verdict"], vrows)
    answer = (f"Depth first helps at {res['budgets'][res['answer_steps']]['tokens']:,} tokens."
              if res["answer_steps"] else "Depth helps at none of these budgets.")
    notes = (f"{cfg.scheme} at {cfg.depths} sub-layers, d={cfg.model.d_model}, {cfg.run.batch_size}x{cfg.run.seq_len} "
             f"tokens per step, warm-up {cfg.optim.warmup_steps} then cosine; LR per (budget, depth) from the grid "
             f"{cfg.lrs}, grown past an edge choice up to {cfg.max_extensions} values per side, chosen by the mean "
             f"select-half loss over seeds {cfg.seeds}; report loss on {cfg.run.eval_batches} report-half batches. "
             f"Unigram level {res['unigram']:.3f} nats. Cost: {res['core_hours']:.1f} core-hours (sum of point "
             f"times, one thread each).\n\n{verdicts}\n\n**{answer}**")
    write_outputs(out, "depth-pilot", cfg, command, {"points": points, **res}, table, [_plot(res, out)], notes)
    return res


def _plot(res: dict, out: Path) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, d in enumerate([res["shallow"], res["deep"]]):
        xs = [b["tokens"] for b in res["budgets"].values()]
        vals = [np.array([_finite(v) for v in b["arms"][d]["report_losses"]]) for b in res["budgets"].values()]
        ax.errorbar(xs, [v.mean() for v in vals], yerr=[v.std() for v in vals], marker="o", color=f"C{i}",
                    capsize=3, label=f"{d} sub-layers")
    ax.axhline(res["unigram"], color="grey", ls="--", lw=0.8, label="unigram level")
    ax.set_xscale("log")
    ax.set_xlabel("tokens per run")
    ax.set_ylabel("report-half loss at the chosen LR (mean ± SD)")
    ax.legend(fontsize=8)
    fig.suptitle("depth pilot: does the deeper model win at this budget?", fontsize=10)
    return save(fig, out, "depth-pilot.png")
