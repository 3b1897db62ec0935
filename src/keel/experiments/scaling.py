"""Validation loss under a fixed token budget, across depth (Table 3), LR (Table 2) and shape (Table 5).

Every point trains from scratch with the paper's recipe (AdamW, linear warm-up, cosine decay) for `steps`
steps of `batch_size x seq_len` tokens. The method (issue 10):
  - the LR of each arm (scheme x depth x ...) is chosen with the first seed from the grid `lrs`, by the loss
    on the *select* half of the validation split;
  - the remaining seeds run at that LR only; every reported number is the loss on the *report* half, as
    mean and SD over `seeds` (all at the chosen LR);
  - each point logs its training loss every step and the report-half loss every `curve_every` steps, so a
    crossing of two schemes' curves is visible;
  - with `probe`, each trained model is also probed (keel.experiments.probes): the loss when every branch
    above sub-layer k is switched off (the effective-depth probe), and per-sub-layer rms(F) / rms(alpha x).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from keel.data import DataConfig
from keel.errors import ConfigError
from keel.experiments.common import (
    Engine,
    Shape,
    Sweep,
    corpus,
    fixed_batches,
    loss_on,
    markdown_table,
    mean_sd,
    pm,
    point_config,
    pyplot,
    splits,
    train_curve,
    unigram_loss,
    write_outputs,
)
from keel.experiments.probes import branches_off, residual_sizes
from keel.model import TransformerLM
from keel.model.counting import count_params
from keel.runtime import autocast_for
from keel.train.config import OptimConfig


@dataclass
class BudgetConfig(Engine):
    schemes: list[str] = field(default_factory=lambda: ["post_ln", "pre_ln", "keel"])
    lrs: list[float] = field(default_factory=lambda: [1e-3, 3e-3, 1e-2])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # the first one also chooses the LR
    steps: int = 400
    warmup_steps: int = 40
    eval_batches: int = 16  # per half (select / report)
    curve_every: int = 50  # report-half loss on `curve_batches` batches every this many steps (0: off)
    curve_batches: int = 2
    probe: bool = False
    probe_batches: int = 4
    shape: Shape = field(default_factory=lambda: Shape(batch_size=8))
    data: DataConfig = field(default_factory=DataConfig)


TINY_SHAPE = Shape(d_model=32, n_heads=2, n_kv_heads=1, seq_len=32, batch_size=4)


@dataclass
class DepthConfig(BudgetConfig):
    depths: list[int] = field(default_factory=lambda: [8, 16, 32, 64])  # sub-layers, 8x span
    probe: bool = True
    # "" (choose from `lrs`), or an earlier depth run's results.json: each arm then runs at the LR that run
    # chose for it on the select half (tune on a short budget, train long), and `lrs` is not used
    lr_from: str = ""

    @classmethod
    def quick(cls) -> DepthConfig:
        return cls(depths=[4, 8], lrs=[3e-3, 1e-2], seeds=[0, 1], steps=8, warmup_steps=2, eval_batches=1,
                   curve_every=4, curve_batches=1, probe_batches=1, shape=TINY_SHAPE)


@dataclass
class LRSweepConfig(BudgetConfig):
    depth: int = 32
    schemes: list[str] = field(default_factory=lambda: ["pre_ln", "keel"])
    lrs: list[float] = field(default_factory=lambda: [1.5e-3, 3e-3, 6e-3, 1.2e-2])

    @classmethod
    def quick(cls) -> LRSweepConfig:
        return cls(depth=8, lrs=[1e-3, 1e-2], seeds=[0, 1], steps=8, warmup_steps=2, eval_batches=1,
                   curve_every=0, shape=TINY_SHAPE)


@dataclass
class DeepWideConfig(BudgetConfig):
    """Equal parameters: `deep_sublayers` at shape.d_model vs `wide_sublayers` at `wide_d_model`."""

    deep_sublayers: int = 32
    wide_sublayers: int = 8
    wide_d_model: int = 128
    wide_heads: int = 8
    wide_kv_heads: int = 4

    @classmethod
    def quick(cls) -> DeepWideConfig:
        return cls(deep_sublayers=8, wide_sublayers=2, wide_d_model=64, wide_heads=4, wide_kv_heads=2, lrs=[3e-3],
                   seeds=[0, 1], steps=8, warmup_steps=2, eval_batches=1, curve_every=0, shape=TINY_SHAPE)


def budget_point(cfg: BudgetConfig, model_cfg, lr: float, seed: int, shape: Shape | None = None,
                 prepare: Callable[[nn.Module], object] | None = None,
                 extra: Callable[[nn.Module, list], dict] | None = None) -> dict:
    """Train one model; its losses on both validation halves, its curves, and (with cfg.probe) its probes.
    `prepare(model)` changes the freshly initialised model before training (the init is the same as without
    it); `extra(model, report_batches)` adds measurements of the trained model to the point."""
    shape = shape or cfg.shape
    model = None
    if prepare is not None:
        torch.manual_seed(seed)  # train_curve seeds the same way before it would build the model
        model = TransformerLM(model_cfg)
        prepare(model)
    optim = OptimConfig(lr=lr, warmup_steps=cfg.warmup_steps)
    config = point_config(model_cfg, optim, cfg.steps, shape, cfg.data, seed, cfg, cfg.eval_batches)
    halves = splits(cfg.data)
    curve_set = fixed_batches(halves["report"], shape.seq_len, shape.batch_size, cfg.curve_batches)
    evals = {"step": [], "loss": []}

    def on_step(i, model, result):
        if cfg.curve_every and (i + 1) % cfg.curve_every == 0:
            evals["step"].append(i)
            evals["loss"].append(loss_on(model, curve_set, autocast_for(next(model.parameters()).device,
                                                                         cfg.run.dtype)))
        return False
    curve, model = train_curve(config, cfg.eval_batches, model=model, on_step=on_step, eval_tokens=halves["select"])
    out = {"scheme": model_cfg.scheme, "n_sublayers": model_cfg.n_sublayers, "d_model": model_cfg.d_model,
           "alpha": model_cfg.alpha, "first_layer": model_cfg.first_layer, "lr": lr, "seed": seed,
           "select_loss": curve.val_loss, "report_loss": None, "losses": curve.losses, "evals": evals,
           "n_params": count_params(model_cfg), "diverged": curve.stopped_at is not None,
           "seconds": curve.seconds, "tokens": cfg.steps * shape.batch_size * shape.seq_len}
    if curve.stopped_at is not None:
        return out
    auto = autocast_for(next(model.parameters()).device, cfg.run.dtype)
    report = fixed_batches(halves["report"], shape.seq_len, shape.batch_size, cfg.eval_batches)
    out["report_loss"] = loss_on(model, report, auto)
    if cfg.probe:
        out["probe"] = probe(model, report[:cfg.probe_batches], auto)
    if extra is not None:
        out |= extra(model, report)
    return out


def probe(model, batches: list, autocast) -> dict:
    """Effective depth: loss with every branch above sub-layer k switched off, for k = 0, 1, 2, 4, ..., L;
    and per-sub-layer rms(F) / rms(alpha x) on the first batch."""
    n = model.n_sublayers
    cuts = sorted({0, 1, 2, *(2 ** i for i in range(2, int(math.log2(n)) + 1)), n})
    loss_above_off = {}
    for k in cuts:
        with branches_off(model, range(k, n)):
            loss_above_off[str(k)] = loss_on(model, batches, autocast)
    sizes = residual_sizes(model, batches[0][0])
    return {"loss_branches_above_k_off": loss_above_off,
            "f_over_ax": [f / a if a > 0 else float("inf") for f, a in zip(sizes["rms_f"], sizes["rms_ax"])]}


def _loss(r: dict | None, key: str) -> float:
    v = r.get(key) if r else None
    return v if v is not None and math.isfinite(v) else float("inf")


def select_then_seeds(cfg: BudgetConfig, out: Path, arms: dict, desc: str, shapes: dict | None = None,
                      grids: dict[str, list[float]] | None = None) -> dict:
    """Phase 1: every arm at every LR with the first seed; the LR with the lowest select-half loss is
    chosen. Phase 2: the other seeds at the chosen LR. Returns {points, chosen, arms}, where arms[label] has
    the report-half losses of every seed at the chosen LR. `grids[label]` replaces `cfg.lrs` for an arm."""
    shapes = shapes or {}
    grid = {label: (grids or {}).get(label, cfg.lrs) for label in arms}
    sweep, s0 = Sweep(out, cfg), cfg.seeds[0]

    def job(label, lr, seed):
        return lambda: budget_point(cfg, arms[label], lr, seed, shapes.get(label))
    first = {f"{label}-lr{lr:g}-seed{s0}": job(label, lr, s0) for label in arms for lr in grid[label]}
    points = sweep.run(first, f"{desc} (LR choice)")
    chosen = {label: min(grid[label], key=lambda lr, label=label: _loss(points[f"{label}-lr{lr:g}-seed{s0}"],
                                                                        "select_loss"))
              for label in arms}
    rest = {f"{label}-lr{chosen[label]:g}-seed{s}": job(label, chosen[label], s)
            for label in arms for s in cfg.seeds[1:]}
    points |= sweep.run(rest, f"{desc} (seeds)")
    summary = {}
    for label in arms:
        runs = [points[f"{label}-lr{chosen[label]:g}-seed{s}"] for s in cfg.seeds]
        losses = [r["report_loss"] for r in runs]
        m, sd = mean_sd(losses)
        summary[label] = {"lr": chosen[label], "report_losses": losses, "mean": m, "sd": sd,
                          "diverged_seeds": sum(r["diverged"] for r in runs),
                          "select_by_lr": {f"{lr:g}": points[f"{label}-lr{lr:g}-seed{s0}"]["select_loss"]
                                           for lr in grid[label]},
                          "report_by_lr": {f"{lr:g}": points[f"{label}-lr{lr:g}-seed{s0}"]["report_loss"]
                                           for lr in grid[label]}}
    return {"points": points, "chosen": chosen, "arms": summary}


def paired_gap(a: dict, b: dict) -> tuple[float, float]:
    """Mean and SD over seeds of (a - b) report loss, seed by seed (same init seed and batch order)."""
    diffs = [x - y for x, y in zip(a["report_losses"], b["report_losses"]) if x is not None and y is not None]
    return mean_sd(diffs)


def unigram_level(cfg: BudgetConfig) -> float:
    batches = fixed_batches(splits(cfg.data)["report"], cfg.shape.seq_len, cfg.shape.batch_size, cfg.eval_batches)
    return unigram_loss(corpus(cfg.data).train, batches)


def tokens(cfg: BudgetConfig) -> int:
    return cfg.steps * cfg.shape.batch_size * cfg.shape.seq_len


def method_note(cfg: BudgetConfig) -> str:
    return (f"Each run: {cfg.steps} steps x {cfg.shape.batch_size}x{cfg.shape.seq_len} tokens = {tokens(cfg):,} "
            f"tokens, d={cfg.shape.d_model}, warm-up {cfg.warmup_steps} then cosine. LR chosen per arm from "
            f"{cfg.lrs} with seed {cfg.seeds[0]} on the select half of the validation split; seeds {cfg.seeds} at "
            f"that LR; losses on the report half ({cfg.eval_batches} batches), mean ± SD over seeds.")


def chosen_lrs(path: str, arms) -> dict[str, list[float]]:
    """{arm: [LR]} from an earlier experiment's results.json (`results.chosen`), for every arm in `arms`."""
    try:
        chosen = json.loads(Path(path).read_text())["results"]["chosen"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"lr_from: cannot read the chosen LRs from {path} ({e})") from None
    missing = [a for a in arms if a not in chosen]
    if missing:
        raise ConfigError(f"lr_from: {path} chose no LR for {', '.join(missing)}")
    return {a: [float(chosen[a])] for a in arms}


def run_depth(cfg: DepthConfig, out: Path, command: str) -> dict:
    arms = {f"{s}-{d}": cfg.shape.model(s, d) for d in cfg.depths for s in cfg.schemes}
    grids = chosen_lrs(cfg.lr_from, arms) if cfg.lr_from else None
    res = select_then_seeds(cfg, out, arms, "depth", grids=grids)
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
    method = method_note(cfg)
    if cfg.lr_from:
        method += (f" Here no LR is chosen: each arm runs at the LR chosen for it by {cfg.lr_from} "
                   f"({', '.join(f'{a} {g[0]:g}' for a, g in grids.items())}).")
    notes = method + f" Unigram level on the report half: {unigram:.3f} nats.\n\n" + probes
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
    ax.set_xlabel("sub-layers (L)")
    ax.set_ylabel("report-half loss (chosen LR; mean ± SD, dots = seeds)")
    ax.set_title(f"depth, d={cfg.shape.d_model}, {tokens(cfg):,} tokens per run", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "depth.png", dpi=110)
    plt.close(fig)
    return "depth.png"


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
        ax.axhline(unigram, color="grey", ls="--", lw=0.8)
        ax.set_title(f"{d} sub-layers", fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("report-half loss (band: seed min..max)")
    axes[0][0].set_ylim(None, unigram + 1.0)  # the first evaluations (~5.5 nats) would flatten the rest
    fig.tight_layout()
    fig.savefig(out / "depth-curves.png", dpi=110)
    plt.close(fig)
    return "depth-curves.png"


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
    fig.tight_layout()
    fig.savefig(out / "depth-probe.png", dpi=110)
    plt.close(fig)
    return "depth-probe.png"


def run_lr_sweep(cfg: LRSweepConfig, out: Path, command: str) -> dict:
    """Every LR of the grid with every seed (no choice here: the loss-vs-LR curve is the result)."""
    sweep = Sweep(out, cfg)
    jobs = {f"{s}-lr{lr:g}-seed{seed}": (lambda s=s, lr=lr, seed=seed: budget_point(
        cfg, cfg.shape.model(s, cfg.depth), lr, seed)) for s in cfg.schemes for lr in cfg.lrs for seed in cfg.seeds}
    points = sweep.run(jobs, "lr-sweep")
    def losses(s, lr):
        return {"report_losses": [points[f"{s}-lr{lr:g}-seed{seed}"]["report_loss"] for seed in cfg.seeds]}
    pair = [o for o in cfg.schemes if o != "keel"] if "keel" in cfg.schemes else []
    rows = [[f"{lr:g}"] + [pm(losses(s, lr)["report_losses"]) for s in cfg.schemes]
            + ["{:+.3f} ± {:.3f}".format(*paired_gap(losses("keel", lr), losses(o, lr))) for o in pair]
            for lr in cfg.lrs]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, s in enumerate(cfg.schemes):
        stats = [mean_sd([points[f"{s}-lr{lr:g}-seed{seed}"]["report_loss"] for seed in cfg.seeds]) for lr in cfg.lrs]
        ax.errorbar(cfg.lrs, [m for m, _ in stats], yerr=[sd for _, sd in stats], marker="o", capsize=3, label=s,
                    color=f"C{i}")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("report-half loss (mean ± SD over seeds)")
    ax.set_title(f"{cfg.depth} sub-layers, d={cfg.shape.d_model}, {tokens(cfg):,} tokens", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "lr-sweep.png", dpi=110)
    plt.close(fig)
    table = markdown_table(["peak LR"] + [f"{s} report loss" for s in cfg.schemes]
                           + [f"keel - {o} (paired)" for o in pair], rows)
    write_outputs(out, "lr-sweep", cfg, command, {"points": points}, table, ["lr-sweep.png"],
                  method_note(cfg) + " Here every LR runs every seed.")
    return points


def run_deep_vs_wide(cfg: DeepWideConfig, out: Path, command: str) -> dict:
    wide_shape = replace(cfg.shape, d_model=cfg.wide_d_model, n_heads=cfg.wide_heads, n_kv_heads=cfg.wide_kv_heads)
    arms = {"deep-pre_ln": cfg.shape.model("pre_ln", cfg.deep_sublayers),
            "wide-pre_ln": wide_shape.model("pre_ln", cfg.wide_sublayers),
            "deep-keel": cfg.shape.model("keel", cfg.deep_sublayers)}
    res = select_then_seeds(cfg, out, arms, "deep-vs-wide", shapes={"wide-pre_ln": wide_shape})
    rows = [[label, m.n_sublayers, m.d_model, f"{count_params(m):,}", f"{res['chosen'][label]:g}",
             pm(res["arms"][label]["report_losses"])] for label, m in arms.items()]
    table = markdown_table(["arm", "sub-layers", "d_model", "parameters", "chosen LR", "report loss"], rows)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, label in enumerate(arms):
        a = res["arms"][label]
        ax.errorbar([i], [a["mean"]], yerr=[a["sd"]], marker="o", capsize=4, color=f"C{i}")
        ax.scatter([i] * len(a["report_losses"]), a["report_losses"], s=10, color=f"C{i}", alpha=0.5)
    ax.set_xticks(range(len(arms)), list(arms))
    ax.set_ylabel("report-half loss (mean ± SD, dots = seeds)")
    ax.set_title(f"equal parameters, {tokens(cfg):,} tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "deep-vs-wide.png", dpi=110)
    plt.close(fig)
    write_outputs(out, "deep-vs-wide", cfg, command, res, table, ["deep-vs-wide.png"], method_note(cfg))
    return res
