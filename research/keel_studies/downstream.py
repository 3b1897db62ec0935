"""downstream (the paper's Appendix B): do probe scores follow the loss, and does Keel score higher than Pre-LN at
equal loss?

Every arm trains from scratch for `run.steps` steps at one LR taken from the committed sweeps (`lrs`, never tuned
here). At step 0, every `run.eval_tasks_every` steps and at the end, each point records its report-half loss on
`run.eval_batches` fixed batches and its accuracy on every task of `run.eval_tasks` (`run.eval_tasks_items` items
each; the built-in probes, chance 0.25); the score is the mean accuracy over the tasks. Method (written before the
runs; results/PROTOCOL.md):
  - (a) equal loss: for arms A and B at one depth, the level l* is the highest final report loss among all of A's
    and B's seeds (the lowest loss every one of their runs reaches). Each run's score at l* is read off its
    curve where the loss first reaches l* (`score_at`: linear in the loss between the two evaluations around
    it). Per seed, d = score_A(l*) - score_B(l*); paired two-sided t-test (keel.experiments.stats).
  - (b) deep vs wide at equal parameters (as Table 5): deep Keel and deep Pre-LN at `deep_sublayers` (the same
    runs as (a) at that depth) and a wide Pre-LN shaped as deep-vs-wide's (results/deep-vs-wide/study.yaml). For
    each pair of arms, the paired test of the final report loss and of the final score: the loss ranking and the probe
    ranking "differ" when a pair is ordered one way by loss and the other way by score, both at p < 0.05.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from keel import evals
from keel.config import OptimConfig, RunConfig
from keel.errors import ConfigError
from keel.experiments import stats
from keel.experiments.common import (
    corpus,
    experiment_run,
    fixed_batches,
    loss_on,
    markdown_table,
    pm,
    point_config,
    pyplot,
    save,
    splits,
    train_curve,
    write_outputs,
)
from keel.experiments.sweep import Sweep
from keel.model import TransformerLM
from keel.model.counting import count_params
from keel.runtime import autocast_for
from keel_studies.common import ExperimentConfig, tiny_quick

WIDE = "wide-pre_ln"


def _lrs() -> dict[str, float]:
    """Each arm's LR from the committed sweeps (fixed before the runs, never tuned here): the LR `depth/` chose
    on the select half at 32 and 64 sub-layers (also depth-long's), and deep-vs-wide's choice for its wide arm."""
    return {"post_ln-32": 3e-3, "pre_ln-32": 3e-3, "keel-32": 3e-3,
            "post_ln-64": 3e-3, "pre_ln-64": 1e-3, "keel-64": 3e-3, WIDE: 3e-3}


@dataclass
class DownstreamConfig(ExperimentConfig):
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(warmup_steps=100))
    # eager: the method was fixed for (and its cost measured on) eager runs that reproduce depth-long-32's losses
    run: RunConfig = field(default_factory=lambda: experiment_run(
        steps=2000, batch_size=8, seq_len=64, eval_batches=16, eval_tasks=list(evals.PROBES), eval_tasks_every=250,
        eval_tasks_items=200, compile=False))
    schemes: list[str] = field(default_factory=lambda: ["post_ln", "pre_ln", "keel"])
    depths: list[int] = field(default_factory=lambda: [32, 64])  # sub-layers
    lrs: dict[str, float] = field(default_factory=_lrs)  # arm ("<scheme>-<sub-layers>" or "wide-pre_ln") -> LR
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    # (b): the deep arms are (a)'s Keel and Pre-LN at deep_sublayers; the wide arm's shape is deep-vs-wide's
    deep_sublayers: int = 32  # results/deep-vs-wide/study.yaml's arms
    wide_sublayers: int = 8
    wide_d_model: int = 128
    wide_heads: int = 8
    wide_kv_heads: int = 4
    chance_margin: float = 0.05  # a comparison where neither arm's mean score at l* exceeds chance by this is moot

    PER_POINT: ClassVar[dict[str, str]] = ExperimentConfig.PER_POINT | {
        "model.n_blocks": "depths / wide_sublayers", "model.scheme": "schemes (and the wide arm, pre_ln)"}

    def fixed_fields(self) -> dict[str, str]:
        fixed = super().fixed_fields()
        for name in ("run.eval_tasks", "run.eval_tasks_every", "run.eval_tasks_items"):  # this experiment's subject
            fixed.pop(name)
        return fixed

    @classmethod
    def quick(cls) -> DownstreamConfig:
        q = tiny_quick(cls, 8, depths=[4, 8], deep_sublayers=4, wide_sublayers=2, wide_d_model=64, wide_heads=4,
                       wide_kv_heads=2, seeds=[0, 1],
                       lrs={f"{s}-{d}": 3e-3 for s in ("post_ln", "pre_ln", "keel") for d in (4, 8)} | {WIDE: 3e-3})
        q.run = replace(q.run, eval_tasks_every=4, eval_tasks_items=8)
        return q

    def arms(self) -> dict[str, object]:
        """{arm: model config}: every scheme at every depth, the deep arms of (b), and the wide Pre-LN."""
        out = {f"{s}-{d}": self.point_model(s, d) for d in self.depths for s in self.schemes}
        for s in ("pre_ln", "keel"):
            out.setdefault(f"{s}-{self.deep_sublayers}", self.point_model(s, self.deep_sublayers))
        out[WIDE] = self.point_model("pre_ln", self.wide_sublayers, d_model=self.wide_d_model, n_heads=self.wide_heads,
                                     n_kv_heads=self.wide_kv_heads)  # Table 5's wide Pre-LN (deep-vs-wide's arm)
        return out


def key(arm: str, lr: float, seed: int) -> str:
    return f"{arm}-lr{lr:g}-seed{seed}"


def point(cfg: DownstreamConfig, model_cfg, lr: float, seed: int) -> dict:
    """Train one model; at step 0, every run.eval_tasks_every steps and at the end: report-half loss and task
    accuracies."""
    config = point_config(cfg, model_cfg, seed, lr=lr)
    tasks = evals.resolve(cfg.run.eval_tasks)
    tokenizer = corpus(cfg.data).tokenizer
    evals.prepare(tasks, cfg.data, tokenizer)
    batches = fixed_batches(splits(cfg.data)["report"], cfg.run.seq_len, cfg.run.batch_size, cfg.run.eval_batches)
    curve = {"step": [], "loss": [], "acc": {t.name: [] for t in tasks}, "score": [], "chance": {}}
    seconds = {"loss": 0.0, "tasks": 0.0}

    def measure(step, model):
        auto = autocast_for(next(model.parameters()).device, cfg.run.dtype)
        start = time.time()
        curve["step"].append(step)
        curve["loss"].append(loss_on(model, batches, auto))
        seconds["loss"] += time.time() - start
        start = time.time()
        scores = evals.score(model, tasks, cfg.data, tokenizer, max_items=cfg.run.eval_tasks_items,
                             device=next(model.parameters()).device, autocast=auto)
        seconds["tasks"] += time.time() - start
        for name, s in scores.items():
            curve["acc"][name].append(s["acc"])
            curve["chance"][name] = s["chance"]
        curve["score"].append(float(np.mean([s["acc"] for s in scores.values()])))

    every = cfg.run.eval_tasks_every

    def on_step(i, model, result):
        if every and (i + 1) % every == 0 and i + 1 < cfg.run.steps:
            measure(i + 1, model)
        return False

    torch.manual_seed(seed)  # train_curve seeds the same way before it would build the model: the same init
    model = TransformerLM(model_cfg)
    measure(0, model)  # the untrained model (scoring leaves the random generators as they were)
    result, model = train_curve(config, eval_batches=0, model=model, on_step=on_step)
    out = {"arm_scheme": model_cfg.scheme, "n_sublayers": model_cfg.n_sublayers, "d_model": model_cfg.d_model,
           "n_params": count_params(model_cfg), "lr": lr, "seed": seed, "tokens": cfg.run.steps * cfg.tokens_per_step(),
           "diverged": result.stopped_at is not None, "stopped_at": result.stopped_at, "curve": curve,
           "train_losses": result.losses[::10], "seconds": result.seconds, "eval_seconds": seconds}
    if result.stopped_at is None:
        measure(cfg.run.steps, model)
    return out


# ---- analysis ------------------------------------------------------------------------------------------

def score_at(losses: list[float], scores: list[float], level: float) -> float | None:
    """The score where the curve's loss first reaches `level`: linear in the loss between the last evaluation
    above the level and the first one at or below it. None if the curve never gets there, or starts below it."""
    for k, loss in enumerate(losses):
        if loss <= level:
            if k == 0:
                return scores[0] if loss == level else None
            above = losses[k - 1]  # > level: k is the first evaluation at or below it
            if not math.isfinite(above):
                return None
            w = (above - level) / (above - loss)
            return scores[k - 1] + w * (scores[k] - scores[k - 1])
    return None


def final(p: dict, what: str) -> float | None:
    """A finished point's last-evaluation loss or score (None if it diverged)."""
    return None if p["diverged"] else p["curve"][what][-1]


def equal_loss(cfg: DownstreamConfig, points: dict, a: str, b: str) -> dict:
    """(a) Equal loss: arm a - arm b in score at l* (the highest final loss among both arms' seeds), per seed."""
    runs = {arm: [points[key(arm, cfg.lrs[arm], s)] for s in cfg.seeds] for arm in (a, b)}
    finals = [final(p, "loss") for arm in (a, b) for p in runs[arm]]
    level = max((v for v in finals if v is not None), default=None)
    at = {arm: [score_at(p["curve"]["loss"], p["curve"]["score"], level) if level is not None and not p["diverged"]
                else None for p in runs[arm]] for arm in (a, b)}
    test = stats.paired(at[a], at[b])
    chance = _chance(runs[a][0])
    means = {arm: _mean(at[arm]) for arm in (a, b)}
    moot = all(m is None or m < chance + cfg.chance_margin for m in means.values())
    verdict = "inconclusive (both at chance)" if moot else stats.verdict(test, "disagrees (scores lower)",
                                                                          "agrees (scores higher)")
    return {"level": level, "score_at_level": at, "mean_at_level": means, "test": test, "verdict": verdict,
            "per_task_at_level": {arm: {t: [score_at(p["curve"]["loss"], p["curve"]["acc"][t], level)
                                            if level is not None and not p["diverged"] else None for p in runs[arm]]
                                        for t in runs[arm][0]["curve"]["acc"]} for arm in (a, b)}}


def rankings(cfg: DownstreamConfig, points: dict, arms: list[str]) -> dict:
    """(b) Deep vs wide: per pair of arms, paired tests of the final loss and the final score; whether they rank it
    the opposite way."""
    pairs = {}
    for a, b in itertools.combinations(arms, 2):
        va = [points[key(a, cfg.lrs[a], s)] for s in cfg.seeds]
        vb = [points[key(b, cfg.lrs[b], s)] for s in cfg.seeds]
        loss = stats.paired([final(p, "loss") for p in va], [final(p, "loss") for p in vb])
        score = stats.paired([final(p, "score") for p in va], [final(p, "score") for p in vb])
        # +1: a ranks above b (lower loss / higher score), -1: below, 0: no significant order
        by_loss = -_sign(loss["mean"]) if stats.significant(loss) else 0
        by_score = _sign(score["mean"]) if stats.significant(score) else 0
        pairs[f"{a} vs {b}"] = {"loss": loss, "score": score, "by_loss": by_loss, "by_score": by_score,
                                "reversed": by_loss * by_score == -1}
    separated = [v for v in pairs.values() if v["by_loss"] != 0]
    if any(v["reversed"] for v in pairs.values()):
        verdict = "agrees (the rankings differ)"
    elif separated and all(v["by_score"] == v["by_loss"] for v in separated):
        verdict = "disagrees (the probe ranking follows the loss ranking)"
    else:
        verdict = "inconclusive"
    return {"pairs": pairs, "verdict": verdict}


def analyse(cfg: DownstreamConfig, points: dict) -> dict:
    comparisons = {}
    for d in cfg.depths:
        for other in ("pre_ln", "post_ln"):
            if {"keel", other} <= set(cfg.schemes):
                comparisons[f"keel-{d} vs {other}-{d}"] = equal_loss(cfg, points, f"keel-{d}", f"{other}-{d}")
    deep = [f"keel-{cfg.deep_sublayers}", f"pre_ln-{cfg.deep_sublayers}", WIDE]
    wide_equal = {f"{a} vs {WIDE}": equal_loss(cfg, points, a, WIDE) for a in deep[:2]}
    arms = {arm: {"lr": cfg.lrs[arm],
                  "final_loss": [final(points[key(arm, cfg.lrs[arm], s)], "loss") for s in cfg.seeds],
                  "final_score": [final(points[key(arm, cfg.lrs[arm], s)], "score") for s in cfg.seeds],
                  "n_params": points[key(arm, cfg.lrs[arm], cfg.seeds[0])]["n_params"]} for arm in cfg.arms()}
    return {"arms": arms, "equal_loss": comparisons, "deep_vs_wide": rankings(cfg, points, deep),
            "deep_vs_wide_equal_loss": wide_equal}


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(vals)) if vals else None


def _chance(p: dict) -> float:
    chances = [c for c in p["curve"]["chance"].values() if c is not None]
    return float(np.mean(chances)) if chances else 0.0


# ---- the sweep and its report ------------------------------------------------------------------------

def run(cfg: DownstreamConfig, out: Path, command: str) -> dict:
    if not cfg.run.eval_tasks:
        raise ConfigError("run.eval_tasks: downstream scores tasks; name at least one (e.g. [brackets,indent])")
    arms = cfg.arms()
    missing = [a for a in arms if a not in cfg.lrs]
    if missing:
        raise ConfigError(f"lrs: no LR for {', '.join(missing)} (keys: '<scheme>-<sub-layers>' and '{WIDE}')")
    # a bad task name, or a corpus too small for a probe, fails before any training
    evals.prepare(evals.resolve(cfg.run.eval_tasks), cfg.data, corpus(cfg.data).tokenizer)
    jobs = {key(arm, cfg.lrs[arm], s): (lambda m=m, lr=cfg.lrs[arm], s=s: point(cfg, m, lr, s))
            for arm, m in sorted(arms.items(), key=lambda am: am[1].n_sublayers) for s in cfg.seeds}
    points = Sweep(out, cfg).run(jobs, "downstream")
    res = analyse(cfg, points)
    plots = [_plot(cfg, points, res, out)]
    write_outputs(out, "downstream", cfg, command, {"points": points, **res}, _tables(cfg, res)[0], plots,
                  _tables(cfg, res)[1])
    return res


def _tables(cfg: DownstreamConfig, res: dict) -> tuple[str, str]:
    a = res["arms"]
    arm_rows = [[arm, f"{v['n_params']:,}", f"{v['lr']:g}", pm(v["final_loss"]), pm(v["final_score"])]
                for arm, v in a.items()]
    table = markdown_table(["arm", "parameters", "LR (from the committed sweeps)", "final report loss",
                            "final score (mean probe accuracy)"], arm_rows)
    eq_rows = [[name, f"{c['level']:.4f}" if c["level"] is not None else "-",
                *(f"{m:.3f}" if m is not None else "-" for m in c["mean_at_level"].values()),
                stats.describe(c["test"]), c["verdict"] if name in res["equal_loss"] else "(reported, no verdict)"]
               for name, c in {**res["equal_loss"], **res["deep_vs_wide_equal_loss"]}.items()]
    eq = markdown_table(["A vs B", "l* (nats)", "A's score at l*", "B's score at l*",
                         "A - B at l* [95% CI], p", "verdict"], eq_rows)
    dw = res["deep_vs_wide"]
    dw_rows = [[pair, stats.describe(v["loss"]), stats.describe(v["score"]), v["by_loss"], v["by_score"],
                "yes" if v["reversed"] else "no"] for pair, v in dw["pairs"].items()]
    dw_table = markdown_table(["A vs B", "loss A - B, p", "score A - B, p", "loss ranks A (+1 above)",
                               "score ranks A (+1 above)", "reversed"], dw_rows)
    tokens = cfg.run.steps * cfg.tokens_per_step()
    notes = (f"Each run: {cfg.run.steps} steps x {cfg.run.batch_size}x{cfg.run.seq_len} = {tokens:,} tokens, "
             f"d={cfg.model.d_model}, warm-up {cfg.optim.warmup_steps} then cosine, seeds {cfg.seeds}, one LR per arm "
             f"(not tuned here). Report-half loss on {cfg.run.eval_batches} fixed batches and the tasks "
             f"{', '.join(cfg.run.eval_tasks)} ({cfg.run.eval_tasks_items} items each) at step 0, every "
             f"{cfg.run.eval_tasks_every} steps and at the end; score = mean accuracy over the tasks.\n\n"
             "**(a) Equal loss**: l* = the highest final loss among both arms' seeds; each run's score "
             "where its curve first reaches l* (linear between evaluations); paired two-sided t-test on the per-seed "
             f"A - B. Moot (inconclusive) when neither arm's mean score at l* is {cfg.chance_margin} above chance. "
             f"The deep-vs-wide pairs are the same test, reported without a verdict of their own.\n\n{eq}\n\n"
             f"**(b) Deep vs wide at equal parameters** (deep arms = the {cfg.deep_sublayers}-sub-layer runs "
             f"of (a)): paired tests of the final loss and the final score per pair. Appendix B's observation "
             f"(the loss ranking differs from the probe ranking): **{dw['verdict']}**.\n\n{dw_table}")
    return table, notes


def _plot(cfg: DownstreamConfig, points: dict, res: dict, out: Path) -> str:
    plt = pyplot()
    groups = {f"{d} sub-layers": [f"{s}-{d}" for s in cfg.schemes] for d in cfg.depths}
    groups["deep vs wide (equal parameters)"] = [f"keel-{cfg.deep_sublayers}", f"pre_ln-{cfg.deep_sublayers}", WIDE]
    levels = {f"{d} sub-layers": res["equal_loss"].get(f"keel-{d} vs pre_ln-{d}", {}).get("level")
              for d in cfg.depths}
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4.2), squeeze=False)
    for ax, (title, arms) in zip(axes[0], groups.items()):
        for i, arm in enumerate(arms):
            runs = [points[key(arm, cfg.lrs[arm], s)] for s in cfg.seeds]
            for j, p in enumerate(runs):
                c = p["curve"]
                ax.plot(c["loss"], c["score"], color=f"C{i}", alpha=0.35, lw=0.8, marker=".", ms=3,
                        label=f"{arm} @ {cfg.lrs[arm]:g}" if j == 0 else None)
        chance = _chance(points[key(arms[0], cfg.lrs[arms[0]], cfg.seeds[0])])
        ax.axhline(chance, color="grey", ls="--", lw=0.8, label="chance")
        if levels.get(title) is not None:
            ax.axvline(levels[title], color="black", ls=":", lw=0.8, label="l* (Keel vs Pre-LN)")
        ax.invert_xaxis()
        ax.set_xlabel("report-half loss (nats; training goes right)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("score: mean probe accuracy (each line one seed)")
    fig.suptitle(f"score vs loss, d={cfg.model.d_model}, {cfg.run.steps * cfg.tokens_per_step():,} tokens per run",
                 fontsize=10)
    return save(fig, out, "downstream.png")
