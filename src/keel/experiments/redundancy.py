"""The redundancy measurement (`measure: redundancy`, Appendix A): the loss without each sub-layer."""

from __future__ import annotations

import numpy as np

from keel.config import TrainConfig
from keel.evals.surgery import branches_off, plain, removed
from keel.experiments.common import fixed_batches, loss_on, markdown_table, pm, pyplot, save, splits, train_curve
from keel.runtime import autocast_for

MODES = ("sublayer", "branch")
PARTS = ("0", "1", "lower", "upper")  # what a compare pair's side ARM.MODE.PART names


def point(config: TrainConfig) -> dict:
    """Train `config` as `keel train` would, then each sub-layer's delta loss both ways on `run.eval_batches`
    report-half batches."""
    curve, model = train_curve(config, eval_batches=0)
    model = plain(model)  # a compiled block or a fused junction would hide the sub-layer swapped out
    run = config.run
    batches = fixed_batches(splits(config.data)["report"], run.seq_len, run.batch_size, run.eval_batches)
    auto = autocast_for(next(model.parameters()).device, run.dtype)
    base = loss_on(model, batches, auto)
    deltas = {m: [] for m in MODES}
    for i in range(model.n_sublayers):
        with removed(model, i):
            deltas["sublayer"].append(loss_on(model, batches, auto) - base)
        with branches_off(model, [i]):
            deltas["branch"].append(loss_on(model, batches, auto) - base)
    return {"scheme": config.model.scheme, "seed": run.seed, "base_loss": base, "delta_loss": deltas,
            "train_loss": curve.losses[-1], "diverged": curve.stopped_at is not None}


def summarise(deltas: list[float]) -> dict:
    n, half = len(deltas), len(deltas) // 2
    lower, upper = deltas[2:half], deltas[half:]
    return {"0": deltas[0], "1": deltas[1] if n > 1 else None,
            "lower": sum(lower) / len(lower) if lower else None, "upper": sum(upper) / len(upper) if upper else None,
            "max_from_2": max(deltas[2:]) if n > 2 else None}


def report(arms: dict[str, list[dict]]) -> tuple[dict, str]:
    """({ARM-MODE: each point's summary}, the table) for `arms`: arm -> its points, seed by seed."""
    rows, summary = [], {}
    for arm, runs in arms.items():
        for mode in MODES:
            summary[f"{arm}-{mode}"] = parts = [summarise(r["delta_loss"][mode]) for r in runs]
            rows.append([arm, mode, pm([r["base_loss"] for r in runs]), *(pm([p[k] for p in parts]) for k in PARTS)])
    return summary, markdown_table(["arm", "removed", "base loss", "delta: sub-layer 0", "delta: sub-layer 1",
                                    "mean delta, lower half (2..L/2-1)", "mean delta, upper half"], rows)


def notes(configs: list[TrainConfig], seeds: list[int]) -> str:
    say = lambda f: ", ".join(dict.fromkeys(f(c) for c in configs))  # each value the arms have, once
    return (f"Models: {say(lambda c: str(c.model.n_sublayers))} sub-layers, d={say(lambda c: str(c.model.d_model))}, "
            f"trained {say(lambda c: str(c.run.steps))} steps x {say(lambda c: f'{c.run.batch_size}x{c.run.seq_len}')} "
            f"tokens at LR {say(lambda c: f'{c.optim.lr:g}')}, seeds {seeds}. Delta loss in nats on "
            f"{say(lambda c: str(c.run.eval_batches))} batches of the report half; mean ± SD over seeds.")


def plot(arms: dict[str, list[dict]], out) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, mode in zip(axes, MODES):
        for i, (arm, runs) in enumerate(arms.items()):
            v = np.array([r["delta_loss"][mode] for r in runs])
            x = np.arange(v.shape[1])
            ax.plot(x, v.mean(0), marker=".", color=f"C{i}", label=arm)
            ax.fill_between(x, v.min(0), v.max(0), color=f"C{i}", alpha=0.2)
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_title("removing the whole sublayer" if mode == "sublayer" else "switching off the branch only")
        ax.set_xlabel("sub-layer index (0 = bottom)")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("delta loss, nats (band: seed min..max)")
    return save(fig, out, "redundancy.png")
