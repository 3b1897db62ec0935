"""gradflow: the quantities of the paper's gradient argument (section 3, Eq. 15/19), measured directly.

Through a shortcut followed by a norm, y = LN(alpha * x + F), the gradient reaching x along the shortcut
is scaled by about gamma_l * alpha / rms(alpha x + F): with rms(x) = gamma_(l-1) and |F| = |x| that is
gamma_l / (sqrt(2) gamma_(l-1)) for Post-LN (so (1/2)^(L/2) over L sub-layers, Eq. 15), and
alpha / sqrt(alpha^2 + 1) for Keel (Eq. 19), which tends to 1.

Which quantity the equations predict: the *shortcut factor*, the vector-Jacobian product of the stream's
gradient through alpha*x -> norm_out alone, with the branch F held fixed. They do not predict the full
stream factor |dL/dx_l| / |dL/dx_(l+1)|, which adds the gradient through F(norm_in(x)); that one is what
decides whether the bottom of the stack receives gradient. Per sub-layer i (x_i = the stream entering it,
g_i = dL/dx_i), on one fixed batch, measured here (`measure`):
  - factor[i] = rms(alpha x_i) / rms(alpha x_i + F_i), the forward ratio, for sub-layers with a norm_out
    (None otherwise; Pre-LN's shortcut is the identity). With gamma = 1 it is the shortcut factor's size
    estimate, not a gradient;
  - shortcut[i] = |g_(i+1) J_i| / |g_(i+1)|, J_i = d norm_out(alpha x_i + F_i) / dx_i with F_i fixed, by
    autograd on the sub-layer's own Residual with its branch output replayed as a constant;
  - jacobian[i] = |g_i| / |g_(i+1)|, from backward hooks (retained gradients) along the stream;
  - predicted[i] = alpha / sqrt(alpha^2 + 1) behind a norm_out (1 without one): Eq. 15/19 at |F| = |x|, gamma = 1;
  - f_over_x[i] = rms(F_i) / rms(x_i), the size ratio the equations assume to be 1;
  - grad_stream[i] = |g_i|, grad_out[i] = |g_(i+1)|, grad_params[i] (sub-layer i's parameters), rms[i]
    (the stream leaving sub-layer i).
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

from keel.config import OptimConfig, RunConfig
from keel.data import eval_batches
from keel.errors import ConfigError
from keel.evals.surgery import residual_sizes
from keel.experiments import store
from keel.experiments.common import (
    corpus,
    experiment_run,
    markdown_table,
    pm,
    point_config,
    pyplot,
    save,
    splits,
    train_curve,
    write_outputs,
)
from keel.experiments.sweep import Sweep
from keel.model import ModelConfig
from keel.model.sizes import science
from keel.model.transformer import TransformerLM
from keel.scale.fused_junction import apply_fused_junction
from keel_studies.common import ExperimentConfig, tiny_quick

INITS = ("default", "matched")
STYLES = ("-", "--", "-.", ":")  # schemes that coincide (DeepNorm and Keel near 1) stay visible


@dataclass
class GradflowConfig(ExperimentConfig):
    """The trained seeds train `run.steps` steps at `optim.lr`; d=32 so that 256 sub-layers stay cheap."""

    model: ModelConfig = field(default_factory=lambda: replace(science(), d_model=32, n_heads=2,
                                                               n_kv_heads=1))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=20))
    run: RunConfig = field(default_factory=lambda: experiment_run(steps=100, batch_size=4, compile=False))
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
    """One forward/backward on (x, y): per sub-layer i (x_i = the stream entering it, g_i = dL/dx_i), the
    stream gradient |g_i| and |g_(i+1)|, the parameter gradient, the stream RMS, the forward ratio of
    Eq. 15/19 (`factor`), and the two backward factors: `jacobian` = |g_i| / |g_(i+1)| (shortcut and branch)
    and `shortcut` = |g_(i+1) d(x_(i+1))/d(x_i)| / |g_(i+1)| with F held fixed (the paper's factor);
    `predicted` = Eq. 15/19 at |F| = |x|, gamma = 1."""
    apply_fused_junction(model, "off")  # the hooks below read one sub-layer at a time, not fused pairs
    subs = model.sublayers()
    # in call order, so that a looped model's shared modules give one entry per unrolled sub-layer
    inputs, outputs, branches, hooks = [], [], [], []

    def pre(m, args):
        args[0].retain_grad()
        inputs.append(args[0])

    def post(m, args, out):
        out.retain_grad()
        outputs.append(out)

    def branch_out(m, args, out):
        branches.append(out.detach())
    for path in dict.fromkeys(s.path for s in subs):
        module = model.get_submodule(path)
        hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    for block in model.blocks:
        hooks += [block.attn.register_forward_hook(branch_out), block.ffn.register_forward_hook(branch_out)]
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    try:
        _, loss = model(x.to(device), y.to(device))
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    assert len(inputs) == len(outputs) == len(branches) == len(subs), "one call per sub-layer expected"
    grad_params = []
    for s in subs:
        block = model.blocks[s.block]
        parts = [block.attn if s.kind == "attn" else block.ffn, model.get_submodule(s.path)]
        sq = sum(p.grad.pow(2).sum().item() for part in parts for p in part.parameters() if p.grad is not None)
        grad_params.append(math.sqrt(sq))
    model.zero_grad(set_to_none=True)
    grad_in = [t.grad.norm().item() for t in inputs]
    grad_out = [t.grad.norm().item() for t in outputs]
    shortcut = [_shortcut_factor(model.get_submodule(s.path), xi.detach(), h, out.grad)
                for s, xi, h, out in zip(subs, inputs, branches, outputs)]
    sizes = residual_sizes(model, x)
    factor, f_over_x = [], []
    for s, f, ax, total in zip(subs, sizes["rms_f"], sizes["rms_ax"], sizes["rms_sum"]):
        factor.append(ax / total if s.norm_out and total > 0 else None)
        f_over_x.append(f * s.alpha / ax if ax > 0 else float("inf"))
    return {
        "loss": loss.item(),
        "grad_stream": grad_in,
        "grad_out": grad_out,
        "grad_params": grad_params,
        "rms": [t.detach().pow(2).mean().sqrt().item() for t in outputs],
        "factor": factor,
        "f_over_x": f_over_x,
        "jacobian": [gi / go if go > 0 else float("inf") for gi, go in zip(grad_in, grad_out)],
        "shortcut": shortcut,
        "predicted": [predicted_factor(s) for s in subs],
    }


def predicted_factor(s) -> float:
    """Eq. 15/19's per-sub-layer shortcut factor with |F| = |x| and every gamma = 1: alpha / sqrt(alpha^2 + 1)
    behind a norm_out (1/sqrt(2) for Post-LN, L/sqrt(L^2 + 1) for Keel), alpha (= 1) without one (Pre-LN)."""
    return s.alpha / math.sqrt(s.alpha**2 + 1) if s.norm_out else s.alpha


def _shortcut_factor(res, x: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> float:
    """|g J| / |g| for J = d norm_out(alpha x + h) / dx with the branch output h held fixed: the gradient
    through the shortcut alone (the sub-layer's own Residual, its branch replaced by the recorded h).
    Dropout, where a model has it, is not replayed (the experiments use none)."""
    with torch.enable_grad():
        x = x.clone().requires_grad_(True)
        y = res(x, lambda u, *args: h)
        (gx,) = torch.autograd.grad(y, x, g)
    norm = g.norm().item()
    return gx.norm().item() / norm if norm > 0 else float("inf")


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
    """Sub-layers 2..L-1 (past Keel's special first pair and the embedding-scale input): means and products of
    the three factors, each factor's geometric-mean ratio to Eq. 15/19's, and |g_2| / |g_(L-1)|."""
    keep = range(2, n)
    factors = [m["factor"][i] for i in keep if m["factor"][i] is not None]
    out = {"grad_bottom_over_top": m["grad_stream"][2] / m["grad_stream"][n - 1],
           "product_of_factors": math.prod(factors) if factors else None,
           "mean_factor": sum(factors) / len(factors) if factors else None,
           "median_f_over_x": sorted(m["f_over_x"][2:])[(n - 2) // 2]}
    for key in ("shortcut", "jacobian", "predicted"):
        vals = [m[key][i] for i in keep]
        out[f"mean_{key}"] = sum(vals) / len(vals)
        out[f"product_{key}"] = math.prod(vals)
    for key in ("factor", "shortcut", "jacobian"):
        logs = [math.log(m[key][i] / m["predicted"][i]) for i in keep if m[key][i] is not None]
        out[f"{key}_over_predicted"] = math.exp(sum(logs) / len(logs)) if logs else None
    return out


def run(cfg: GradflowConfig, out: Path, command: str) -> dict:
    corpus(cfg.data)
    points = {f"{s}-{d}-{init}-seed{seed}": (lambda s=s, d=d, init=init, seed=seed: point(
        cfg, s, d, init, seed, init == "default" and seed in cfg.trained_seeds))
        for d in cfg.depths for s in cfg.schemes for init in INITS for seed in cfg.seeds}
    _refuse_points_without_backward_factors(out, points)
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
                             f"{sums[0]['mean_predicted']:.4f}",
                             pm([x["mean_factor"] for x in sums], 4) if sums[0]["mean_factor"] else "- (1)",
                             pm([x["mean_shortcut"] for x in sums], 4), pm([x["mean_jacobian"] for x in sums], 4),
                             f"{sums[0]['product_predicted']:.3g}", _g(sums, "product_of_factors"),
                             _g(sums, "product_shortcut"), _g(sums, "product_jacobian")])
    header = ["scheme", "sub-layers", "state", "median rms(F)/rms(x)", "Eq. 15/19 factor (rms F = rms x, gamma=1)",
              "forward ratio rms(alpha x)/rms(alpha x+F), mean", "shortcut factor (backward, F fixed), mean",
              "Jacobian factor abs(g_i)/abs(g_i+1), mean", "Eq. 15/19 product 2..L-1",
              "forward ratio product (geo. mean over seeds)", "shortcut factor product (geo. mean)",
              "Jacobian factor product = abs(g_2)/abs(g_L) (geo. mean)"]
    plots = [_plot(cfg, results, quantity, init, stage, out)
             for quantity, init, stage in (("grad_stream", "default", "at_init"), ("grad_stream", "matched", "at_init"),
                                           ("grad_stream", "default", "trained"), ("factor", "matched", "at_init"),
                                           ("factor", "default", "trained"), ("shortcut", "matched", "at_init"),
                                           ("shortcut", "default", "trained"), ("jacobian", "matched", "at_init"),
                                           ("jacobian", "default", "trained"))]
    notes = ("Three per-sub-layer factors, x_i the stream entering sub-layer i and g_i = dL/dx_i (backward hooks "
             "on one batch): the forward ratio rms(alpha x)/rms(alpha x + F) (sub-layers with a norm_out); the "
             "shortcut factor |g_(i+1) J_i| / |g_(i+1)|, J_i = d norm_out(alpha x_i + F)/dx_i with F held fixed "
             "(the gradient through the shortcut alone); and the Jacobian factor |g_i| / |g_(i+1)|, shortcut and "
             "branch together. Eq. 15/19 predict the shortcut factor: gamma_l/(sqrt(2) gamma_(l-1)) for Post-LN "
             "and alpha/sqrt(alpha^2+1) for Keel (L/sqrt(L^2+1); DeepNorm L^0.25/sqrt(L^0.5+1); Pre-LN 1), "
             "assuming |F| = |x| and gamma = 1, so they apply to the 'matched' init, not to the default one, where "
             "|F| << |x|. They say nothing about the branch's share of g_i, which the Jacobian factor includes: a "
             "Jacobian factor above 1 means the gradient grows towards the bottom. Means and products over "
             "sub-layers 2..L-1 (past Keel's special first pair and the embedding-scale input); the product of "
             "Jacobian factors is |g_2|/|g_L|. results.json also has each factor's geometric-mean ratio to the "
             "prediction (`*_over_predicted`). 'default' init: N(0, 0.02^2); "
             f"'matched': std 1/sqrt(d) = {1 / math.sqrt(cfg.model.d_model):.3f}. d={cfg.model.d_model}, one batch of "
             f"{cfg.run.batch_size}x{cfg.run.seq_len} tokens from the report half; seeds at init {cfg.seeds}, "
             f"trained {cfg.trained_seeds} ({cfg.run.steps} steps at LR {cfg.optim.lr:g}).")
    write_outputs(out, "gradflow", cfg, command, {"points": results, "summary": table},
                  markdown_table(header, rows), plots, notes)
    return table


def _refuse_points_without_backward_factors(out: Path, points: dict) -> None:
    """Points measured before `measure` had the backward factors would be reused by the sweep and leave
    the new columns empty; refuse them rather than report a mix."""
    for key in points:
        path = store.path_of(out / "points", key)
        if path is not None and "shortcut" not in store.read(path)["at_init"]:
            raise ConfigError(f"{out}: {path.name} was measured before gradflow had its backward factors; "
                              "use another --out or delete that directory's points/ to measure again")


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
        if quantity in ("factor", "shortcut"):
            ax.axhline(1 / math.sqrt(2), color="grey", ls=":", lw=0.8, label="1/sqrt(2) (Eq. 15)")
        ax.set_yscale("log")
        ax.set_title(f"{d} sub-layers", fontsize=9)
        ax.set_xlabel("sub-layer index (0 = bottom)")
    axes[0][0].set_ylabel({"grad_stream": "|dL/dx| entering the sub-layer",
                           "factor": "rms(alpha x) / rms(alpha x + F)",
                           "shortcut": "|g J_shortcut| / |g|, F fixed",
                           "jacobian": "|dL/dx_i| / |dL/dx_(i+1)|"}[quantity])
    axes[0][-1].legend(fontsize=8)
    state = "at init" if stage == "at_init" else f"after {cfg.run.steps} steps"
    fig.suptitle(f"{quantity}, {init} init, {state} (one line per seed)", fontsize=10)
    return save(fig, out, f"gradflow-{quantity.replace('_', '-')}-{init}-{stage.replace('_', '-')}.png")
