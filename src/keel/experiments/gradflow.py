"""gradflow: the quantities of the paper's gradient argument (section 3, Eq. 15/19), measured directly.

Through a shortcut followed by a norm, y = LN(alpha * x + F), the gradient reaching x along the shortcut
is scaled by about gamma * rms(alpha x) / rms(alpha x + F): 1/sqrt(2) for Post-LN when |F| = |x| (so
(1/2)^(L/2) over L sub-layers, Eq. 15), and alpha / sqrt(alpha^2 + 1) for Keel (Eq. 19), which tends to 1.
Per sub-layer i, on one fixed batch, measured here:
  - factor[i] = rms(alpha x_i) / rms(alpha x_i + F_i), for sub-layers with a norm_out (None otherwise;
    Pre-LN's shortcut is the identity, factor 1 by construction);
  - f_over_x[i] = rms(F_i) / rms(x_i), the size ratio the equations assume to be 1;
  - grad_stream[i] = |dL/dx_i|, the gradient reaching sub-layer i's input on the residual stream;
  - grad_params[i]: the gradient norm of sub-layer i's parameters.
at initialisation (several seeds) under two inits: `default` (N(0, 0.02^2), the paper's) and `matched`
(std = 1/sqrt(d_model), which makes |F| ~ |x|, the regime the equations assume), and after `steps`
training steps from the default init. Tiny width, so depths up to 256 sub-layers are cheap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import torch

from keel.data import eval_batches
from keel.experiments.common import (
    ExperimentConfig,
    Sweep,
    corpus,
    experiment_model,
    experiment_run,
    markdown_table,
    pm,
    point_config,
    pyplot,
    splits,
    tiny_quick,
    train_curve,
    write_outputs,
)
from keel.experiments.probes import residual_sizes
from keel.model import ModelConfig
from keel.model.transformer import TransformerLM
from keel.scale.parallel import apply_fused_junction
from keel.train.config import OptimConfig, RunConfig

INITS = ("default", "matched")
STYLES = ("-", "--", "-.", ":")  # schemes that coincide (DeepNorm and Keel near 1) stay visible


@dataclass
class GradflowConfig(ExperimentConfig):
    """The trained seeds train `run.steps` steps at `optim.lr`; d=32 so that 256 sub-layers stay cheap."""

    model: ModelConfig = field(default_factory=lambda: replace(experiment_model(), d_model=32, n_heads=2,
                                                               n_kv_heads=1))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=20))
    run: RunConfig = field(default_factory=lambda: experiment_run(steps=100, batch_size=4))
    schemes: list[str] = field(default_factory=lambda: ["post_ln", "deepnorm", "pre_ln", "keel"])
    depths: list[int] = field(default_factory=lambda: [16, 64, 256])  # sub-layers
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # at initialisation
    trained_seeds: list[int] = field(default_factory=lambda: [0, 1])  # also trained for `run.steps` steps

    PER_POINT: ClassVar[dict[str, str]] = {"model.scheme": "schemes", "model.n_blocks": "depths",
                                           "model.max_seq_len": "run.seq_len", "model.init_std": "the two inits"}

    @classmethod
    def quick(cls) -> GradflowConfig:
        return tiny_quick(cls, 5, optim={"warmup_steps": 20}, depths=[8, 16], seeds=[0, 1], trained_seeds=[0])


def measure(model: TransformerLM, x: torch.Tensor, y: torch.Tensor) -> dict:
    """One forward/backward on (x, y): per-sub-layer stream gradient, parameter gradient, stream RMS, and
    the shortcut quantities of Eq. 15/19."""
    apply_fused_junction(model, "off")  # the hooks below read one sub-layer at a time, not fused pairs
    subs = model.sublayers()
    inputs, outputs, hooks = {}, {}, []
    for s in subs:
        module = model.get_submodule(s.path)

        def pre(m, args, i=s.index):
            args[0].retain_grad()
            inputs[i] = args[0]

        def post(m, args, out, i=s.index):
            outputs[i] = out.detach()
        hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    _, loss = model(x.to(device), y.to(device))
    loss.backward()
    for h in hooks:
        h.remove()
    grad_params = []
    for s in subs:
        block = model.blocks[s.block]
        parts = [block.attn if s.kind == "attn" else block.ffn, model.get_submodule(s.path)]
        sq = sum(p.grad.pow(2).sum().item() for part in parts for p in part.parameters() if p.grad is not None)
        grad_params.append(math.sqrt(sq))
    model.zero_grad(set_to_none=True)
    sizes = residual_sizes(model, x)
    factor, f_over_x = [], []
    for s, f, ax, total in zip(subs, sizes["rms_f"], sizes["rms_ax"], sizes["rms_sum"]):
        factor.append(ax / total if s.norm_out and total > 0 else None)
        f_over_x.append(f * s.alpha / ax if ax > 0 else float("inf"))
    return {
        "loss": loss.item(),
        "grad_stream": [inputs[s.index].grad.norm().item() for s in subs],
        "grad_params": grad_params,
        "rms": [outputs[s.index].pow(2).mean().sqrt().item() for s in subs],
        "factor": factor,
        "f_over_x": f_over_x,
    }


def point(cfg: GradflowConfig, scheme: str, depth: int, init: str, seed: int, train: bool) -> dict:
    model_cfg = cfg.point_model(scheme, depth)
    if init == "matched":
        model_cfg = replace(model_cfg, init_std=1 / math.sqrt(cfg.model.d_model))
    torch.manual_seed(seed)
    model = TransformerLM(model_cfg)
    x, y = next(eval_batches(splits(cfg.data)["report"], cfg.run.seq_len, cfg.run.batch_size, 1))
    out = {"scheme": scheme, "depth": depth, "init": init, "seed": seed, "at_init": measure(model, x, y)}
    if train:
        config = point_config(cfg, model_cfg, seed)
        curve, model = train_curve(config, eval_batches=0, model=model)
        out["trained"] = measure(model, x, y) if curve.stopped_at is None else None
        out["train_losses"] = curve.losses
    return out


def summary(m: dict, n: int) -> dict:
    """Sub-layer 2 ("bottom", past Keel's special first pair and the embedding-scale input) against L-1."""
    factors = [f for f in m["factor"][2:] if f is not None]
    return {"grad_bottom_over_top": m["grad_stream"][2] / m["grad_stream"][n - 1],
            "product_of_factors": math.prod(factors) if factors else None,
            "mean_factor": sum(factors) / len(factors) if factors else None,
            "median_f_over_x": sorted(m["f_over_x"][2:])[(n - 2) // 2]}


def run(cfg: GradflowConfig, out: Path, command: str) -> dict:
    corpus(cfg.data)
    points = {f"{s}-{d}-{init}-seed{seed}": (lambda s=s, d=d, init=init, seed=seed: point(
        cfg, s, d, init, seed, init == "default" and seed in cfg.trained_seeds))
        for d in cfg.depths for s in cfg.schemes for init in INITS for seed in cfg.seeds}
    results = Sweep(out, cfg).run(points, "gradflow")
    rows, table = [], {}
    for d in cfg.depths:
        for s in cfg.schemes:
            for init, stage in (("default", "at_init"), ("matched", "at_init"), ("default", "trained")):
                ms = [results[f"{s}-{d}-{init}-seed{seed}"].get(stage) for seed in cfg.seeds]
                sums = [summary(m, d) for m in ms if m]
                if not sums:
                    continue
                table[f"{s}-{d}-{init}-{stage}"] = sums
                label = "init" if stage == "at_init" else f"after {cfg.run.steps} steps"
                rows.append([s, d, f"{init} {label}", pm([x["median_f_over_x"] for x in sums], 3),
                             pm([x["mean_factor"] for x in sums], 4) if sums[0]["mean_factor"] else "- (1)",
                             _g(sums, "product_of_factors"), _g(sums, "grad_bottom_over_top")])
    header = ["scheme", "sub-layers", "state", "median rms(F)/rms(x)", "mean shortcut factor",
              "product of factors 2..L-1 (geo. mean over seeds)", "|dL/dx_2| / |dL/dx_(L-1)| (geo. mean)"]
    plots = [_plot(cfg, results, quantity, init, stage, out)
             for quantity, init, stage in (("grad_stream", "default", "at_init"), ("grad_stream", "matched", "at_init"),
                                           ("grad_stream", "default", "trained"), ("factor", "matched", "at_init"),
                                           ("factor", "default", "trained"))]
    notes = ("Shortcut factor = rms(alpha x)/rms(alpha x + F) per sub-layer with a norm_out; the paper's "
             "prediction with |F| = |x|: 1/sqrt(2) = 0.707 for Post-LN, L^0.25/sqrt(L^0.5+1) for DeepNorm, "
             "L/sqrt(L^2+1) for Keel. Bottom = sub-layer 2, top = L-1. 'default' init: N(0, 0.02^2); "
             f"'matched': std 1/sqrt(d) = {1 / math.sqrt(cfg.model.d_model):.3f}. d={cfg.model.d_model}, one batch of "
             f"{cfg.run.batch_size}x{cfg.run.seq_len} tokens from the report half; seeds at init {cfg.seeds}, "
             f"trained {cfg.trained_seeds} ({cfg.run.steps} steps at LR {cfg.optim.lr:g}).")
    write_outputs(out, "gradflow", cfg, command, {"points": results, "summary": table},
                  markdown_table(header, rows), plots, notes)
    return table


def _g(sums: list[dict], key: str) -> str:
    vals = [x[key] for x in sums if x[key] is not None and x[key] > 0]
    if not vals:
        return "-"
    logs = [math.log10(v) for v in vals]
    return f"{10 ** (sum(logs) / len(logs)):.3g} (range {min(vals):.3g}..{max(vals):.3g})"


def _plot(cfg, results, quantity, init, stage, out) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(cfg.depths), figsize=(4.5 * len(cfg.depths), 3.8), squeeze=False)
    for ax, d in zip(axes[0], cfg.depths):
        for i, s in enumerate(cfg.schemes):
            for j, seed in enumerate(cfg.seeds):
                m = results[f"{s}-{d}-{init}-seed{seed}"].get(stage)
                if not m:
                    continue
                vals = [v if v is not None else float("nan") for v in m[quantity]]
                ax.plot(range(d), vals, color=f"C{i}", lw=0.9, alpha=0.8, ls=STYLES[i % len(STYLES)],
                        label=s if j == 0 else None)
        if quantity == "factor":
            ax.axhline(1 / math.sqrt(2), color="grey", ls=":", lw=0.8, label="1/sqrt(2)")
        ax.set_yscale("log")
        ax.set_title(f"{d} sub-layers", fontsize=9)
        ax.set_xlabel("sub-layer index (0 = bottom)")
    axes[0][0].set_ylabel({"grad_stream": "|dL/dx| entering the sub-layer",
                           "factor": "rms(alpha x) / rms(alpha x + F)"}[quantity])
    axes[0][-1].legend(fontsize=8)
    state = "at init" if stage == "at_init" else f"after {cfg.run.steps} steps"
    fig.suptitle(f"{quantity}, {init} init, {state} (one line per seed)", fontsize=10)
    fig.tight_layout()
    name = f"gradflow-{quantity.replace('_', '-')}-{init}-{stage.replace('_', '-')}.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name
