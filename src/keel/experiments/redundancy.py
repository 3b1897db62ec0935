"""redundancy (paper Appendix A): how much validation perplexity rises when one layer is removed.

For a trained model, each sub-layer (or block) in turn is replaced by the identity, x' = x, and the
validation perplexity is measured; delta-PPL = PPL without it - PPL of the whole model. Keel and Pre-LN
are trained here on the same data and budget; `hf_model` instead points at any Hugging Face causal LM
directory on disk (Llama-style `model.model.layers`), whose decoder layers are removed one at a time.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import torch
from torch import nn

from keel.data import DataConfig, eval_batches
from keel.data.corpus import build_corpus
from keel.experiments.common import (
    Engine,
    Shape,
    Sweep,
    evaluate_model,
    markdown_table,
    point_config,
    pyplot,
    train_curve,
    write_outputs,
)
from keel.train.config import OptimConfig


@dataclass
class RedundancyConfig(Engine):
    schemes: list[str] = field(default_factory=lambda: ["pre_ln", "keel"])
    depth: int = 32  # sub-layers
    unit: str = "sublayer"  # sublayer | block
    steps: int = 400
    lr: float = 3e-3
    warmup_steps: int = 30
    seed: int = 0
    eval_batches: int = 16
    hf_model: str = ""  # a Hugging Face causal LM directory: measure it instead of training
    shape: Shape = field(default_factory=Shape)
    data: DataConfig = field(default_factory=DataConfig)

    @classmethod
    def quick(cls) -> RedundancyConfig:
        return cls(depth=4, steps=8, warmup_steps=2, eval_batches=1,
                   shape=Shape(d_model=32, n_heads=2, n_kv_heads=1, seq_len=32, batch_size=4))


class Identity(nn.Module):
    """Stands in for a removed sub-layer: x' = x."""

    def forward(self, x, branch, *args):
        return x


@contextmanager
def removed(model, index: int, unit: str):
    """The keel model with sub-layer `index` (or block `index`) replaced by the identity, restored after."""
    kinds = ["attn", "ffn"] if unit == "block" else ["attn" if index % 2 == 0 else "ffn"]
    block = model.blocks[index if unit == "block" else index // 2]
    saved = {k: getattr(block, f"{k}_res") for k in kinds}
    for k in kinds:
        setattr(block, f"{k}_res", Identity())
    try:
        yield
    finally:
        for k, module in saved.items():
            setattr(block, f"{k}_res", module)


def ppl(loss: float) -> float:
    return math.exp(min(loss, 700.0))


def keel_point(cfg: RedundancyConfig, scheme: str) -> dict:
    model_cfg = cfg.shape.model(scheme, cfg.depth)
    optim = OptimConfig(lr=cfg.lr, warmup_steps=cfg.warmup_steps)
    config = point_config(model_cfg, optim, cfg.steps, cfg.shape, cfg.data, cfg.seed, cfg)
    curve, model = train_curve(config, eval_batches=0)

    def loss() -> float:
        return evaluate_model(model, cfg, cfg.eval_batches)
    base = loss()
    n_units = model_cfg.n_blocks if cfg.unit == "block" else model_cfg.n_sublayers
    deltas = []
    for i in range(n_units):
        with removed(model, i, cfg.unit):
            deltas.append(ppl(loss()) - ppl(base))
    return {"scheme": scheme, "base_loss": base, "base_ppl": ppl(base), "delta_ppl": deltas,
            "train_loss": curve.losses[-1]}


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
        for x, y in eval_batches(ids, cfg.shape.seq_len, cfg.shape.batch_size, cfg.eval_batches):
            logits = model(input_ids=x, use_cache=False).logits
            total += nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum").item()
            n += y.numel()
        return total / n
    base = loss()
    deltas = []
    for i in range(len(layers)):
        model.model.layers = nn.ModuleList([m for j, m in enumerate(layers) if j != i])
        deltas.append(ppl(loss()) - ppl(base))
    model.model.layers = layers
    return {"scheme": f"hf:{Path(cfg.hf_model).name}", "base_loss": base, "base_ppl": ppl(base), "delta_ppl": deltas}


def run(cfg: RedundancyConfig, out: Path, command: str) -> dict:
    if cfg.hf_model:
        points = {"hf": lambda: hf_point(cfg)}
    else:
        points = {s: (lambda s=s: keel_point(cfg, s)) for s in cfg.schemes}
    results = Sweep(out, cfg).run(points, "redundancy")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    rows = []
    for r in results.values():
        d = r["delta_ppl"]
        ax.plot(range(len(d)), [max(v, 1e-3) for v in d], marker=".", label=r["scheme"])
        half = len(d) // 2
        rows.append([r["scheme"], r["base_ppl"], d[0], max(d), sum(d[1:half]) / max(1, half - 1),
                     sum(d[half:]) / max(1, len(d) - half)])
    unit = "block" if cfg.unit == "block" or cfg.hf_model else "sub-layer"
    ax.set_yscale("log")
    ax.set_xlabel(f"removed {unit} index (0 = bottom)")
    ax.set_ylabel("delta validation PPL (clipped at 1e-3)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "redundancy.png", dpi=110)
    plt.close(fig)
    table = markdown_table(["model", "PPL", f"delta-PPL removing {unit} 0", "max delta-PPL",
                            "mean delta-PPL, lower half (excl. 0)", "mean delta-PPL, upper half"], rows)
    notes = "" if cfg.hf_model else (
        f"Models: {cfg.depth} sub-layers, d={cfg.shape.d_model}, trained {cfg.steps} steps x "
        f"{cfg.shape.batch_size * cfg.shape.seq_len} tokens at LR {cfg.lr:g}.")
    write_outputs(out, "redundancy", cfg, command, {"points": results}, table, ["redundancy.png"], notes)
    return results
