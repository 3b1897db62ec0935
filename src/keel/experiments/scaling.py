"""Final validation loss under a fixed token budget, across LR (Table 2), depth (Table 3) and shape (Table 5).

Every point trains from scratch with the paper's recipe (AdamW, warm-up, cosine decay) for `steps` steps of
`batch_size x seq_len` tokens and reports the validation loss. Where a scheme is compared at "its best LR",
the best is taken over `lrs` at each depth (a small sweep, the same grid for every scheme).
"""

from __future__ import annotations

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
from keel.model.counting import count_params
from keel.train.config import OptimConfig


@dataclass
class BudgetConfig(Engine):
    schemes: list[str] = field(default_factory=lambda: ["pre_ln", "keel"])
    lrs: list[float] = field(default_factory=lambda: [3e-3, 1e-2])
    steps: int = 200
    warmup_steps: int = 30
    seed: int = 0
    eval_batches: int = 16
    shape: Shape = field(default_factory=Shape)
    data: DataConfig = field(default_factory=DataConfig)


@dataclass
class DepthConfig(BudgetConfig):
    depths: list[int] = field(default_factory=lambda: [8, 16, 32, 64])  # sub-layers, 8x span

    @classmethod
    def quick(cls) -> DepthConfig:
        return cls(depths=[4, 8], lrs=[3e-3], steps=8, warmup_steps=2, eval_batches=1,
                   shape=Shape(d_model=32, n_heads=2, n_kv_heads=1, seq_len=32, batch_size=4))


@dataclass
class LRSweepConfig(BudgetConfig):
    depth: int = 32
    lrs: list[float] = field(default_factory=lambda: [1e-3, 3e-3, 1e-2, 3e-2])

    @classmethod
    def quick(cls) -> LRSweepConfig:
        return cls(depth=8, lrs=[1e-3, 1e-2], steps=8, warmup_steps=2, eval_batches=1,
                   shape=Shape(d_model=32, n_heads=2, n_kv_heads=1, seq_len=32, batch_size=4))


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
                   steps=8, warmup_steps=2, eval_batches=1,
                   shape=Shape(d_model=32, n_heads=2, n_kv_heads=1, seq_len=32, batch_size=4))


def budget_point(cfg: BudgetConfig, model_cfg, lr: float) -> dict:
    optim = OptimConfig(lr=lr, warmup_steps=cfg.warmup_steps)
    config = point_config(model_cfg, optim, cfg.steps, cfg.shape, cfg.data, cfg.seed, cfg, cfg.eval_batches)
    curve, _ = train_curve(config, cfg.eval_batches)
    return {"scheme": model_cfg.scheme, "n_sublayers": model_cfg.n_sublayers, "d_model": model_cfg.d_model,
            "lr": lr, "val_loss": curve.val_loss, "losses": curve.losses, "n_params": count_params(model_cfg),
            "diverged": curve.stopped_at is not None, "seconds": curve.seconds}


def _val(r: dict) -> float:
    return r["val_loss"] if r["val_loss"] is not None else float("inf")


def tokens(cfg: BudgetConfig) -> int:
    return cfg.steps * cfg.shape.batch_size * cfg.shape.seq_len


def run_depth(cfg: DepthConfig, out: Path, command: str) -> dict:
    points = {f"{s}-{d}-lr{lr:g}": (lambda s=s, d=d, lr=lr: budget_point(cfg, cfg.shape.model(s, d), lr))
              for d in cfg.depths for s in cfg.schemes for lr in cfg.lrs}
    results = Sweep(out, cfg).run(points, "depth")
    best = {}
    for d in cfg.depths:
        for s in cfg.schemes:
            runs = [results[f"{s}-{d}-lr{lr:g}"] for lr in cfg.lrs]
            b = min(runs, key=_val)
            best[f"{s}-{d}"] = {"val_loss": b["val_loss"], "lr": b["lr"], "n_params": b["n_params"]}
    rows, gaps = [], {}
    for d in cfg.depths:
        row = [d]
        for s in cfg.schemes:
            row += [best[f"{s}-{d}"]["val_loss"], f"{best[f'{s}-{d}']['lr']:g}"]
        if {"pre_ln", "keel"} <= set(cfg.schemes):
            gaps[d] = best[f"keel-{d}"]["val_loss"] - best[f"pre_ln-{d}"]["val_loss"]
            row.append(gaps[d])
        rows.append(row)
    header = ["sub-layers"] + [h for s in cfg.schemes for h in (f"{s} val loss", f"{s} best LR")]
    if gaps:
        header.append("keel - pre_ln")
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for s in cfg.schemes:
        axes[0].plot(cfg.depths, [best[f"{s}-{d}"]["val_loss"] for d in cfg.depths], marker="o", label=s)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("sub-layers (L)")
    axes[0].set_ylabel("validation loss (best LR)")
    axes[0].legend()
    if gaps:
        axes[1].plot(cfg.depths, [gaps[d] for d in cfg.depths], marker="o", color="C3")
        axes[1].axhline(0, color="grey", lw=0.8)
        axes[1].set_xscale("log", base=2)
        axes[1].set_xlabel("sub-layers (L)")
        axes[1].set_ylabel("keel - pre_ln validation loss (< 0: Keel better)")
    fig.suptitle(f"depth at d={cfg.shape.d_model}, {tokens(cfg):,} tokens per run")
    fig.tight_layout()
    fig.savefig(out / "depth.png", dpi=110)
    plt.close(fig)
    notes = f"Each run: {cfg.steps} steps x {cfg.shape.batch_size * cfg.shape.seq_len} tokens = {tokens(cfg):,} tokens."
    write_outputs(out, "depth", cfg, command, {"points": results, "best": best, "gap_keel_minus_pre_ln": gaps},
                  markdown_table(header, rows), ["depth.png"], notes)
    return {"best": best, "gaps": gaps}


def run_lr_sweep(cfg: LRSweepConfig, out: Path, command: str) -> dict:
    points = {f"{s}-lr{lr:g}": (lambda s=s, lr=lr: budget_point(cfg, cfg.shape.model(s, cfg.depth), lr))
              for s in cfg.schemes for lr in cfg.lrs}
    results = Sweep(out, cfg).run(points, "lr-sweep")
    rows = [[f"{lr:g}"] + [results[f"{s}-lr{lr:g}"]["val_loss"] for s in cfg.schemes] for lr in cfg.lrs]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in cfg.schemes:
        ax.plot(cfg.lrs, [_val(results[f"{s}-lr{lr:g}"]) for lr in cfg.lrs], marker="o", label=s)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{cfg.depth} sub-layers, d={cfg.shape.d_model}, {tokens(cfg):,} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "lr-sweep.png", dpi=110)
    plt.close(fig)
    table = markdown_table(["peak LR"] + [f"{s} val loss" for s in cfg.schemes], rows)
    write_outputs(out, "lr-sweep", cfg, command, {"points": results}, table, ["lr-sweep.png"],
                  f"Each run: {tokens(cfg):,} tokens; None = diverged (non-finite loss).")
    return results


def run_deep_vs_wide(cfg: DeepWideConfig, out: Path, command: str) -> dict:
    from dataclasses import replace

    wide_shape = replace(cfg.shape, d_model=cfg.wide_d_model, n_heads=cfg.wide_heads, n_kv_heads=cfg.wide_kv_heads)
    arms = {"deep pre_ln": cfg.shape.model("pre_ln", cfg.deep_sublayers),
            "wide pre_ln": wide_shape.model("pre_ln", cfg.wide_sublayers),
            "deep keel": cfg.shape.model("keel", cfg.deep_sublayers)}
    points = {f"{arm.replace(' ', '-')}-lr{lr:g}": (lambda m=m, lr=lr: budget_point(cfg, m, lr))
              for arm, m in arms.items() for lr in cfg.lrs}
    results = Sweep(out, cfg).run(points, "deep-vs-wide")
    rows, best = [], {}
    for arm, m in arms.items():
        runs = [results[f"{arm.replace(' ', '-')}-lr{lr:g}"] for lr in cfg.lrs]
        b = min(runs, key=_val)
        best[arm] = {"val_loss": b["val_loss"], "lr": b["lr"], "n_params": b["n_params"]}
        rows.append([arm, m.n_sublayers, m.d_model, f"{b['n_params']:,}", f"{b['lr']:g}", b["val_loss"]])
    table = markdown_table(["arm", "sub-layers", "d_model", "parameters", "best LR", "val loss"], rows)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(list(best), [best[a]["val_loss"] or 0 for a in best], color=["C0", "C1", "C2"])
    lo = min(best[a]["val_loss"] or 0 for a in best)
    ax.set_ylim(lo - 0.1, None)
    ax.set_ylabel("validation loss (best LR)")
    ax.set_title(f"equal parameters, {tokens(cfg):,} tokens")
    fig.tight_layout()
    fig.savefig(out / "deep-vs-wide.png", dpi=110)
    plt.close(fig)
    write_outputs(out, "deep-vs-wide", cfg, command, {"points": results, "best": best}, table,
                  ["deep-vs-wide.png"], f"Each run: {tokens(cfg):,} tokens.")
    return best
