"""max-lr (paper Table 1): the largest learning rate each scheme tolerates.

The LR rises linearly from 0 to `peak` (paper: 5e-2) over the whole run; the divergence step is found by
keel.experiments.detect (non-finite, unrecovered spike, stagnation, and silent degradation against the
pointwise-best curve of all schemes at the same depth and seed); the maximum tolerable LR is the LR of
the step before it. A scheme that never diverges is reported as ">= peak".
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from keel.data import DataConfig
from keel.experiments.common import (
    Engine,
    Shape,
    Sweep,
    markdown_table,
    point_config,
    pyplot,
    train_curve,
    write_outputs,
)
from keel.experiments.detect import DetectorConfig, detect, smooth
from keel.experiments.gradflow import ALL_SCHEMES
from keel.train.config import OptimConfig


@dataclass
class MaxLRConfig(Engine):
    schemes: list[str] = field(default_factory=lambda: list(ALL_SCHEMES))
    depths: list[int] = field(default_factory=lambda: [16, 32])  # sub-layers (paper: 64 and 512)
    peak: float = 5e-2
    steps: int = 200  # the warm-up length = the whole run
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    shape: Shape = field(default_factory=Shape)
    data: DataConfig = field(default_factory=DataConfig)
    detector: DetectorConfig = field(default_factory=lambda: DetectorConfig(patience=40, burn_in=40))

    @classmethod
    def quick(cls) -> MaxLRConfig:
        return cls(schemes=["post_ln", "pre_ln", "keel"], depths=[8], steps=40, seeds=[0],
                   shape=Shape(d_model=32, n_heads=2, n_kv_heads=1, seq_len=32, batch_size=4),
                   detector=DetectorConfig(window=5, patience=10, burn_in=10))


def point(cfg: MaxLRConfig, scheme: str, depth: int, seed: int) -> dict:
    optim = OptimConfig(lr=cfg.peak, warmup_steps=cfg.steps, schedule="constant", grad_clip=1.0)
    config = point_config(cfg.shape.model(scheme, depth), optim, cfg.steps, cfg.shape, cfg.data, seed, cfg)
    curve, _ = train_curve(config, eval_batches=0)
    return {"scheme": scheme, "depth": depth, "seed": seed, "losses": curve.losses, "lrs": curve.lrs,
            "seconds": curve.seconds}


def run(cfg: MaxLRConfig, out: Path, command: str) -> dict:
    points = {f"{s}-{d}-seed{seed}": (lambda s=s, d=d, seed=seed: point(cfg, s, d, seed))
              for d in cfg.depths for seed in cfg.seeds for s in cfg.schemes}
    results = Sweep(out, cfg).run(points, "max-lr")
    verdicts = {}
    for d in cfg.depths:
        for seed in cfg.seeds:
            curves = [results[f"{s}-{d}-seed{seed}"]["losses"] for s in cfg.schemes]
            finite = [c for c in curves if len(c) == cfg.steps]
            reference = [min(c[t] for c in finite) for t in range(cfg.steps)] if finite else None
            for s in cfg.schemes:
                r = results[f"{s}-{d}-seed{seed}"]
                hit = detect(r["losses"], cfg.detector, reference)
                step, why = hit if hit else (None, None)
                max_lr = r["lrs"][step - 1] if step else (0.0 if step == 0 else cfg.peak)
                verdicts[f"{s}-{d}-seed{seed}"] = {"diverged_at": step, "criterion": why, "max_lr": max_lr,
                                                   "survived": step is None}
    rows, table_data = [], {}
    for d in cfg.depths:
        pre = statistics.median([verdicts[f"pre_ln-{d}-seed{seed}"]["max_lr"] for seed in cfg.seeds]) \
            if "pre_ln" in cfg.schemes else None
        for s in cfg.schemes:
            vs = [verdicts[f"{s}-{d}-seed{seed}"] for seed in cfg.seeds]
            lrs = [v["max_lr"] for v in vs]
            med = statistics.median(lrs)
            survived = sum(v["survived"] for v in vs)
            why = ", ".join(sorted({v["criterion"] for v in vs if v["criterion"]})) or "-"
            table_data[f"{s}-{d}"] = {"median_max_lr": med, "min": min(lrs), "max": max(lrs),
                                      "survived_seeds": survived, "criteria": why}
            label = f"{med:.3g}" + (" (>= peak)" if survived == len(vs) else "")
            rows.append([s, d, label, f"{min(lrs):.3g} .. {max(lrs):.3g}", f"{survived}/{len(vs)}", why,
                         f"{med / pre:.2f}" if pre else "-"])
    table = markdown_table(["scheme", "sub-layers", "max LR (median over seeds)", "spread", "never diverged",
                            "criteria", "vs pre_ln"], rows)
    plots = []
    plt = pyplot()
    for d in cfg.depths:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, s in enumerate(cfg.schemes):
            r = results[f"{s}-{d}-seed{cfg.seeds[0]}"]
            color = f"C{i}"
            ax.plot(r["lrs"][:len(r["losses"])], smooth(r["losses"], cfg.detector.window), label=s, color=color)
            v = verdicts[f"{s}-{d}-seed{cfg.seeds[0]}"]
            if v["diverged_at"] is not None and v["diverged_at"] < len(r["losses"]):
                t = v["diverged_at"]
                ax.scatter([r["lrs"][t]], [smooth(r["losses"], cfg.detector.window)[t]], color=color, marker="x",
                           s=60, zorder=3)
        ax.set_xscale("log")
        ax.set_xlabel("learning rate (linear warm-up)")
        ax.set_ylabel("training loss (running median)")
        ax.set_title(f"max-lr, {d} sub-layers, seed {cfg.seeds[0]} (x = divergence)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = f"maxlr-{d}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        plots.append(name)
    notes = (f"LR warm-up from 0 to {cfg.peak:g} over {cfg.steps} steps of {cfg.shape.batch_size * cfg.shape.seq_len} "
             f"tokens; {len(cfg.seeds)} seed(s). Detector: {cfg.detector}. See keel/experiments/detect.py for "
             "the rules.")
    write_outputs(out, "max-lr", cfg, command, {"points": results, "verdicts": verdicts, "table": table_data},
                  table, plots, notes)
    return table_data
