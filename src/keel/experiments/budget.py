"""The budget method every loss-at-a-token-budget experiment shares (depth, lr-sweep, deep-vs-wide, ablations,
regime, stream-precision): one point trained from scratch, its LR chosen on the select half, its seeds, its
report-half losses.

Every point trains with the paper's recipe (AdamW, linear warm-up, cosine decay) for `run.steps` steps of
`run.batch_size x run.seq_len` tokens. The method:
  - the LR of each arm (scheme x depth x ...) is chosen with the first seed from the grid `lrs`, by the loss
    on the *select* half of the validation split;
  - the remaining seeds run at that LR only; every reported number is the loss on the *report* half, as
    mean and SD over `seeds` (all at the chosen LR);
  - each point logs its training loss every step and the report-half loss every `curve_every` steps, so a
    crossing of two schemes' curves is visible;
  - with `probe`, each trained model is also probed (keel.experiments.surgery): the loss when every branch
    above sub-layer k is switched off (the effective-depth probe), and per-sub-layer rms(F) / rms(alpha x).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from keel.experiments.common import (
    ExperimentConfig,
    corpus,
    fixed_batches,
    loss_on,
    mean_sd,
    point_config,
    splits,
    train_curve,
    unigram_loss,
)
from keel.experiments.partial import Partial, partial_dir
from keel.experiments.surgery import branches_off, plain, residual_sizes
from keel.experiments.sweep import Sweep
from keel.model import TransformerLM
from keel.model.counting import count_params
from keel.runtime import autocast_for


@dataclass
class BudgetConfig(ExperimentConfig):
    """`run.steps` steps of `run.batch_size x run.seq_len` tokens per point; `run.eval_batches` batches per
    validation half (select / report)."""

    schemes: list[str] = field(default_factory=lambda: ["post_ln", "pre_ln", "keel"])
    lrs: list[float] = field(default_factory=lambda: [1e-3, 3e-3, 1e-2])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # the first one also chooses the LR
    curve_every: int = 50  # report-half loss on `curve_batches` batches every this many steps (0: off)
    curve_batches: int = 2
    probe: bool = False
    probe_batches: int = 4


def budget_point(cfg: BudgetConfig, model_cfg, lr: float, seed: int,
                 prepare: Callable[[nn.Module], object] | None = None,
                 extra: Callable[[nn.Module, list], dict] | None = None) -> dict:
    """Train one model; its losses on both validation halves, its curves, and (with cfg.probe) its probes.
    `prepare(model)` changes the freshly initialised model before training (the init is the same as without
    it); `extra(model, report_batches)` adds measurements of the trained model to the point."""
    model = None
    if prepare is not None:
        torch.manual_seed(seed)  # train_curve seeds the same way before it would build the model
        model = TransformerLM(model_cfg)
        prepare(model)
    config = point_config(cfg, model_cfg, seed, lr=lr)
    seq_len, batch_size, eval_batches = cfg.run.seq_len, cfg.run.batch_size, cfg.run.eval_batches
    halves = splits(cfg.data)
    curve_set = fixed_batches(halves["report"], seq_len, batch_size, cfg.curve_batches)
    evals = {"step": [], "loss": []}

    def on_step(i, model, result):
        if cfg.curve_every and (i + 1) % cfg.curve_every == 0:
            evals["step"].append(i)
            evals["loss"].append(loss_on(model, curve_set, autocast_for(next(model.parameters()).device,
                                                                         cfg.run.dtype)))
        return False
    # inside a sweep, progress is kept as the point trains (a point `prepare` changes is trained whole)
    where = partial_dir() if prepare is None else None
    partial = None if where is None else Partial(where, json.loads(json.dumps(asdict(config), default=str)), evals)
    curve, model = train_curve(config, eval_batches, model=model, on_step=on_step, eval_tokens=halves["select"],
                               partial=partial)
    out = {"scheme": model_cfg.scheme, "n_sublayers": model_cfg.n_sublayers, "d_model": model_cfg.d_model,
           "alpha": model_cfg.alpha, "first_layer": model_cfg.first_layer, "lr": lr, "seed": seed,
           "select_loss": curve.val_loss, "report_loss": None, "losses": curve.losses, "evals": evals,
           "n_params": count_params(model_cfg), "diverged": curve.stopped_at is not None,
           "seconds": curve.seconds, "tokens": tokens(cfg)}
    if partial is not None and partial.resumed_at:  # continued after its process was killed, from these steps
        out["resumed_at"] = partial.resumed_at
    if curve.stopped_at is not None:
        return out
    auto = autocast_for(next(model.parameters()).device, cfg.run.dtype)
    report = fixed_batches(halves["report"], seq_len, batch_size, eval_batches)
    out["report_loss"] = loss_on(model, report, auto)
    if cfg.probe or extra is not None:
        model = plain(model)  # the probes hook or swap single sub-layers: an eager twin of a compiled model
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


def select_then_seeds(cfg: BudgetConfig, out: Path, arms: dict, desc: str,
                      grids: dict[str, list[float]] | None = None) -> dict:
    """Phase 1: every arm at every LR with the first seed; the LR with the lowest select-half loss is
    chosen. Phase 2: the other seeds at the chosen LR. Returns {points, chosen, arms}, where arms[label] has
    the report-half losses of every seed at the chosen LR. `grids[label]` replaces `cfg.lrs` for an arm."""
    grid = {label: (grids or {}).get(label, cfg.lrs) for label in arms}
    sweep, s0 = Sweep(out, cfg), cfg.seeds[0]

    def job(label, lr, seed):
        return lambda: budget_point(cfg, arms[label], lr, seed)
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
    batches = fixed_batches(splits(cfg.data)["report"], cfg.run.seq_len, cfg.run.batch_size, cfg.run.eval_batches)
    return unigram_loss(corpus(cfg.data).train, batches)


def tokens(cfg: BudgetConfig) -> int:
    return cfg.run.steps * cfg.tokens_per_step()


def method_note(cfg: BudgetConfig) -> str:
    return (f"Each run: {cfg.run.steps} steps x {cfg.run.batch_size}x{cfg.run.seq_len} tokens = {tokens(cfg):,} "
            f"tokens, d={cfg.model.d_model}, warm-up {cfg.optim.warmup_steps} then cosine. LR chosen per arm from "
            f"{cfg.lrs} with seed {cfg.seeds[0]} on the select half of the validation split; seeds {cfg.seeds} at "
            f"that LR; losses on the report half ({cfg.run.eval_batches} batches), mean ± SD over seeds.")
