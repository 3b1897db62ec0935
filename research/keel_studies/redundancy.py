"""redundancy (paper Appendix A): how much the held-out loss rises when one sub-layer is taken out.

For a trained model, each sub-layer i in turn is taken out in two ways (keel.experiments.surgery):
  - "sublayer": the whole sub-layer is the identity, x' = x (its norm_out goes too);
  - "branch": only its branch F is zero, x' = norm_out(alpha * x) (norms and alpha kept).
For Keel the two differ by LN_out (for the last sub-layer that is the whole effect); for Pre-LN, which has
no norm_out and alpha = 1, they are the same. Reported: delta loss = loss without it - loss of the whole
model, in nats on the report half of the validation split (exp(delta) is the PPL ratio, so models of
different base loss compare), for sub-layers 0 and 1 separately and as means over the lower half
(2..L/2-1) and the upper half (L/2..L-1); mean ± SD over seeds. `hf_model` instead points at a Hugging Face
causal LM directory (Llama-style `model.model.layers`), whose decoder layers are dropped one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from keel.config import OptimConfig, RunConfig
from keel.data import eval_batches
from keel.data.corpus import build_corpus
from keel.experiments.common import (
    ExperimentConfig,
    experiment_run,
    fixed_batches,
    loss_on,
    markdown_table,
    pm,
    point_config,
    pyplot,
    save,
    splits,
    tiny_quick,
    train_curve,
    write_outputs,
)
from keel.experiments.surgery import branches_off, removed
from keel.experiments.sweep import Sweep
from keel.model import lm_loss
from keel.runtime import autocast_for
from keel.scale.fused_junction import apply_fused_junction

MODES = ("sublayer", "branch")


@dataclass
class RedundancyConfig(ExperimentConfig):
    """Both schemes train at `optim.lr` (one LR, not tuned here); `run.eval_batches` report-half batches."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3, warmup_steps=40))
    run: RunConfig = field(default_factory=lambda: experiment_run(eval_batches=8, compile=False))
    schemes: list[str] = field(default_factory=lambda: ["pre_ln", "keel"])
    depth: int = 32  # sub-layers
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    hf_model: str = ""  # a Hugging Face causal LM directory: measure it instead of training

    PER_POINT: ClassVar[dict[str, str]] = {"model.scheme": "schemes", "model.n_blocks": "depth",
                                           "model.max_seq_len": "run.seq_len"}

    @classmethod
    def quick(cls) -> RedundancyConfig:
        return tiny_quick(cls, 8, depth=4, seeds=[0, 1])


def keel_point(cfg: RedundancyConfig, scheme: str, seed: int) -> dict:
    model_cfg = cfg.point_model(scheme, cfg.depth)
    config = point_config(cfg, model_cfg, seed)
    curve, model = train_curve(config, eval_batches=0)
    apply_fused_junction(model, "off")  # removing one sub-layer must not leave its fused junction behind
    batches = fixed_batches(splits(cfg.data)["report"], cfg.run.seq_len, cfg.run.batch_size, cfg.run.eval_batches)
    auto = autocast_for(next(model.parameters()).device, cfg.run.dtype)
    base = loss_on(model, batches, auto)
    deltas = {m: [] for m in MODES}
    for i in range(cfg.depth):
        with removed(model, i):
            deltas["sublayer"].append(loss_on(model, batches, auto) - base)
        with branches_off(model, [i]):
            deltas["branch"].append(loss_on(model, batches, auto) - base)
    return {"scheme": scheme, "seed": seed, "base_loss": base, "delta_loss": deltas,
            "train_loss": curve.losses[-1], "diverged": curve.stopped_at is not None}


@torch.no_grad()
def hf_point(cfg: RedundancyConfig) -> dict:
    """Remove each decoder layer of a Hugging Face causal LM in turn, on the configured corpus."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(cfg.hf_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(cfg.hf_model)
    text = "\n".join(islice(build_corpus(cfg.data).documents("val"), 50))
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64).numpy()
    layers = model.model.layers

    def loss() -> float:
        total, n = 0.0, 0
        for x, y in eval_batches(ids, cfg.run.seq_len, cfg.run.batch_size, cfg.run.eval_batches):
            logits = model(input_ids=x, use_cache=False).logits
            total += lm_loss(logits, y, reduction="sum").item()
            n += y.numel()
        return total / n
    base = loss()
    deltas = []
    for i in range(len(layers)):
        model.model.layers = nn.ModuleList([m for j, m in enumerate(layers) if j != i])
        deltas.append(loss() - base)
    model.model.layers = layers
    return {"scheme": f"hf:{Path(cfg.hf_model).name}", "seed": 0, "base_loss": base,
            "delta_loss": {"sublayer": deltas}}


def summarise(deltas: list[float]) -> dict:
    n = len(deltas)
    half = n // 2
    lower, upper = deltas[2:half], deltas[half:]
    return {"0": deltas[0], "1": deltas[1] if n > 1 else None,
            "lower": sum(lower) / len(lower) if lower else None, "upper": sum(upper) / len(upper) if upper else None,
            "max_from_2": max(deltas[2:]) if n > 2 else None}


def run(cfg: RedundancyConfig, out: Path, command: str) -> dict:
    if cfg.hf_model:
        points = {"hf": lambda: hf_point(cfg)}
        groups = {"hf": ["hf"]}
    else:
        points = {f"{s}-seed{seed}": (lambda s=s, seed=seed: keel_point(cfg, s, seed))
                  for s in cfg.schemes for seed in cfg.seeds}
        groups = {s: [f"{s}-seed{seed}" for seed in cfg.seeds] for s in cfg.schemes}
    results = Sweep(out, cfg).run(points, "redundancy")
    rows, summary = [], {}
    for label, keys in groups.items():
        runs = [results[k] for k in keys]
        for mode in MODES:
            if mode not in runs[0]["delta_loss"]:
                continue
            stats = [summarise(r["delta_loss"][mode]) for r in runs]
            summary[f"{label}-{mode}"] = stats
            rows.append([runs[0]["scheme"], mode, pm([r["base_loss"] for r in runs]),
                         *(pm([st[k] for st in stats]) for k in ("0", "1", "lower", "upper"))])
    table = markdown_table(["model", "removed", "base loss", "delta: sub-layer 0", "delta: sub-layer 1",
                            "mean delta, lower half (2..L/2-1)", "mean delta, upper half"], rows)
    plots = [_plot(cfg, results, groups, out)]
    notes = "" if cfg.hf_model else (
        f"Models: {cfg.depth} sub-layers, d={cfg.model.d_model}, trained {cfg.run.steps} steps x "
        f"{cfg.run.batch_size}x{cfg.run.seq_len} tokens at LR {cfg.optim.lr:g}, seeds {cfg.seeds}. Delta loss in "
        f"nats on {cfg.run.eval_batches} batches of the report half; mean ± SD over seeds.")
    write_outputs(out, "redundancy", cfg, command, {"points": results, "summary": summary}, table, plots, notes)
    return summary


def _plot(cfg, results, groups, out) -> str:
    import numpy as np

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, mode in zip(axes, MODES):
        for i, (label, keys) in enumerate(groups.items()):
            runs = [results[k]["delta_loss"].get(mode) for k in keys]
            if not all(runs):
                continue
            v = np.array(runs)
            x = np.arange(v.shape[1])
            ax.plot(x, v.mean(0), marker=".", color=f"C{i}", label=label)
            ax.fill_between(x, v.min(0), v.max(0), color=f"C{i}", alpha=0.2)
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_title(f"removing the whole {mode}" if mode == "sublayer" else "switching off the branch only")
        ax.set_xlabel("sub-layer index (0 = bottom)")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("delta loss, nats (band: seed min..max)")
    return save(fig, out, "redundancy.png")
