"""Validation loss under a fixed token budget across depth (Table 3), by the budget method of
keel.experiments.budget; the wide Pre-LN of Table 5 for downstream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from keel.experiments.budget import (
    BudgetConfig,
    method_note,
    paired_gap,
    select_then_seeds,
    tokens,
    unigram_level,
)
from keel.experiments.common import (
    loss_axis,
    markdown_table,
    pm,
    pyplot,
    save,
    tiny_quick,
    write_outputs,
)


@dataclass
class DepthConfig(BudgetConfig):
    depths: list[int] = field(default_factory=lambda: [8, 16, 32, 64])  # sub-layers, 8x span
    probe: bool = True

    @classmethod
    def quick(cls) -> DepthConfig:
        return tiny_quick(cls, 8, depths=[4, 8], lrs=[3e-3, 1e-2], seeds=[0, 1], curve_every=4, curve_batches=1,
                          probe_batches=1)


def run_depth(cfg: DepthConfig, out: Path, command: str) -> dict:
    arms = {f"{s}-{d}": cfg.point_model(s, d) for d in cfg.depths for s in cfg.schemes}
    res = select_then_seeds(cfg, out, arms, "depth")
    a = res["arms"]
    rows, gaps = [], {}
    for d in cfg.depths:
        row = [d] + [f"{pm(a[f'{s}-{d}']['report_losses'])} @ {a[f'{s}-{d}']['lr']:g}" for s in cfg.schemes]
        for other in ("pre_ln", "post_ln"):
            if {"keel", other} <= set(cfg.schemes):
                m, sd = paired_gap(a[f"keel-{d}"], a[f"{other}-{d}"])
                gaps[f"keel-{other}-{d}"] = {"mean": m, "sd": sd}
                row.append(f"{m:+.3f} ± {sd:.3f}")
        rows.append(row)
    header = ["sub-layers"] + [f"{s}: report loss @ LR" for s in cfg.schemes]
    header += [f"keel - {o} (paired)" for o in ("pre_ln", "post_ln") if {"keel", o} <= set(cfg.schemes)]
    probes = _probe_table(cfg, res)
    unigram = unigram_level(cfg)
    plots = [_plot_depth(cfg, res, unigram, out), _plot_curves(cfg, res, unigram, out)]
    if cfg.probe:
        plots.append(_plot_probe(cfg, res, out))
    notes = method_note(cfg) + f" Unigram level on the report half: {unigram:.3f} nats.\n\n" + probes
    losses = [v for arm in a.values() for v in arm["report_losses"] if v is not None and math.isfinite(v)]
    if losses and min(losses) > unigram:
        notes = (f"**Every report loss is above the unigram level ({unigram:.3f} nats)**: no arm has learned more "
                 "than the token frequencies, so the gaps in the table are not evidence about the schemes.\n\n"
                 + notes)
    write_outputs(out, "depth", cfg, command, {**res, "gaps": gaps, "unigram": unigram},
                  markdown_table(header, rows), plots, notes)
    return {"arms": a, "gaps": gaps}


def _probe_table(cfg: DepthConfig, res: dict) -> str:
    if not cfg.probe:
        return ""
    rows = []
    for d in cfg.depths:
        for s in cfg.schemes:
            runs = [res["points"][f"{s}-{d}-lr{res['chosen'][f'{s}-{d}']:g}-seed{seed}"] for seed in cfg.seeds]
            runs = [r for r in runs if r.get("probe")]
            if not runs:
                continue
            full = [r["probe"]["loss_branches_above_k_off"][str(d)] for r in runs]
            keep2 = [r["probe"]["loss_branches_above_k_off"]["2"] - f for r, f in zip(runs, full)]
            half = [r["probe"]["loss_branches_above_k_off"][str(d // 2)] - f for r, f in zip(runs, full)]
            ratio = [sum(r["probe"]["f_over_ax"][2:]) / max(1, d - 2) for r in runs]
            rows.append([s, d, pm(keep2), pm(half), pm(ratio, 4)])
    return ("Effective-depth probe (report half, chosen LR, all seeds): loss increase when every branch above "
            "sub-layer k is switched off (norms and alpha kept), and the mean rms(F)/rms(alpha x) of sub-layers "
            "2..L-1.\n\n" + markdown_table(["scheme", "sub-layers", "delta loss, only sub-layers 0-1 on",
                                             "delta loss, lower half on", "mean rms(F)/rms(alpha x)"], rows))


def _plot_depth(cfg, res, unigram, out) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, s in enumerate(cfg.schemes):
        stats = [res["arms"][f"{s}-{d}"] for d in cfg.depths]
        ms = [x["mean"] for x in stats]
        sds = [x["sd"] for x in stats]
        ax.errorbar(cfg.depths, ms, yerr=sds, marker="o", capsize=3, label=s, color=f"C{i}")
        for d, x in zip(cfg.depths, stats):
            ax.scatter([d] * len(x["report_losses"]), [v for v in x["report_losses"]], s=8, color=f"C{i}", alpha=0.5)
    ax.axhline(unigram, color="grey", ls="--", lw=0.8, label="unigram level")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cfg.depths, [str(d) for d in cfg.depths])
    ax.minorticks_off()
    ax.set_xlabel("sub-layers (L)")
    ax.set_ylabel("report-half loss (chosen LR; mean ± SD, dots = seeds)")
    ax.set_title(f"depth, d={cfg.model.d_model}, {tokens(cfg):,} tokens per run", fontsize=10)
    ax.legend(fontsize=8)
    return save(fig, out, "depth.png")


def _plot_curves(cfg, res, unigram, out) -> str:
    import numpy as np

    plt = pyplot()
    fig, axes = plt.subplots(1, len(cfg.depths), figsize=(3.6 * len(cfg.depths), 3.6), sharey=True, squeeze=False)
    for ax, d in zip(axes[0], cfg.depths):
        for i, s in enumerate(cfg.schemes):
            lr = res["chosen"][f"{s}-{d}"]
            runs = [res["points"][f"{s}-{d}-lr{lr:g}-seed{seed}"] for seed in cfg.seeds]
            runs = [r for r in runs if r["evals"]["loss"] and not r["diverged"]]
            if not runs:
                continue
            steps = runs[0]["evals"]["step"]
            v = np.array([r["evals"]["loss"] for r in runs])
            ax.plot(steps, v.mean(0), color=f"C{i}", label=f"{s} @ {lr:g}")
            ax.fill_between(steps, v.min(0), v.max(0), color=f"C{i}", alpha=0.2)
        ax.axhline(unigram, color="grey", ls="--", lw=0.8, label="unigram level")
        ax.set_title(f"{d} sub-layers", fontsize=9)
        ax.set_xlabel("step")
        if len(ax.get_legend_handles_labels()[0]) > 1:
            ax.legend(fontsize=7)
        else:  # say why the frame is empty rather than leave it to be read as a result
            ax.text(0.5, 0.5, f"no curve: no evaluation within {cfg.run.steps} steps\n(curve_every={cfg.curve_every})"
                    " or every run diverged", transform=ax.transAxes, ha="center", va="center", fontsize=8)
    axes[0][0].set_ylabel("report-half loss (band: seed min..max)")
    loss_axis(axes[0][0])  # shared by every panel
    return save(fig, out, "depth-curves.png")


def _plot_probe(cfg, res, out) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    d = max(cfg.depths)
    for i, s in enumerate(cfg.schemes):
        for seed in cfg.seeds:
            r = res["points"][f"{s}-{d}-lr{res['chosen'][f'{s}-{d}']:g}-seed{seed}"]
            if not r.get("probe"):
                continue
            off = r["probe"]["loss_branches_above_k_off"]
            ks = sorted(int(k) for k in off)
            axes[0].plot(ks, [off[str(k)] for k in ks], marker=".", color=f"C{i}", alpha=0.7,
                         label=s if seed == cfg.seeds[0] else None)
            axes[1].plot(range(d), r["probe"]["f_over_ax"], color=f"C{i}", alpha=0.7, lw=0.8,
                         label=s if seed == cfg.seeds[0] else None)
    axes[0].set_xscale("symlog", base=2)
    axes[0].set_xlabel("k: branches of sub-layers >= k switched off")
    axes[0].set_ylabel("report-half loss")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("sub-layer index")
    axes[1].set_ylabel("rms(F) / rms(alpha x)")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"effective depth, {d} sub-layers, every seed", fontsize=10)
    return save(fig, out, "depth-probe.png")


def wide_model(cfg):
    """The wide Pre-LN of Table 5 (`wide_sublayers` at `wide_d_model`), for a config with the wide fields
    (downstream; results/deep-vs-wide/study.yaml declares the same arm)."""
    return cfg.point_model("pre_ln", cfg.wide_sublayers, d_model=cfg.wide_d_model, n_heads=cfg.wide_heads,
                           n_kv_heads=cfg.wide_kv_heads)
