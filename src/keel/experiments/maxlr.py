"""The max-LR measurement (`measure: max_lr`, Table 1): the LR before the first failure on the paper's ramp."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from keel.config import TrainConfig
from keel.experiments import common, stats
from keel.experiments.detect import FailureRules, detect, smooth, stagnation
from keel.runtime import autocast_for

NOISE_LIMIT = 0.05  # nats: the detector's tested range (tests/test_detect.py)
RAMP_FIELDS = ("optim.warmup_steps", "optim.schedule", "optim.min_lr", "optim.decay_fraction")  # `ramp` sets them


def ramp(config: TrainConfig) -> TrainConfig:
    """`config` on the paper's ramp: its LR from 0 to `optim.lr` over the whole run, no decay."""
    return replace(config, optim=replace(config.optim, warmup_steps=config.run.steps, schedule="constant"))


def point(config: TrainConfig, eval_every: int, rules: FailureRules) -> dict:
    """Train `config` (a `ramp`), scoring the select half every `eval_every` steps, until detect confirms a
    failure or the ramp ends: the curve of evaluations (step, LR, loss) and the unigram level it is judged by."""
    run = config.run
    batches = common.fixed_batches(common.splits(config.data)["select"], run.seq_len, run.batch_size,
                                   run.eval_batches)
    unigram = common.unigram_loss(common.corpus(config.data).train, batches)
    evals, judged = {"step": [], "lr": [], "loss": []}, []

    def on_step(i, model, result):
        if (i + 1) % eval_every:
            return False
        evals["step"].append(i)
        evals["lr"].append(result.lr)
        evals["loss"].append(common.loss_on(model, batches, autocast_for(next(model.parameters()).device, run.dtype)))
        judged.append(detect(evals["loss"], unigram, rules, final=False))
        return judged[-1] is not None
    curve, _ = common.train_curve(config, eval_batches=0, on_step=on_step)
    if curve.stopped_at is not None and not (judged and judged[-1] is not None):
        evals["step"].append(curve.stopped_at)  # the guard stopped it: a non-finite loss or gradient
        evals["lr"].append(curve.lrs[-1])
        evals["loss"].append(float("nan"))
    return {"scheme": config.model.scheme, "clip": config.optim.grad_clip, "depth": config.model.n_sublayers,
            "seed": run.seed, "unigram": unigram, "evals": evals, "train_losses": curve.losses,
            "seconds": curve.seconds}


def eval_noise(values: list[float], unigram: float, rules: FailureRules) -> float | None:
    """Robust SD (1.4826 x MAD) of the curve around its running median (window 9) from its first evaluation below
    the unigram level: the noise the detector sees. None (not "reliable") with fewer than 10 evaluations there."""
    finite = [v for v in values if math.isfinite(v)]
    finite = finite[next((k for k, v in enumerate(finite) if v < unigram - rules.margin), len(finite)):]
    if len(finite) < 10:
        return None
    residuals = [v - c for v, c in zip(finite[8:], smooth(finite, 9)[8:])]
    middle = statistics.median(residuals)
    return 1.4826 * statistics.median(abs(r - middle) for r in residuals)


def healthy(r: dict, rules: FailureRules) -> list[float]:
    """A point's validation curve up to where its own failure (detect's rules, not stagnation) starts."""
    hit = detect(r["evals"]["loss"], r["unigram"], rules)
    return r["evals"]["loss"][:hit.index if hit else None]


def verdict(r: dict, rules: FailureRules, peak: float, others: dict[str, dict] | None = None) -> dict:
    """The failure and max LR of point `r` on a ramp to `peak`. `others`: {arm: point} of its stagnation references
    at the same cell and seed (none: that rule is not applied)."""
    values = r["evals"]["loss"]
    hit = detect(values, r["unigram"], rules)
    reference = None
    if others:
        labels, mine = list(others), healthy(r, rules)
        refs = [healthy(others[label], rules) for label in labels]
        for label, ref in zip(labels, refs):  # index-aligned curves: the same evaluation steps
            n = min(len(mine), len(ref))
            if others[label]["evals"]["step"][:n] != r["evals"]["step"][:n]:
                raise ValueError(f"max-lr {label}: evaluated at other steps than the point it is compared with")
        stuck = stagnation(mine, refs, rules)
        if stuck is not None and (hit is None or stuck.index < hit.index):
            hit, reference = stuck, labels[stuck.reference]
    noise = eval_noise(values[:hit.index] if hit else values, r["unigram"], rules)
    out = {"noise_sd": noise, "reliable": noise is not None and noise <= NOISE_LIMIT,
           "learned": min(values, default=math.inf) < r["unigram"] - rules.margin, "reference": reference}
    if hit is None:
        return out | {"max_lr": peak, "rule": None, "failed": False, "at_step": None}
    lrs = r["evals"]["lr"]
    return out | {"max_lr": lrs[hit.index - 1] if hit.index > 0 else 0.0, "rule": hit.rule, "failed": True,
                  "at_step": r["evals"]["step"][hit.index]}


def references(configs: dict[str, TrainConfig]) -> dict[str, list[str]]:
    """Each arm's stagnation references among `configs` (one cell's arms): the arms of other schemes that clip."""
    return {arm: [o for o, c in configs.items() if c.model.scheme != mine.model.scheme and c.optim.grad_clip > 0]
            for arm, mine in configs.items()}


def judge(points: dict[str, dict], refs: dict[str, list[str]], rules: FailureRules,
          peaks: dict[str, float]) -> dict[str, dict]:
    """Every arm's verdict at one cell and seed (`points`: arm -> point), each against its `refs`."""
    return {arm: verdict(r, rules, peaks[arm], {o: points[o] for o in refs[arm]}) for arm, r in points.items()}


def ratio_verdict(keel: list[dict], other: list[dict], paper: float | None) -> dict:
    """Keel / X on per-seed verdicts: a paired two-sided t-test of log(max LR). A max LR is a lower bound where the run
    never failed, an upper bound where it never learned; no verdict such a bound could have produced ("agrees" needs
    Keel exact or lower, X exact or upper), nor on a curve noisier than NOISE_LIMIT. `paper`: a published ratio."""
    log = lambda v: math.log(v["max_lr"]) if v["max_lr"] > 0 else None
    test = stats.paired([log(v) for v in keel], [log(v) for v in other])
    out = {"test": test, "ratio": math.exp(test["mean"]) if test["n"] else None,
           "ratio_ci95": [math.exp(c) for c in test["ci95"]] if test["ci95"] else None, "paper": paper}
    noisy = any(v["noise_sd"] is not None and v["noise_sd"] > NOISE_LIMIT for v in keel + other)
    keel_low = any(not v["failed"] for v in keel)  # Keel's true max LR could be higher
    keel_high = any(v["failed"] and not v["learned"] for v in keel)
    other_low = any(not v["failed"] for v in other)
    other_high = any(v["failed"] and not v["learned"] for v in other)
    call = stats.verdict(test, "disagrees", "agrees")
    if call != "inconclusive" and noisy:
        call = "inconclusive (a curve noisier than the detector's tested range)"
    elif call == "agrees" and (keel_high or other_low) or call == "disagrees" and (keel_low or other_high):
        call = "inconclusive (a bound in the direction of the claim)"
    size = None
    if out["ratio_ci95"] is not None and paper is not None:
        lo, hi = out["ratio_ci95"]
        size = "within the 95% CI" if lo <= paper <= hi else ("above the CI" if paper > hi else "below the CI")
    return out | {"verdict": call, "paper_ratio_vs_ci": size}


def report(cells: dict[str, dict[str, list[tuple[dict, dict]]]], seeds: list, base: TrainConfig, every: int,
           rules: FailureRules, versus: str, published: dict[str, float], out, name: str) -> tuple:
    """(results, markdown, plots, notes) of a study's verdicts (`cells`: cell -> arm -> per-seed (point, verdict)):
    each arm's max LR (and over `versus`'s), each `published` ratio ("a/b" -> the paper's) by `ratio_verdict`, a plot
    per cell (named by its sub-layers where they tell the cells apart)."""
    rows, table, ratios, ratio_rows, plots = [], {}, {}, [], []
    depths = {c: {r["depth"] for runs in arms.values() for r, _ in runs} for c, arms in cells.items()}
    by_depth = all(len(d) == 1 for d in depths.values()) and len({min(d) for d in depths.values()}) == len(cells)
    for cell, arms in cells.items():
        ref = common.mean_sd([v["max_lr"] for _, v in arms[versus]])[0] if versus in arms else None
        for arm, runs in arms.items():
            vs, lrs = [v for _, v in runs], [v["max_lr"] for _, v in runs]
            (m, sd), failed = common.mean_sd(lrs), sum(v["failed"] for v in vs)
            rule = ", ".join(sorted({v["rule"] for v in vs if v["rule"]})) or "-"
            known = [v["noise_sd"] for v in vs if v["noise_sd"] is not None]
            noise, unknown = max(known, default=None), len(vs) - len(known)
            table[f"{arm}-{cell}" if cell else arm] = {
                "mean": m, "sd": sd, "per_seed": lrs, "failed_seeds": failed, "rules": rule, "max_noise_sd": noise,
                "seeds_without_noise_estimate": unknown, "unreliable_seeds": sum(not v["reliable"] for v in vs)}
            note = "-" if noise is None else f"{noise:.3f}" + ("" if noise <= NOISE_LIMIT else " (unreliable)")
            note += f"; {unknown} seed(s) with < 10 evaluations below the unigram level: unreliable" if unknown else ""
            rows.append([cell or "-", arm, runs[0][0]["depth"], f"{m:.4g} ± {sd:.2g}", " / ".join(
                f"{x:.4g}" if v["failed"] else f">= {x:.4g}" for x, v in zip(lrs, vs)), f"{failed}/{len(vs)}", rule,
                f"{m / ref:.2f}" if ref else "-", note])
        for pair, paper in published.items():
            a, b = pair.split("/")
            r = ratios[f"{pair}-{cell}" if cell else pair] = ratio_verdict(*([v for _, v in arms[x]] for x in (a, b)),
                                                                           paper)
            ci, p = "-" if r["ratio_ci95"] is None else "[{:.3g}, {:.3g}]".format(*r["ratio_ci95"]), r["test"]["p"]
            ratio_rows.append([f"{a} / {b}", cell or "-", arms[a][0][0]["depth"], "-" if r["ratio"] is None else
                               f"{r['ratio']:.3g}", ci, "n/a" if p is None else f"{p:.2g}", r["test"]["n"],
                               f"{paper:g}", r["paper_ratio_vs_ci"] or "-", r["verdict"]])
        at = f"{min(depths[cell])} sub-layers" if by_depth else cell
        plots.append(plot(arms, seeds, f"{name}, {at}", out, f"maxlr-{at.split()[0]}.png"))
    text = common.markdown_table(["cell", "arm", "sub-layers", "max LR (mean ± SD)", "per seed", "failed", "rules",
                                  f"vs {versus}", "eval noise SD (max)"], rows) + ("\n\n" + common.markdown_table(
        ["ratio", "cell", "sub-layers", "geometric mean", "95% CI", "p (paired t, log)", "seeds", "paper",
         "paper's ratio", "verdict"], ratio_rows) if ratio_rows else "")
    every_run = [v for arms in cells.values() for runs in arms.values() for _, v in runs]
    smallest = min((v["max_lr"] for v in every_run if v["failed"] and v["max_lr"] > 0), default=None)
    step, run = base.optim.lr / base.run.steps, base.run
    share = f" = {100 * step / smallest:.2f}% of the smallest max LR measured ({smallest:.3g})" if smallest else ""
    notes = (f"LR: linear warm-up 0 -> {base.optim.lr:g} over {run.steps} steps of {run.batch_size}x{run.seq_len} "
             f"tokens, d={base.model.d_model}; {len(seeds)} seeds; validation loss on {run.eval_batches} fixed "
             f"batches of the select half every {every} steps. One step moves the LR by {step:.3g}{share}; failures "
             f"are located to {every} steps ({step * every:.3g} in LR). Rules ({rules}): see keel/experiments/"
             "detect.py; stagnation is judged against the best arm of another scheme that clips, at the same step and "
             "seed. max LR = LR at the last evaluation before the failure; '>= peak' runs count as the peak in the "
             f"mean. Eval noise SD above {NOISE_LIMIT} nats is outside the detector's tested range, and a curve with "
             "fewer than 10 evaluations below the unigram level has no noise estimate: both unreliable. Ratios: paired "
             "two-sided t-test on per-seed log(max LR), p < 0.05; a verdict a censored ('>=') or never-learned bound "
             "could have produced is not drawn (keel.experiments.maxlr.ratio_verdict).")
    resolution = {"lr_per_step": step, "lr_per_eval": step * every, "smallest_max_lr": smallest,
                  "per_step_fraction_of_smallest": step / smallest if smallest else None}
    return {"table": table, "ratios": ratios, "resolution": resolution}, text, plots, notes


def plot(arms: dict[str, list[tuple[dict, dict]]], seeds: list, title: str, out, name: str) -> str:
    """A panel per arm (arm -> per-seed (point, verdict)): each seed's curve against the LR, dotted at its max LR."""
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(arms), figsize=(3.2 * len(arms), 3.6), sharey=True, squeeze=False)
    curves = [r["evals"]["loss"] for runs in arms.values() for r, _ in runs]
    unigram, finite = next(iter(arms.values()))[0][0]["unigram"], [v for c in curves for v in c if math.isfinite(v)]
    # up to where the curves start (or 2 nats above the unigram level): a diverging curve leaves the plot at the top
    top = min(max(finite, default=unigram), max(unigram + 2.0, *(c[0] for c in curves if c and math.isfinite(c[0]))))
    for ax, (arm, runs) in zip(axes[0], arms.items()):
        for j, (seed, (r, v)) in enumerate(zip(seeds, runs)):
            ax.plot(r["evals"]["lr"], r["evals"]["loss"], color=f"C{j}", lw=0.9, label=f"seed {seed}")
            if v["failed"]:
                ax.axvline(v["max_lr"], color=f"C{j}", ls=":", lw=1)
        ax.axhline(unigram, color="grey", ls="--", lw=0.8, label="unigram level")
        ax.set(title=arm, xlabel="learning rate (linear ramp)", ylim=(min(finite, default=unigram) - 0.1, top + 0.1))
    axes[0][0].set_ylabel("validation loss (select half)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"{title} (dotted: max LR per seed)", fontsize=10)
    return common.save(fig, out, name)


def settings(doc: dict) -> tuple[int, FailureRules]:
    """(eval_every, rules) of a study's `max_lr` mapping (read and checked by keel.experiments.study_file)."""
    return doc.get("eval_every", 2), replace(FailureRules(), **doc.get("rules", {}))
