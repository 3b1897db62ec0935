"""max-lr (paper Table 1): the largest learning rate each scheme tolerates.

The LR rises linearly from 0 to `optim.lr` over `run.steps` steps (the paper: 0 -> 5e-2 over 5,000 steps). Every
`eval_every` steps the model is scored on one fixed set of batches from the "select" half of the validation
split; keel.experiments.detect judges that curve (non-finite, collapse to the unigram level, unrecovered
rise above the running best; rules fixed before running), and the run stops once a failure is confirmed.
The max tolerable LR is the LR at the last evaluation before the failure; a run that never fails is
reported as ">= peak". Schemes listed in `no_clip` are also run without gradient clipping ("<scheme>/noclip").

Resolution: one step moves the LR by optim.lr / run.steps; the failure is located to within `eval_every` steps.
The report states both against the smallest max LR measured (the issue asks for <= 1% per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from keel.experiments.common import (
    ExperimentConfig,
    Sweep,
    corpus,
    experiment_run,
    fixed_batches,
    loss_on,
    markdown_table,
    mean_sd,
    point_config,
    pyplot,
    splits,
    tiny_quick,
    train_curve,
    unigram_loss,
    write_outputs,
)
from keel.experiments.detect import FailureRules, detect, smooth
from keel.runtime import autocast_for
from keel.train.config import OptimConfig, RunConfig


@dataclass
class MaxLRConfig(ExperimentConfig):
    """The LR ramps linearly from 0 to `optim.lr` (the peak) over the whole run of `run.steps` steps; the
    clipped arms clip at `optim.grad_clip`. `run.eval_batches` fixed batches of the select half are scored
    every `eval_every` steps."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=8e-2))
    run: RunConfig = field(default_factory=lambda: experiment_run(steps=1000, eval_batches=2))
    schemes: list[str] = field(default_factory=lambda: ["post_ln", "deepnorm", "pre_ln", "keel"])
    no_clip: list[str] = field(default_factory=lambda: ["pre_ln", "keel"])  # also run these without clipping
    depths: list[int] = field(default_factory=lambda: [16])  # sub-layers (paper: 64 and 512)
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
                          rules=FailureRules(confirm=4, stall=8))

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


def eval_noise(values: list[float], unigram: float, rules: FailureRules) -> float:
    """Robust SD (1.4826 x median absolute deviation) of the curve around its running median (window 9),
    from the first evaluation below the unigram level on: a rough size of the evaluation-to-evaluation
    noise the detector sees. Robust, so isolated spikes (events, not noise) do not count; the initial
    descent, where a trailing median lags, is left out; slow correlated wander is underestimated."""
    import statistics

    finite = [v for v in values if math.isfinite(v)]
    start = next((k for k, v in enumerate(finite) if v < unigram - rules.margin), len(finite))
    finite = finite[start:]
    if len(finite) < 10:
        return 0.0
    centre = smooth(finite, 9)
    residuals = [v - c for v, c in zip(finite[8:], centre[8:])]
    middle = statistics.median(residuals)
    return 1.4826 * statistics.median(abs(r - middle) for r in residuals)


def verdict(r: dict, cfg: MaxLRConfig) -> dict:
    values = r["evals"]["loss"]
    hit = detect(values, r["unigram"], cfg.rules)
    noise = eval_noise(values[:hit.index] if hit else values, r["unigram"], cfg.rules)
    out = {"noise_sd": noise, "reliable": noise <= NOISE_LIMIT}
    if hit is None:
        return out | {"max_lr": cfg.optim.lr, "rule": None, "failed": False, "at_step": None}
    lrs = r["evals"]["lr"]
    return out | {"max_lr": lrs[hit.index - 1] if hit.index > 0 else 0.0, "rule": hit.rule, "failed": True,
                  "at_step": r["evals"]["step"][hit.index]}


def run(cfg: MaxLRConfig, out: Path, command: str) -> dict:
    points = {f"{label.replace('/', '-')}-{d}-seed{seed}": (lambda s=s, c=c, d=d, seed=seed: point(cfg, s, c, d, seed))
              for d in cfg.depths for seed in cfg.seeds for label, s, c in cfg.arms()}
    results = Sweep(out, cfg).run(points, "max-lr")
    verdicts = {k: verdict(r, cfg) for k, r in results.items()}
    rows, table = [], {}
    for d in cfg.depths:
        pre = mean_sd([verdicts[f"pre_ln-{d}-seed{s}"]["max_lr"] for s in cfg.seeds])[0] \
            if "pre_ln" in cfg.schemes else None
        for label, _, _ in cfg.arms():
            vs = [verdicts[f"{label.replace('/', '-')}-{d}-seed{s}"] for s in cfg.seeds]
            lrs = [v["max_lr"] for v in vs]
            m, sd = mean_sd(lrs)
            failed = sum(v["failed"] for v in vs)
            rules = ", ".join(sorted({v["rule"] for v in vs if v["rule"]})) or "-"
            noise = max(v["noise_sd"] for v in vs)
            table[f"{label}-{d}"] = {"mean": m, "sd": sd, "per_seed": lrs, "failed_seeds": failed, "rules": rules,
                                     "max_noise_sd": noise}
            rows.append([label, d, f"{m:.4g} ± {sd:.2g}", " / ".join(f"{v:.4g}" for v in lrs),
                         f"{failed}/{len(vs)}", rules, f"{m / pre:.2f}" if pre else "-",
                         f"{noise:.3f}" + ("" if noise <= NOISE_LIMIT else " (unreliable)")])
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
             f"({per_step * cfg.eval_every:.3g} in LR). Rules ({cfg.rules}): see keel/experiments/detect.py. "
             "max LR = LR at the last evaluation before the failure; '>= peak' runs count as the peak in the mean. "
             f"Eval noise SD above {NOISE_LIMIT} nats is outside the detector's tested range (marked unreliable).")
    write_outputs(out, "max-lr", cfg, command, {"points": results, "verdicts": verdicts, "table": table,
                                                "resolution": resolution},
                  markdown_table(["arm", "sub-layers", "max LR (mean ± SD)", "per seed", "failed", "rules",
                                  "vs pre_ln", "eval noise SD (max)"], rows), plots, notes)
    return table


def _plot(cfg: MaxLRConfig, results: dict, verdicts: dict, depth: int, out: Path) -> str:
    plt = pyplot()
    arms = cfg.arms()
    fig, axes = plt.subplots(1, len(arms), figsize=(3.2 * len(arms), 3.6), sharey=True, squeeze=False)
    unigram = next(iter(results.values()))["unigram"]
    for ax, (label, _, _) in zip(axes[0], arms):
        for j, seed in enumerate(cfg.seeds):
            key = f"{label.replace('/', '-')}-{depth}-seed{seed}"
            e, v = results[key]["evals"], verdicts[key]
            ax.plot(e["lr"], e["loss"], color=f"C{j}", lw=0.9, label=f"seed {seed}")
            if v["failed"]:
                ax.axvline(v["max_lr"], color=f"C{j}", ls=":", lw=1)
        ax.axhline(unigram, color="grey", ls="--", lw=0.8, label="unigram level")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("learning rate (linear ramp)")
        ax.set_ylim(1.0, 6.0)
    axes[0][0].set_ylabel("validation loss (select half)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"max-lr, {depth} sub-layers (dotted: max LR per seed)", fontsize=10)
    fig.tight_layout()
    name = f"maxlr-{depth}.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name
