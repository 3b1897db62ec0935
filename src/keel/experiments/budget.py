"""The budget measurement (`measure: loss`): one point's losses on both halves, its curves and probes."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from keel.config import GuardConfig, OptimConfig, RunConfig
from keel.data import DataConfig
from keel.evals.surgery import branches_off, plain, residual_sizes
from keel.experiments import common
from keel.experiments.partial import Partial, partial_dir
from keel.model import ModelConfig, TransformerLM
from keel.model.counting import count_params
from keel.runtime import autocast_for


@dataclass
class BudgetConfig:
    """keel train's sections and the curve and probe: `run.steps` steps of `run.batch_size x run.seq_len` tokens;
    `run.eval_batches` batches per validation half."""

    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    guard: GuardConfig
    run: RunConfig
    curve_every: int = 50  # report-half loss on `curve_batches` batches every this many steps (0: off)
    curve_batches: int = 2
    probe: bool = False
    probe_batches: int = 4


def budget_point(cfg: BudgetConfig, model_cfg, lr: float, seed: int,
                 prepare: Callable[[nn.Module], object] | None = None,
                 extra: Callable[[nn.Module, list], dict] | None = None) -> dict:
    """Train one model: its losses on both halves, its curves, (with cfg.probe) its probes. `prepare(model)` changes
    the initialised model before training; `extra(model, report_batches)` adds measurements of the trained one."""
    model = None
    if prepare is not None:
        torch.manual_seed(seed)  # train_curve seeds the same way before it would build the model
        model = TransformerLM(model_cfg)
        prepare(model)
    config = common.point_config(cfg, model_cfg, seed, lr=lr)
    seq_len, batch_size, eval_batches = cfg.run.seq_len, cfg.run.batch_size, cfg.run.eval_batches
    halves = common.splits(cfg.data)
    curve_set = common.fixed_batches(halves["report"], seq_len, batch_size, cfg.curve_batches)
    evals = {"step": [], "loss": []}

    def on_step(i, model, result):
        if cfg.curve_every and (i + 1) % cfg.curve_every == 0:
            evals["step"].append(i)
            auto = autocast_for(next(model.parameters()).device, cfg.run.dtype)
            evals["loss"].append(common.loss_on(model, curve_set, auto))
        return False
    # inside a sweep, progress is kept as the point trains (a point `prepare` changes is trained whole)
    where = partial_dir() if prepare is None else None
    partial = None if where is None else Partial(where, json.loads(json.dumps(asdict(config), default=str)), evals)
    curve, model = common.train_curve(config, eval_batches, model=model, on_step=on_step,
                                      eval_tokens=halves["select"], partial=partial)
    out = {"scheme": model_cfg.scheme, "n_sublayers": model_cfg.n_sublayers, "d_model": model_cfg.d_model,
           "alpha": model_cfg.alpha, "first_layer": model_cfg.first_layer, "lr": lr, "seed": seed,
           "select_loss": curve.val_loss, "report_loss": None, "losses": curve.losses, "evals": evals,
           "n_params": count_params(model_cfg), "diverged": curve.stopped_at is not None,
           "seconds": curve.seconds, "tokens": cfg.run.steps * cfg.run.batch_size * cfg.run.seq_len}
    if partial is not None and partial.resumed_at:  # continued after its process was killed, from these steps
        out["resumed_at"] = partial.resumed_at
    if curve.stopped_at is not None:
        return out
    auto = autocast_for(next(model.parameters()).device, cfg.run.dtype)
    report = common.fixed_batches(halves["report"], seq_len, batch_size, eval_batches)
    out["report_loss"] = common.loss_on(model, report, auto)
    if cfg.probe or extra is not None:
        model = plain(model)  # the probes hook or swap single sub-layers: an eager twin of a compiled model
    if cfg.probe:
        out["probe"] = probe(model, report[:cfg.probe_batches], auto)
    if extra is not None:
        out |= extra(model, report)
    return out


def probe(model, batches: list, autocast) -> dict:
    """Effective depth: loss with every branch above sub-layer k switched off, for k = 0, 1, 2, 4, ..., L and L // 2
    (the lower half on, whatever L); and per-sub-layer rms(F) / rms(alpha x) on the first batch."""
    n = model.n_sublayers
    cuts = sorted({0, 1, 2, *(2 ** i for i in range(2, int(math.log2(n)) + 1)), n // 2, n})
    loss_above_off = {}
    for k in cuts:
        with branches_off(model, range(k, n)):
            loss_above_off[str(k)] = common.loss_on(model, batches, autocast)
    sizes = residual_sizes(model, batches[0][0])
    return {"loss_branches_above_k_off": loss_above_off,
            "f_over_ax": [f / a if a > 0 else float("inf") for f, a in zip(sizes["rms_f"], sizes["rms_ax"])]}
