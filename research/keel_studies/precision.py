"""stream-precision (the paper's numerics note, PAPER.md section 8): what a bf16 residual stream does to Keel.

With alpha = L in the hundreds, one sub-layer changes Keel's normalised stream by about |F| / (alpha |x|),
below bf16's resolution (2^-8), so the paper (and keel.model.numerics) keeps the stream and every shortcut
sum in float32. This experiment measures what is lost when they are not:

  - **arithmetic**: per sub-layer, the share of the branch update that survives a bf16 sum,
    `<D, F> / <F, F>` with `D = bf16(bf16(alpha x) + bf16(F)) - bf16(alpha x)`, and the update's relative
    error `|D - F| / |F|`, measured on real activations: at init at `init_depths`, and on the trained models;
  - **training**: each scheme at `depth` trained with the stream in float32 and in bf16, same seeds and
    batches; the paired loss difference bf16 - float32.

"bf16 stream" (`round_stream`) rounds, in every sub-layer, the incoming stream, the shortcut sum (before
norm_out) and the outgoing stream to bf16, in the forward and (through the casts' gradients) the backward
pass; branches, norms and the head compute in float32 as before. Rounding is round-to-nearest-even on CPU
and GPU alike, so this is the arithmetic a bf16 stream has on a GPU, only slower. Decision rules:
results/PROTOCOL.md.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from keel.config import OptimConfig, RunConfig
from keel.experiments.budget import BudgetConfig, budget_point, paired_gap, unigram_level
from keel.experiments.common import (
    ExperimentConfig,
    experiment_run,
    fixed_batches,
    loss_axis,
    markdown_table,
    pm,
    pyplot,
    save,
    splits,
    tiny_quick,
    write_outputs,
)
from keel.experiments.surgery import residual_terms
from keel.experiments.sweep import Sweep
from keel.model import Residual, TransformerLM

STREAMS = ("float32", "bfloat16")


@dataclass
class PrecisionConfig(BudgetConfig):
    depth: int = 64
    schemes: list[str] = field(default_factory=lambda: ["keel", "pre_ln"])
    # one LR per scheme, in `schemes` order (no choice here: each scheme's LR chosen at this depth by `depth`)
    lrs: list[float] = field(default_factory=lambda: [3e-3, 1e-3])
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(warmup_steps=30))
    run: RunConfig = field(default_factory=lambda: experiment_run(steps=300, compile=False))
    init_depths: list[int] = field(default_factory=lambda: [64, 256, 1024])

    PER_POINT: ClassVar[dict[str, str]] = ExperimentConfig.PER_POINT | {
        "model.n_blocks": "depth and init_depths", "optim.lr": "lrs (one per scheme)"}

    @classmethod
    def quick(cls) -> PrecisionConfig:
        return tiny_quick(cls, 6, depth=4, seeds=[0, 1], curve_every=2, curve_batches=1, init_depths=[4, 16])


def to_bf16(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to bf16 (round to nearest even), kept in its own dtype; the gradient is rounded likewise."""
    return t.to(torch.bfloat16).to(t.dtype)


def round_stream(model: TransformerLM) -> list:
    """Give `model` a bf16 residual stream (see the module docstring); returns the hook handles."""
    handles = []
    for m in model.modules():
        if not isinstance(m, Residual):
            continue
        handles.append(m.register_forward_pre_hook(
            lambda mod, args: (to_bf16(args[0]), *args[1:]) if torch.is_tensor(args[0]) else None))
        if m.norm_out is not None:  # the sum alpha * x + F, before norm_out
            handles.append(m.norm_out.register_forward_pre_hook(lambda mod, args: (to_bf16(args[0]),)))
        handles.append(m.register_forward_hook(lambda mod, args, out: to_bf16(out) if torch.is_tensor(out) else None))
    return handles


def survival(ax: torch.Tensor, f: torch.Tensor) -> tuple[float, float]:
    """(share of F that survives the bf16 sum, relative error of the update), for one sub-layer's terms."""
    a = to_bf16(ax.double())
    d = to_bf16(a + to_bf16(f.double())) - a
    f = f.double()
    ff = f.pow(2).sum()
    if ff == 0:
        return float("nan"), float("nan")
    return float((d * f).sum() / ff), float((d - f).norm() / f.norm())


@torch.no_grad()
def survival_profile(model: TransformerLM, x: torch.Tensor) -> dict[str, list[float]]:
    """Per sub-layer: the surviving share, the relative error, and rms(F) / rms(alpha x)."""
    out = {"share": [], "rel_err": [], "f_over_ax": []}
    for ax, f in residual_terms(model, x):
        share, err = survival(ax, f)
        out["share"].append(share)
        out["rel_err"].append(err)
        out["f_over_ax"].append(float(f.pow(2).mean().sqrt() / ax.pow(2).mean().sqrt().clamp_min(1e-30)))
    return out


def _median(values: list[float]) -> float:
    vals = [v for v in values if v == v]
    return statistics.median(vals) if vals else float("nan")


def run(cfg: PrecisionConfig, out: Path, command: str) -> dict:
    if len(cfg.lrs) != len(cfg.schemes):
        raise ValueError(f"lrs: one LR per scheme ({len(cfg.schemes)}), got {len(cfg.lrs)}")
    lr_of = dict(zip(cfg.schemes, cfg.lrs))
    report = fixed_batches(splits(cfg.data)["report"], cfg.run.seq_len, cfg.run.batch_size, 1)
    x0 = report[0][0]

    def init_job(scheme, depth, seed):
        def job():
            torch.manual_seed(seed)
            return survival_profile(TransformerLM(cfg.point_model(scheme, depth)), x0)
        return job

    def train_job(scheme, stream, seed):
        return lambda: budget_point(cfg, cfg.point_model(scheme, cfg.depth), lr_of[scheme], seed,
                                    prepare=round_stream if stream == "bfloat16" else None,
                                    extra=lambda model, batches: {"survival": survival_profile(model, batches[0][0])})

    sweep = Sweep(out, cfg)
    points = sweep.run({f"init-{s}-{d}-seed{seed}": init_job(s, d, seed)
                        for s in cfg.schemes for d in cfg.init_depths for seed in cfg.seeds}, "stream-precision (init)")
    points |= sweep.run({f"{s}-{stream}-seed{seed}": train_job(s, stream, seed)
                         for s in cfg.schemes for stream in STREAMS for seed in cfg.seeds}, "stream-precision (train)")

    # (a) arithmetic: median over sub-layers 2.. (the first two are special in Keel v2), mean ± SD over seeds
    arith_rows, arith = [], {}
    for s in cfg.schemes:
        for d in cfg.init_depths:
            ps = [points[f"init-{s}-{d}-seed{seed}"] for seed in cfg.seeds]
            arith[f"{s}-{d}-init"] = [_median(p["share"][2:]) for p in ps]
            arith_rows.append([s, d, "init", pm(arith[f"{s}-{d}-init"]), pm([_median(p["rel_err"][2:]) for p in ps]),
                               pm([_median(p["f_over_ax"][2:]) for p in ps], 5)])
        for stream in STREAMS:
            ps = [points[f"{s}-{stream}-seed{seed}"] for seed in cfg.seeds]
            ps = [p["survival"] for p in ps if "survival" in p]
            key = f"{s}-{cfg.depth}-trained-{stream}"
            arith[key] = [_median(p["share"][2:]) for p in ps]
            arith_rows.append([s, cfg.depth, f"trained ({stream} stream)", pm(arith[key]),
                               pm([_median(p["rel_err"][2:]) for p in ps]),
                               pm([_median(p["f_over_ax"][2:]) for p in ps], 5)])
    arith_table = markdown_table(["scheme", "sub-layers", "state", "surviving share of F (median over sub-layers 2..)",
                                  "relative error of the update", "rms(F) / rms(alpha x)"], arith_rows)

    # (b) training: paired bf16 - float32 per scheme
    arms, train_rows = {}, []
    for s in cfg.schemes:
        for stream in STREAMS:
            runs = [points[f"{s}-{stream}-seed{seed}"] for seed in cfg.seeds]
            arms[f"{s}-{stream}"] = {"report_losses": [r["report_loss"] for r in runs],
                                     "diverged": sum(r["diverged"] for r in runs)}
        gap = paired_gap(arms[f"{s}-bfloat16"], arms[f"{s}-float32"])
        train_rows.append([s, f"{lr_of[s]:g}", pm(arms[f"{s}-float32"]["report_losses"]),
                           pm(arms[f"{s}-bfloat16"]["report_losses"]), f"{gap[0]:+.4f} ± {gap[1]:.4f}",
                           f"{arms[f'{s}-bfloat16']['diverged']}/{len(cfg.seeds)}"])
    train_table = markdown_table(["scheme", "LR", "float32 stream", "bf16 stream", "bf16 - float32 (paired)",
                                  "bf16 diverged"], train_rows)
    plots = [_plot_share(cfg, points, out), _plot_curves(cfg, points, out)]
    note = (f"{cfg.depth} sub-layers, {cfg.run.steps} steps x {cfg.run.batch_size}x{cfg.run.seq_len} tokens, "
            f"d={cfg.model.d_model}, seeds {cfg.seeds}; losses on the report half ({cfg.run.eval_batches} batches). "
            "Arithmetic on one report-half batch; 'init' is the paper's N(0, 0.02^2) init.")
    write_outputs(out, "stream-precision", cfg, command, {"points": points, "arithmetic": arith, "arms": arms},
                  arith_table + "\n\n" + train_table, plots, note)
    return {"points": points, "arithmetic": arith, "arms": arms}


def _plot_share(cfg, points, out) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, s in enumerate(cfg.schemes):
        for j, d in enumerate(cfg.init_depths):
            p = points[f"init-{s}-{d}-seed{cfg.seeds[0]}"]
            ax.plot([k / d for k in range(d)], p["share"], color=f"C{i}", ls=["-", "--", ":", "-."][j % 4], lw=0.9,
                    label=f"{s}, {d} sub-layers, init")
        p = points[f"{s}-float32-seed{cfg.seeds[0]}"].get("survival")
        if p:
            ax.plot([k / cfg.depth for k in range(cfg.depth)], p["share"], color=f"C{i}", lw=2, alpha=0.6,
                    label=f"{s}, {cfg.depth} sub-layers, trained")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("sub-layer index / L")
    ax.set_ylabel("share of F that survives a bf16 sum")
    ax.set_title(f"seed {cfg.seeds[0]}", fontsize=9)
    ax.legend(fontsize=7)
    return save(fig, out, "stream-share.png")


def _plot_curves(cfg, points, out) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, s in enumerate(cfg.schemes):
        for stream, ls in zip(STREAMS, ("-", "--")):
            runs = [points[f"{s}-{stream}-seed{seed}"] for seed in cfg.seeds]
            runs = [r for r in runs if r["evals"]["loss"] and not r["diverged"]]
            if not runs:
                continue
            steps = [t + 1 for t in runs[0]["evals"]["step"]]
            v = np.array([r["evals"]["loss"] for r in runs])
            ax.plot(steps, v.mean(0), color=f"C{i}", ls=ls, label=f"{s}, {stream} stream")
            ax.fill_between(steps, v.min(0), v.max(0), color=f"C{i}", alpha=0.15)
    unigram = unigram_level(cfg)
    ax.axhline(unigram, color="grey", ls=":", lw=0.8, label="unigram level")
    loss_axis(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("report-half loss (band: seed min..max)")
    ax.legend(fontsize=8)
    return save(fig, out, "stream-curves.png")
