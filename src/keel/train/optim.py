"""AdamW with decay on weight matrices only, and the learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

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
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)


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
