"""max-lr (paper Table 1): the largest learning rate each scheme tolerates.

The paper's protocol by default: the LR rises linearly from 0 to `optim.lr` = 5e-2 over `run.steps` = 5,000 steps,
at 16 and 64 sub-layers, 3 seeds. Every `eval_every` steps the model is scored on one fixed set of batches
from the "select" half of the validation split; keel.experiments.detect judges that curve (non-finite,
collapse to the unigram level, unrecovered rise above the running best) while it runs, and the run stops
once such a failure is confirmed, so most runs are short. Once every arm of a depth and seed has run, the
verdict step adds the paper's third failure mode, stagnation / slow convergence against the best other
scheme at the same step (detect.stagnation). The max tolerable LR is the LR at the last evaluation before the
earliest failure; a run that never fails is reported as ">= peak". Schemes listed in `no_clip` are also run
without gradient clipping ("<scheme>/noclip"; none by default, the paper clips); they are judged against the
clipped arms but never serve as a reference.

Keel / Pre-LN and Keel / Post-LN (Table 1: 1.32x and ~34x at 64 sub-layers) are judged by a paired two-sided
t-test on the per-seed log max-LR ratios (experiments/stats.py; `ratio_verdict` for the censoring rules).

Resolution: one step moves the LR by optim.lr / run.steps; the failure is located to within `eval_every` steps.
The report states both against the smallest max LR measured (the issue asks for <= 1% per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from keel.config import OptimConfig, RunConfig
from keel.experiments import stats
from keel.experiments.common import (
    ExperimentConfig,
    corpus,
    experiment_run,
    fixed_batches,
    loss_on,
    markdown_table,
    mean_sd,
    point_config,
    pyplot,
    save,
    splits,
    tiny_quick,
    train_curve,
    unigram_loss,
    write_outputs,
)
from keel.experiments.detect import FailureRules, detect, smooth, stagnation
from keel.experiments.sweep import Sweep
from keel.runtime import autocast_for


@dataclass
class MaxLRConfig(ExperimentConfig):
    """The LR ramps linearly from 0 to `optim.lr` (the peak) over the whole run of `run.steps` steps; the
    clipped arms clip at `optim.grad_clip`. `run.eval_batches` fixed batches of the select half are scored
    every `eval_every` steps."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-2))
    run: RunConfig = field(default_factory=lambda: experiment_run(steps=5000, eval_batches=2))
    schemes: list[str] = field(default_factory=lambda: ["post_ln", "deepnorm", "pre_ln", "keel"])
    no_clip: list[str] = field(default_factory=list)  # also run these without clipping
    depths: list[int] = field(default_factory=lambda: [16, 64])  # sub-layers (paper: 64 and 512)
    eval_every: int = 2
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    rules: FailureRules = field(default_factory=FailureRules)

    PER_POINT: ClassVar[dict[str, str]] = {
        "model.scheme": "schemes", "model.n_blocks": "depths", "model.max_seq_len": "run.seq_len",
        "optim.warmup_steps": "run.steps (the ramp is the whole run)", "optim.schedule": "the ramp (linear, no decay)",
        "optim.min_lr": "the ramp (linear, no decay)", "optim.decay_fraction": "the ramp (linear, no decay)"}

    @classmethod
    def quick(cls) -> MaxLRConfig:
        return tiny_quick(cls, 40, schemes=["post_ln", "keel"], no_clip=["keel"], depths=[4], eval_every=2, seeds=[0],
                          rules=FailureRules(confirm=4, stall=8, stagnation_hold=4))

    def arms(self) -> list[tuple[str, str, float]]:
        """(label, scheme, grad_clip) for every arm."""
        clip = self.optim.grad_clip
        return [(s, s, clip) for s in self.schemes] + [(f"{s}/noclip", s, 0.0) for s in self.no_clip]


def point(cfg: MaxLRConfig, scheme: str, clip: float, depth: int, seed: int) -> dict:
    batches = fixed_batches(splits(cfg.data)["select"], cfg.run.seq_len, cfg.run.batch_size, cfg.run.eval_batches)
    unigram = unigram_loss(corpus(cfg.data).train, batches)
    config = point_config(cfg, cfg.point_model(scheme, depth), seed, warmup_steps=cfg.run.steps, schedule="constant",
                          grad_clip=clip)
    evals: dict[str, list] = {"step": [], "lr": [], "loss": []}
    judged = []

    def on_step(i, model, result):
        if (i + 1) % cfg.eval_every:
            return False
        evals["step"].append(i)
        evals["lr"].append(result.lr)
        evals["loss"].append(loss_on(model, batches, autocast_for(next(model.parameters()).device,
                                                                   cfg.run.dtype)))
        judged.append(detect(evals["loss"], unigram, cfg.rules, final=False))
        return judged[-1] is not None
    curve, _ = train_curve(config, eval_batches=0, on_step=on_step)
    if curve.stopped_at is not None and not (judged and judged[-1] is not None):
        evals["step"].append(curve.stopped_at)  # the guard stopped it: a non-finite loss or gradient
        evals["lr"].append(curve.lrs[-1])
        evals["loss"].append(float("nan"))
    return {"scheme": scheme, "clip": clip, "depth": depth, "seed": seed, "unigram": unigram, "evals": evals,
            "train_losses": curve.losses, "seconds": curve.seconds}


NOISE_LIMIT = 0.05  # nats: the detector's tested range (tests/test_detect.py)


def eval_noise(values: list[float], unigram: float, rules: FailureRules) -> float | None:
    """Robust SD (1.4826 x median absolute deviation) of the curve around its running median (window 9),
    from the first evaluation below the unigram level on: a rough size of the evaluation-to-evaluation
    noise the detector sees. Robust, so isolated spikes (events, not noise) do not count; the initial
    descent, where a trailing median lags, is left out; slow correlated wander is underestimated.
    None (unknown, not 0) when fewer than 10 evaluations lie below the unigram level: a curve that never
    learned, or failed right after learning, has no noise estimate, and its verdict is not "reliable"."""
    import statistics

    finite = [v for v in values if math.isfinite(v)]
    start = next((k for k, v in enumerate(finite) if v < unigram - rules.margin), len(finite))
    finite = finite[start:]
    if len(finite) < 10:
        return None
    centre = smooth(finite, 9)
    residuals = [v - c for v, c in zip(finite[8:], centre[8:])]
    middle = statistics.median(residuals)
    return 1.4826 * statistics.median(abs(r - middle) for r in residuals)


def healthy(r: dict, cfg: MaxLRConfig) -> list[float]:
    """A point's validation curve up to where its own failure (detect's rules, not stagnation) starts."""
    hit = detect(r["evals"]["loss"], r["unigram"], cfg.rules)
    return r["evals"]["loss"][:hit.index if hit else None]


def verdict(r: dict, cfg: MaxLRConfig, others: dict[str, dict] | None = None) -> dict:
    """The failure and max LR of point `r`. `others`: {label: point} of the other schemes' clipped arms at the
    same depth and seed (the stagnation rule's references; none: that rule is not applied)."""
    values = r["evals"]["loss"]
    hit = detect(values, r["unigram"], cfg.rules)
    reference = None
    if others:
        labels, mine = list(others), healthy(r, cfg)
        refs = [healthy(others[label], cfg) for label in labels]
        for label, ref in zip(labels, refs):  # index-aligned curves: the same evaluation steps
            n = min(len(mine), len(ref))
            if others[label]["evals"]["step"][:n] != r["evals"]["step"][:n]:
                raise ValueError(f"max-lr {label}: evaluated at other steps than the point it is compared with")
        stuck = stagnation(mine, refs, cfg.rules)
        if stuck is not None and (hit is None or stuck.index < hit.index):
            hit, reference = stuck, labels[stuck.reference]
    noise = eval_noise(values[:hit.index] if hit else values, r["unigram"], cfg.rules)
    out = {"noise_sd": noise, "reliable": noise is not None and noise <= NOISE_LIMIT,
           "learned": min(values, default=math.inf) < r["unigram"] - cfg.rules.margin, "reference": reference}
    if hit is None:
        return out | {"max_lr": cfg.optim.lr, "rule": None, "failed": False, "at_step": None}
    lrs = r["evals"]["lr"]
    return out | {"max_lr": lrs[hit.index - 1] if hit.index > 0 else 0.0, "rule": hit.rule, "failed": True,
                  "at_step": r["evals"]["step"][hit.index]}


def key(label: str, depth: int, seed: int) -> str:
    return f"{label.replace('/', '-')}-{depth}-seed{seed}"


def judge(results: dict[str, dict], cfg: MaxLRConfig) -> dict[str, dict]:
    """Every point's verdict, once every arm of its depth and seed has run (stagnation compares across
    schemes): each arm against the clipped arms of the *other* schemes, never against an arm of its own."""
    verdicts = {}
    for d in cfg.depths:
        for seed in cfg.seeds:
            for label, scheme, _ in cfg.arms():
                others = {s: results[key(s, d, seed)] for s in cfg.schemes if s != scheme}
                verdicts[key(label, d, seed)] = verdict(results[key(label, d, seed)], cfg, others)
    return verdicts


PAPER_RATIOS = {"pre_ln": 1.32, "post_ln": 34.0}  # Table 1, Keel / X at 64 sub-layers


def ratio_verdict(keel: list[dict], other: list[dict], paper: float) -> dict:
    """The pre-registered Keel / X rule on per-seed verdicts (same seeds, in order): a paired two-sided t-test
    of log(max LR) (stats.paired). A max LR is a lower bound when the run never failed (censored at the
    peak) and an upper bound when the curve never learned; a verdict that such a bound could have produced
    is not drawn: "agrees" needs Keel's values exact-or-lower-bounds and X's exact-or-upper-bounds,
    "disagrees" the reverse. A curve noisier than NOISE_LIMIT makes the comparison inconclusive."""
    def log(v):
        return math.log(v["max_lr"]) if v["max_lr"] > 0 else None

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
    elif call == "agrees" and (keel_high or other_low):
        call = "inconclusive (a bound in the direction of the claim)"
    elif call == "disagrees" and (keel_low or other_high):
        call = "inconclusive (a bound in the direction of the claim)"
    size = None
    if out["ratio_ci95"] is not None:
        lo, hi = out["ratio_ci95"]
        size = "within the 95% CI" if lo <= paper <= hi else ("above the CI" if paper > hi else "below the CI")
    return out | {"verdict": call, "paper_ratio_vs_ci": size}


def run(cfg: MaxLRConfig, out: Path, command: str) -> dict:
    points = {key(label, d, seed): (lambda s=s, c=c, d=d, seed=seed: point(cfg, s, c, d, seed))
              for d in cfg.depths for seed in cfg.seeds for label, s, c in cfg.arms()}
    results = Sweep(out, cfg).run(points, "max-lr")
    verdicts = judge(results, cfg)
    rows, table = [], {}
    for d in cfg.depths:
        pre = mean_sd([verdicts[f"pre_ln-{d}-seed{s}"]["max_lr"] for s in cfg.seeds])[0] \
            if "pre_ln" in cfg.schemes else None
        for label, _, _ in cfg.arms():
            vs = [verdicts[key(label, d, s)] for s in cfg.seeds]
            lrs = [v["max_lr"] for v in vs]
            m, sd = mean_sd(lrs)
            failed = sum(v["failed"] for v in vs)
            rules = ", ".join(sorted({v["rule"] for v in vs if v["rule"]})) or "-"
            known = [v["noise_sd"] for v in vs if v["noise_sd"] is not None]
            noise = max(known, default=None)
            unknown = len(vs) - len(known)
            table[f"{label}-{d}"] = {"mean": m, "sd": sd, "per_seed": lrs, "failed_seeds": failed, "rules": rules,
                                     "max_noise_sd": noise, "seeds_without_noise_estimate": unknown,
                                     "unreliable_seeds": sum(not v["reliable"] for v in vs)}
            cell = "-" if noise is None else f"{noise:.3f}" + ("" if noise <= NOISE_LIMIT else " (unreliable)")
            if unknown:
                cell += f"; {unknown} seed(s) with < 10 evaluations below the unigram level: unreliable"
            rows.append([label, d, f"{m:.4g} ± {sd:.2g}", " / ".join(
                f"{v['max_lr']:.4g}" if v["failed"] else f">= {v['max_lr']:.4g}" for v in vs),
                f"{failed}/{len(vs)}", rules, f"{m / pre:.2f}" if pre else "-", cell])
    ratios, ratio_rows = {}, []
    for d in cfg.depths:
        for x, paper in PAPER_RATIOS.items():
            if "keel" in cfg.schemes and x in cfg.schemes:
                r = ratio_verdict([verdicts[key("keel", d, s)] for s in cfg.seeds],
                                  [verdicts[key(x, d, s)] for s in cfg.seeds], paper)
                ratios[f"keel/{x}-{d}"] = r
                ci = "-" if r["ratio_ci95"] is None else f"[{r['ratio_ci95'][0]:.3g}, {r['ratio_ci95'][1]:.3g}]"
                p = r["test"]["p"]
                ratio_rows.append([f"keel / {x}", d, "-" if r["ratio"] is None else f"{r['ratio']:.3g}", ci,
                                   "n/a" if p is None else f"{p:.2g}", r["test"]["n"], f"{paper:g}",
                                   r["paper_ratio_vs_ci"] or "-", r["verdict"]])
    smallest = min((v["max_lr"] for v in verdicts.values() if v["failed"] and v["max_lr"] > 0), default=None)
    per_step = cfg.optim.lr / cfg.run.steps
    resolution = {"lr_per_step": per_step, "lr_per_eval": per_step * cfg.eval_every, "smallest_max_lr": smallest,
                  "per_step_fraction_of_smallest": per_step / smallest if smallest else None}
    plots = [_plot(cfg, results, verdicts, d, out) for d in cfg.depths]
    notes = (f"LR: linear warm-up 0 -> {cfg.optim.lr:g} over {cfg.run.steps} steps of {cfg.run.batch_size}x"
             f"{cfg.run.seq_len} tokens, d={cfg.model.d_model}; {len(cfg.seeds)} seeds; validation loss on "
             f"{cfg.run.eval_batches} fixed batches of the select half every {cfg.eval_every} steps. One step moves "
             f"the LR by {per_step:.3g}"
             + (f" = {100 * per_step / smallest:.2f}% of the smallest max LR measured ({smallest:.3g})"
                if smallest else "") + f"; failures are located to {cfg.eval_every} steps "
             f"({per_step * cfg.eval_every:.3g} in LR). Rules ({cfg.rules}): see keel/experiments/detect.py; "
             "stagnation is judged against the best other scheme (clipped arms) at the same step and seed. "
             "max LR = LR at the last evaluation before the failure; '>= peak' runs count as the peak in the mean. "
             f"Eval noise SD above {NOISE_LIMIT} nats is outside the detector's tested range (marked unreliable); a "
             "curve with fewer than 10 evaluations below the unigram level has no noise estimate (also unreliable). "
             "Ratios: paired two-sided t-test on per-seed log(max LR) (experiments/stats.py), p < 0.05; a verdict a "
             "censored ('>=') or never-learned bound could have produced is not drawn (maxlr.ratio_verdict).")
    text = markdown_table(["arm", "sub-layers", "max LR (mean ± SD)", "per seed", "failed", "rules",
                           "vs pre_ln", "eval noise SD (max)"], rows)
    if ratio_rows:
        text += "\n\n" + markdown_table(["ratio", "sub-layers", "geometric mean", "95% CI", "p (paired t, log)",
                                          "seeds", "paper", "paper's ratio", "verdict"], ratio_rows)
    write_outputs(out, "max-lr", cfg, command, {"points": results, "verdicts": verdicts, "table": table,
                                                "ratios": ratios, "resolution": resolution}, text, plots, notes)
    return table


def _plot(cfg: MaxLRConfig, results: dict, verdicts: dict, depth: int, out: Path) -> str:
    plt = pyplot()
    arms = cfg.arms()
    fig, axes = plt.subplots(1, len(arms), figsize=(3.2 * len(arms), 3.6), sharey=True, squeeze=False)
    unigram = next(iter(results.values()))["unigram"]
    finite = [v for r in results.values() for v in r["evals"]["loss"] if math.isfinite(v)] or [unigram]
    # from the lowest loss seen to the start of the curves (or 2 nats above the unigram level): a diverging curve
    # leaves the top of the plot instead of squashing every other curve to its bottom
    top = min(max(finite), max(unigram + 2.0, *(r["evals"]["loss"][0] for r in results.values()
                                                 if r["evals"]["loss"] and math.isfinite(r["evals"]["loss"][0]))))
    for ax, (label, _, _) in zip(axes[0], arms):
        for j, seed in enumerate(cfg.seeds):
            e, v = results[key(label, depth, seed)]["evals"], verdicts[key(label, depth, seed)]
            ax.plot(e["lr"], e["loss"], color=f"C{j}", lw=0.9, label=f"seed {seed}")
            if v["failed"]:
                ax.axvline(v["max_lr"], color=f"C{j}", ls=":", lw=1)
        ax.axhline(unigram, color="grey", ls="--", lw=0.8, label="unigram level")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("learning rate (linear ramp)")
        ax.set_ylim(min(finite) - 0.1, top + 0.1)
    axes[0][0].set_ylabel("validation loss (select half)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"max-lr, {depth} sub-layers (dotted: max LR per seed)", fontsize=10)
    return save(fig, out, f"maxlr-{depth}.png")
