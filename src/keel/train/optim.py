"""AdamW with decay on weight matrices only, and the learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

from keel.config import OptimConfig, optimizer_implementation
from keel.errors import optional


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
    bf16 = any(p.dtype == torch.bfloat16 for g in groups for p in g["params"])  # run.weights=bfloat16
    if cfg.state == "8bit" or bf16:
        return torchao_adamw(groups, cfg, bf16)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    impl = optimizer_implementation(cfg, device)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             foreach=impl == "foreach", fused=impl == "fused")


def torchao_adamw(groups: list[dict], cfg: OptimConfig, bf16_weights: bool = False) -> torch.optim.Optimizer:
    """torchao's AdamW (the `depth` extra): 8-bit moments with optim.state=8bit, stochastic rounding for bf16 weights,
    its state dict in plain tensors (docs/internals.md#keeltrainoptimtorchao_adamw)."""
    import logging  # noqa: PLC0415

    # torchao reports the CUDA-only extensions it cannot load, and registers an enum newer torch warns about
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    field = "optim.state=8bit" if cfg.state == "8bit" else "run.weights=bfloat16"
    instead = " (or set optim.state=float32)" if cfg.state == "8bit" else " (or set run.weights=float32)"
    optional("torchao.optim.subclass_8bit", "depth", field, instead=instead)
    from torchao.optim import AdamW8bit, _AdamW  # noqa: PLC0415
    from torchao.optim.subclass_8bit import OptimState8bit  # noqa: PLC0415

    class Float32MomentsAdamW(_AdamW):  # torchao's AdamW with its moments in float32 whatever the weights' dtype
        def _new_buffer(self, p, signed):
            return torch.zeros_like(p, dtype=torch.float32)

    base = AdamW8bit if cfg.state == "8bit" else Float32MomentsAdamW

    class PortableAdamW(base):
        def state_dict(self):
            out = super().state_dict()
            out["state"] = {k: _plain_8bit(st, OptimState8bit) for k, st in out["state"].items()}
            out["param_groups"] = [g | {"lr": float(g["lr"])} for g in out["param_groups"]]  # a number, as torch's
            return out

        def load_state_dict(self, state_dict):
            params = [p for g in self.param_groups for p in g["params"]]
            state = {k: _quantised_8bit(st, params[int(k)], OptimState8bit) for k, st in state_dict["state"].items()}
            super().load_state_dict(dict(state_dict, state=state))
            # torch's loader casts floating state to its parameter's dtype: float32 moments of bf16 weights
            # come back in the dtype they were saved in
            for k, entry in state.items():
                mine = self.state[params[int(k)]]
                for name, value in entry.items():
                    if type(value) is torch.Tensor and value.is_floating_point() and mine[name].dtype != value.dtype:
                        mine[name] = value.to(mine[name].device)
            for group in self.param_groups:  # its compiled step reads the rate from a tensor
                group["lr"] = torch.tensor(float(group["lr"]))

    return PortableAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                         bf16_stochastic_round=bf16_weights)


_QUANT_PARTS = ("scale", "qmap", "signed")


def _plain_8bit(state: dict, cls) -> dict:
    out = {}
    for name, value in state.items():
        if isinstance(value, cls):  # on the CPU one tensor at a time: a GPU holds no second copy
            out |= {name: value.codes.cpu(), f"{name}.scale": value.scale.cpu(), f"{name}.qmap": value.qmap.cpu(),
                    f"{name}.signed": torch.tensor(float(value.signed))}
        else:
            out[name] = value
    return out


def _quantised_8bit(state: dict, param: torch.Tensor, cls) -> dict:
    out = {k: v for k, v in state.items() if k.rpartition(".")[2] not in _QUANT_PARTS or "." not in k}
    for name in [k for k in out if f"{k}.scale" in state]:
        out[name] = cls(state[name].to(param.device), state[f"{name}.scale"].to(param.device),
                        state[f"{name}.qmap"].to(param.device), bool(state[f"{name}.signed"]), dtype=param.dtype)
    return out


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
