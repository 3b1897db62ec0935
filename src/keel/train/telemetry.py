"""In-training telemetry: per sub-layer, the gradient norm, the stream's RMS and rms(F) / rms(alpha * x), every
run.telemetry_every steps, into telemetry.jsonl (docs/internals.md#keeltraintelemetry)."""

from __future__ import annotations

import math

import torch
from torch import nn

from keel.scale import distributed


def _rms(t) -> float:
    if isinstance(t, tuple):  # (stream, next branch input) from a fused Keel junction: the stream
        t = t[0]
    return t.detach().float().pow(2).mean().sqrt().item()


class Telemetry:
    def __init__(self, model: nn.Module, world: distributed.World, activations: bool = True):
        self.model, self.world, self.activations = model, world, activations
        self.subs = model.sublayers()
        self.hooks: list = []
        self.record: dict = {}

    def start(self) -> None:
        """Hook this step's forward pass (called before the step, on telemetry steps only)."""
        self.record = {"stream_rms": [0.0] * len(self.subs), "update_ratio": [0.0] * len(self.subs)}
        if not self.activations:
            return
        shortcut = {}
        for s in self.subs:
            block = self.model.blocks[s.block]
            residual, branch = self.model.get_submodule(s.path), getattr(block, s.kind)

            def before(module, args, i=s.index, alpha=residual.alpha):
                shortcut[i] = abs(alpha) * _rms(args[0])

            def branch_out(module, args, out, i=s.index):
                self.record["update_ratio"][i] = _rms(out) / max(shortcut.get(i, 0.0), 1e-30)

            def after(module, args, out, i=s.index):
                self.record["stream_rms"][i] = _rms(out)
            self.hooks += [residual.register_forward_pre_hook(before), branch.register_forward_hook(branch_out),
                           residual.register_forward_hook(after)]

    def after_backward(self, model: nn.Module) -> None:
        """Per-sub-layer gradient norms, read before clipping (TrainStep's `after_backward`)."""
        squares = []
        for s in self.subs:
            block = self.model.blocks[s.block]
            params = [*getattr(block, s.kind).parameters(), *self.model.get_submodule(s.path).parameters()]
            total = torch.zeros((), dtype=torch.float64)
            for p in params:
                if p.grad is not None:
                    g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # FSDP2: this rank's shard
                    total += g.detach().double().pow(2).sum().cpu()
            squares.append(total)
        stacked = torch.stack(squares)
        if self.world.distributed:
            stacked = distributed.mean(stacked.to(next(model.parameters()).device), self.world).cpu() * self.world.size
        self.record["grad_norm"] = [math.sqrt(v) for v in stacked.tolist()]

    def finish(self, step: int) -> dict:
        """Remove the hooks; the step's record."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        record, self.record = {"step": step, **self.record}, {}
        if not self.activations:
            record.pop("stream_rms"), record.pop("update_ratio")
        return record
