"""The downstream measurement (`measure: downstream`, Appendix B): probe scores at equal loss, rankings."""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from keel import evals
from keel.config import TrainConfig
from keel.experiments import common, stats
from keel.model import TransformerLM
from keel.model.counting import count_params
from keel.runtime import autocast_for

CHANCE_MARGIN = 0.05


def point(config: TrainConfig) -> dict:
    """Train `config`; its curve of report-half loss and task accuracies (step 0, every `run.eval_tasks_every`
    steps, the end)."""
    run, data, tokenizer = config.run, config.data, common.corpus(config.data).tokenizer
    tasks = evals.resolve(run.eval_tasks)
    items = evals.prepare(tasks, data, tokenizer)  # generated now if need be, read once for every measurement
    batches = common.fixed_batches(common.splits(data)["report"], run.seq_len, run.batch_size, run.eval_batches)
    curve = {"step": [], "loss": [], "acc": {t.name: [] for t in tasks}, "score": [], "chance": {}}

    def measure(step: int, model) -> None:
        device = next(model.parameters()).device
        auto = autocast_for(device, run.dtype)
        curve["step"].append(step)
        curve["loss"].append(common.loss_on(model, batches, auto))
        scores = evals.score(model, tasks, data, tokenizer, max_items=run.eval_tasks_items, device=device,
                             autocast=auto, items=items)
        for name, s in scores.items():
            curve["acc"][name].append(s["acc"])
            curve["chance"][name] = s["chance"]
        curve["score"].append(float(np.mean([s["acc"] for s in scores.values()])))

    def on_step(i, model, result) -> bool:
        if run.eval_tasks_every and (i + 1) % run.eval_tasks_every == 0 and i + 1 < run.steps:
            measure(i + 1, model)
        return False
    torch.manual_seed(run.seed)  # train_curve seeds the same way before it would build the model: the same init
    model = TransformerLM(config.model)
    measure(0, model)  # the untrained model (scoring leaves the random generators as they were)
    result, model = common.train_curve(config, eval_batches=0, model=model, on_step=on_step)
    m = config.model
    out = {"arm_scheme": m.scheme, "n_sublayers": m.n_sublayers, "d_model": m.d_model, "n_params": count_params(m),
           "lr": config.optim.lr, "seed": run.seed, "tokens": run.steps * run.batch_size * run.seq_len,
           "diverged": result.stopped_at is not None, "stopped_at": result.stopped_at, "curve": curve,
           "train_losses": result.losses[::10], "seconds": result.seconds}
    if result.stopped_at is None:
        measure(run.steps, model)
    return out


def score_at(losses: list[float], scores: list[float], level: float) -> float | None:
    """The score where the curve's loss first reaches `level`: linear in the loss between the last evaluation
    above the level and the first one at or below it. None if the curve never gets there, or starts below it."""
    for k, loss in enumerate(losses):
        if loss <= level:
            if k == 0:
                return scores[0] if loss == level else None
            above = losses[k - 1]
            if not math.isfinite(above):
                return None
            return scores[k - 1] + (above - level) / (above - loss) * (scores[k] - scores[k - 1])
    return None


def final(p: dict, what: str) -> float | None:
    """A point's last-evaluation loss or score (None if it diverged)."""
    return None if p["diverged"] else p["curve"][what][-1]


def mean(values: list) -> float | None:
    """The mean of the finite values (None: there are none)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(vals)) if vals else None


def chance(p: dict) -> float:
    """A point's chance score: the mean of its tasks' chance accuracies."""
    return mean([c for c in p["curve"]["chance"].values() if c is not None]) or 0.0


def equal_loss(runs: dict[str, list[dict]], a: str, b: str) -> dict:
    """Arm a - arm b in score at l* (the highest final loss among both arms' seeds), per seed."""
    level = max((v for arm in (a, b) for p in runs[arm] if (v := final(p, "loss")) is not None), default=None)

    def read(p: dict, scores: list) -> float | None:
        return None if level is None or p["diverged"] else score_at(p["curve"]["loss"], scores, level)
    at = {arm: [read(p, p["curve"]["score"]) for p in runs[arm]] for arm in (a, b)}
    test, means = stats.paired(at[a], at[b]), {arm: mean(at[arm]) for arm in (a, b)}
    moot = all(m is None or m < chance(runs[a][0]) + CHANCE_MARGIN for m in means.values())
    verdict = "inconclusive (both at chance)" if moot else stats.verdict(test, "disagrees (scores lower)",
                                                                          "agrees (scores higher)")
    return {"level": level, "score_at_level": at, "mean_at_level": means, "test": test, "verdict": verdict,
            "per_task_at_level": {arm: {t: [read(p, p["curve"]["acc"][t]) for p in runs[arm]]
                                        for t in runs[arm][0]["curve"]["acc"]} for arm in (a, b)}}


def rankings(runs: dict[str, list[dict]], arms: list[str]) -> dict:
    """Per pair of arms, paired tests of the final loss and the final score; whether they rank it oppositely."""
    pairs = {}
    for a, b in itertools.combinations(arms, 2):
        loss, score = (stats.paired([final(p, w) for p in runs[a]], [final(p, w) for p in runs[b]])
                       for w in ("loss", "score"))
        by_loss = -np.sign(loss["mean"]) if stats.significant(loss) else 0  # +1: a ranks above b, 0: no order
        by_score = np.sign(score["mean"]) if stats.significant(score) else 0
        pairs[f"{a} vs {b}"] = {"loss": loss, "score": score, "by_loss": int(by_loss), "by_score": int(by_score),
                                "reversed": bool(by_loss * by_score == -1)}
    separated = [v for v in pairs.values() if v["by_loss"] != 0]
    verdict = ("agrees (the rankings differ)" if any(v["reversed"] for v in pairs.values()) else
               "disagrees (the probe ranking follows the loss ranking)"
               if separated and all(v["by_score"] == v["by_loss"] for v in separated) else "inconclusive")
    return {"pairs": pairs, "verdict": verdict}


def analyse(runs: dict[str, list[dict]], compare: list, untested: list, rank: list) -> dict:
    """The arms' finals, the equal-loss pairs (tested and not) and the rankings of `rank`."""
    arms = {arm: {"lr": rs[0]["lr"], "final_loss": [final(p, "loss") for p in rs],
                  "final_score": [final(p, "score") for p in rs], "n_params": rs[0]["n_params"]}
            for arm, rs in runs.items()}
    return {"arms": arms, "equal_loss": {f"{a} vs {b}": equal_loss(runs, a, b) for a, b in compare},
            "deep_vs_wide": rankings(runs, rank),
            "deep_vs_wide_equal_loss": {f"{a} vs {b}": equal_loss(runs, a, b) for a, b in untested}}


def report(res: dict, config: TrainConfig, seeds: list) -> tuple[str, str]:
    """The arms table and the notes (the method and the pairs' tables)."""
    table = common.markdown_table(
        ["arm", "parameters", "LR", "final report loss", "final score (mean probe accuracy)"],
        [[arm, f"{v['n_params']:,}", f"{v['lr']:g}", common.pm(v["final_loss"]), common.pm(v["final_score"])]
         for arm, v in res["arms"].items()])
    eq = common.markdown_table(
        ["A vs B", "l* (nats)", "A's score at l*", "B's score at l*", "A - B at l* [95% CI], p", "verdict"],
        [[name, "-" if c["level"] is None else f"{c['level']:.4f}",
          *("-" if m is None else f"{m:.3f}" for m in c["mean_at_level"].values()), stats.describe(c["test"]),
          c["verdict"] if name in res["equal_loss"] else "(reported, no verdict)"]
         for name, c in {**res["equal_loss"], **res["deep_vs_wide_equal_loss"]}.items()])
    ranked = res["deep_vs_wide"]
    ranks = common.markdown_table(
        ["A vs B", "loss A - B, p", "score A - B, p", "loss ranks A (+1 above)", "score ranks A (+1 above)",
         "reversed"],
        [[pair, stats.describe(v["loss"]), stats.describe(v["score"]), v["by_loss"], v["by_score"],
          "yes" if v["reversed"] else "no"] for pair, v in ranked["pairs"].items()])
    run = config.run
    notes = (f"Each run: {run.steps} steps x {run.batch_size}x{run.seq_len} = "
             f"{run.steps * run.batch_size * run.seq_len:,} tokens, d={config.model.d_model}, warm-up "
             f"{config.optim.warmup_steps} then cosine, seeds {seeds}, one LR per arm (not tuned here). Report-half "
             f"loss on {run.eval_batches} fixed batches and the tasks {', '.join(run.eval_tasks)} "
             f"({run.eval_tasks_items} items each) at step 0, every {run.eval_tasks_every} steps and at the end; "
             "score = mean accuracy over the tasks.\n\n**(a) Equal loss**: l* = the highest final loss among both "
             "arms' seeds; each run's score where its curve first reaches l* (linear between evaluations); paired "
             f"two-sided t-test on the per-seed A - B. Moot (inconclusive) when neither arm's mean score at l* is "
             f"{CHANCE_MARGIN} above chance. The untested pairs are the same test, reported without a verdict of "
             f"their own.\n\n{eq}\n\n**(b) Rankings** (the `rank` arms): paired tests of the final loss and the final "
             f"score per pair. The loss ranking differs from the probe ranking: **{ranked['verdict']}**.\n\n{ranks}")
    return table, notes


def plot(runs: dict[str, list[dict]], res: dict, panels: list[list[str]], config: TrainConfig, out) -> str:
    """A panel of score against loss per group of arms (each seed a line); l* of a group's first compare pair
    dotted (the last group, `rank`'s, has none)."""
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, arms in zip(axes[0], panels):
        for i, arm in enumerate(arms):
            for j, p in enumerate(runs[arm]):
                ax.plot(p["curve"]["loss"], p["curve"]["score"], color=f"C{i}", alpha=0.35, lw=0.8, marker=".", ms=3,
                        label=f"{arm} @ {p['lr']:g}" if j == 0 else None)
        ax.axhline(chance(runs[arms[0]][0]), color="grey", ls="--", lw=0.8, label="chance")
        pair = next((name for name in res["equal_loss"] if set(name.split(" vs ")) <= set(arms)), None) if (
            arms is not panels[-1]) else None
        if pair and res["equal_loss"][pair]["level"] is not None:
            ax.axvline(res["equal_loss"][pair]["level"], color="black", ls=":", lw=0.8, label=f"l* ({pair})")
        depths = {runs[arm][0]["n_sublayers"] for arm in arms}
        ax.invert_xaxis()
        ax.set_xlabel("report-half loss (nats; training goes right)")
        ax.set_title(f"{min(depths)} sub-layers" if len(depths) == 1 else "ranked (rank)", fontsize=9)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("score: mean probe accuracy (each line one seed)")
    run = config.run
    fig.suptitle(f"score vs loss, d={config.model.d_model}, {run.steps * run.batch_size * run.seq_len:,} tokens per "
                 "run", fontsize=10)
    return common.save(fig, out, "downstream.png")
