"""regime (paper section 5.4, Fig. 5): is Keel's loss higher early, crossing below Pre-LN's later?

One depth (default 32 sub-layers), Post-LN, Pre-LN and Keel trained for a long budget at one LR each
(`lrs` with one value: no choice is made), several seeds, the report-half loss logged every `curve_every`
steps. Decision rules, fixed before running, on the seed-mean curves of Keel (k) and a baseline (b):
  - "starts slower": k > b at the first logged evaluation beyond `early_fraction` of the run;
  - "crosses": the first evaluation from which k < b at every later evaluation; "never" if there is none;
  - a difference smaller than the larger seed SD of the two at that evaluation is reported as a tie.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from keel.config import OptimConfig, RunConfig
from keel.experiments.budget import BudgetConfig, method_note, select_then_seeds, unigram_level
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


@dataclass
class RegimeConfig(BudgetConfig):
    depth: int = 32
    lrs: list[float] = field(default_factory=lambda: [3e-3])
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(warmup_steps=100))
    run: RunConfig = field(default_factory=lambda: experiment_run(steps=2000))
    curve_every: int = 50
    curve_batches: int = 4
    early_fraction: float = 0.1

    PER_POINT: ClassVar[dict[str, str]] = ExperimentConfig.PER_POINT | {"model.n_blocks": "depth"}

    @classmethod
    def quick(cls) -> RegimeConfig:
        return tiny_quick(cls, 8, depth=4, seeds=[0, 1], curve_every=2, curve_batches=1)


def curves(res: dict, label: str, cfg: RegimeConfig) -> tuple[list[int], np.ndarray]:
    runs = [res["points"][f"{label}-lr{res['chosen'][label]:g}-seed{s}"] for s in cfg.seeds]
    runs = [r for r in runs if not r["diverged"]]
    return runs[0]["evals"]["step"], np.array([r["evals"]["loss"] for r in runs])


def compare(k: np.ndarray, b: np.ndarray, steps: list[int], early_fraction: float) -> dict:
    km, bm = k.mean(0), b.mean(0)
    tol = np.maximum(k.std(0, ddof=1) if len(k) > 1 else 0 * km, b.std(0, ddof=1) if len(b) > 1 else 0 * bm)
    early = next(i for i, s in enumerate(steps) if s + 1 >= early_fraction * (steps[-1] + 1))
    diff = km - bm
    cross = next((i for i in range(len(steps)) if all(diff[j] < 0 for j in range(i, len(steps)))), None)
    return {"early_step": steps[early], "early_diff": float(diff[early]), "early_tol": float(tol[early]),
            "starts_slower": "tie" if abs(diff[early]) < tol[early] else bool(diff[early] > 0),
            "cross_step": steps[cross] if cross is not None else None,
            "final_diff": float(diff[-1]), "final_tol": float(tol[-1])}


def run(cfg: RegimeConfig, out: Path, command: str) -> dict:
    arms = {s: cfg.point_model(s, cfg.depth) for s in cfg.schemes}
    res = select_then_seeds(cfg, out, arms, "regime")
    rows, verdicts = [], {}
    if "keel" in arms:
        k_steps, k = curves(res, "keel", cfg)
        for base in (s for s in arms if s != "keel"):
            _, b = curves(res, base, cfg)
            v = compare(k, b, k_steps, cfg.early_fraction)
            verdicts[base] = v
            rows.append([f"keel vs {base}", v["early_step"] + 1, f"{v['early_diff']:+.3f} (tol {v['early_tol']:.3f})",
                         v["starts_slower"], v["cross_step"] + 1 if v["cross_step"] is not None else "never",
                         f"{v['final_diff']:+.3f} (tol {v['final_tol']:.3f})"])
    table = markdown_table(["comparison", "early step", "keel - base, early", "starts slower",
                            "crosses for good at step", "keel - base, final"], rows)
    finals = markdown_table(["scheme", "LR", "final report loss"],
                            [[s, f"{res['chosen'][s]:g}", pm(res["arms"][s]["report_losses"])] for s in arms])
    unigram = unigram_level(cfg)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, s in enumerate(arms):
        steps, v = curves(res, s, cfg)
        ax.plot([t + 1 for t in steps], v.mean(0), color=f"C{i}", label=s)
        ax.fill_between([t + 1 for t in steps], v.min(0), v.max(0), color=f"C{i}", alpha=0.2)
    ax.axhline(unigram, color="grey", ls="--", lw=0.8, label="unigram level")
    ax.set_xscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("report-half loss (band: seed min..max)")
    ax.set_title(f"{cfg.depth} sub-layers, d={cfg.model.d_model}, {cfg.run.steps} steps", fontsize=10)
    ax.legend(fontsize=8)
    save(fig, out, "regime.png")
    write_outputs(out, "regime", cfg, command, {**res, "verdicts": verdicts}, table + "\n\n" + finals,
                  ["regime.png"], method_note(cfg))
    return verdicts
