"""AdamW with decay on weight matrices only, and the learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

from keel.errors import ConfigError
from keel.train.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW; norms' gains (1-D) and embedding tables get no weight decay unless configured."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a tied weight once
        if not p.requires_grad:
            continue
        plain_matrix = p.dim() >= 2 and id(p) not in embeddings
        (decay if plain_matrix or cfg.decay_norms_and_embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.state == "8bit":
        return adamw_8bit(groups, cfg)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    impl = optimizer_implementation(cfg, device)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             foreach=impl == "foreach", fused=impl == "fused")


def optimizer_implementation(cfg: OptimConfig, device: torch.device) -> str:
    """torch's AdamW kernel: "fused" (one kernel over all parameters, no temporaries: 16 bytes a parameter at
    the step) or "foreach" (a few multi-tensor ops, with one float32 temporary per parameter: 20 bytes a
    parameter, keel.scale.memory). optim.implementation=auto takes the fused one on CUDA and keeps foreach on a
    CPU, where every committed result was trained with it (the two agree to float32 rounding, not bit for bit)."""
    if cfg.implementation == "auto":
        return "fused" if device.type == "cuda" else "foreach"
    return cfg.implementation


def adamw_8bit(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    """torchao's AdamW8bit: both moments block-wise quantised to 8 bits (2 bytes a parameter instead of 8, for
    tensors of at least 4,096 elements; smaller ones keep float32 moments), the update itself in float32; it
    steps one parameter at a time (no foreach temporary). The `depth` extra installs torchao.

    Its state dict holds the moments dequantised to float32 (on the CPU, one tensor at a time), so a checkpoint
    is an ordinary AdamW state, loadable weights-only with no tensor class of torchao's; loading quantises each
    again, which gives back the same codes and scales (the largest element of a block is the scale, code 1.0).
    The checkpoint holds 8 bytes a parameter of moments where the GPU held 2."""
    import logging  # noqa: PLC0415

    # torchao reports the CUDA-only extensions it cannot load, and registers an enum newer torch warns about
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from torchao.optim import AdamW8bit  # noqa: PLC0415
        from torchao.optim.subclass_8bit import OptimState8bit  # noqa: PLC0415
    except ImportError:
        raise ConfigError("optim.state=8bit needs the optional package torchao: pip install 'keel-lm[depth]' "
                          "(or set optim.state=float32)") from None

    class PortableAdamW8bit(AdamW8bit):
        def state_dict(self):
            out = super().state_dict()
            out["state"] = {k: {n: v.dequantize().cpu() if isinstance(v, OptimState8bit) else v for n, v in st.items()}
                            for k, st in out["state"].items()}
            out["param_groups"] = [g | {"lr": float(g["lr"])} for g in out["param_groups"]]
            return out

        def load_state_dict(self, state_dict):
            params = [p for g in self.param_groups for p in g["params"]]
            state = {}
            for k, st in state_dict["state"].items():  # quantised one tensor at a time, on its parameter's device
                p = params[int(k)]
                state[k] = {n: self._requantize(p, v, n == "exp_avg") if n in ("exp_avg", "exp_avg_sq") else v
                            for n, v in st.items()}
            super().load_state_dict(dict(state_dict, state=state))
            for group in self.param_groups:  # its compiled step reads the rate from a tensor
                group["lr"] = torch.tensor(float(group["lr"]))

        def _requantize(self, p, value, signed):
            if p.numel() < 4096 or p.numel() % self.block_size:  # AdamW8bit keeps these in float32
                return value
            q = self._subclass_zeros(p, signed, self.block_size)
            q.copy_(value.to(p.device, torch.float32))
            return q

    return PortableAdamW8bit(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for optimiser step `step` (0-based): linear warm-up from 0, then the schedule."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        decay_start = total_steps - int(cfg.decay_fraction * total_steps)
        if step < decay_start:
            return cfg.lr
        frac = (step - decay_start) / max(1, total_steps - 1 - decay_start)
        return cfg.lr + (cfg.min_lr - cfg.lr) * min(frac, 1.0)
    frac = (step - cfg.warmup_steps) / max(1, total_steps - 1 - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(frac, 1.0)))
