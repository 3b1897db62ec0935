"""The one training step (`TrainStep`: train, experiments and bench all take it), and the one way a model is put on
its device for training (docs/internals.md#keeltrainstep)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from keel.model import ModelConfig, TransformerLM
from keel.runtime import autocast_for, resolve_device, use_bf16
from keel.scale import distributed
from keel.scale.parallel import parallelize
from keel.train.guard import DivergenceGuard

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class StepResult:
    loss: float  # mean over micro-batches (and ranks)
    grad_norm: float  # before clipping
    lr: float
    diverged: str | None = None  # the guard's reason; the optimiser step was then not taken


def build_model(config: ModelConfig, run, device: torch.device, fsdp: bool = False,
                model: TransformerLM | None = None, compile_backend: str = "inductor") -> nn.Module:
    """The model on `device`, with `run`'s fused junction, activation checkpointing, compile, pipeline stages
    (run.pp > 1, under torchrun: a keel.scale.pipeline.PipelineModel) and FSDP2 (`fsdp`, or a pipeline's dp
    replicas) applied from outside by keel.scale.parallel.parallelize, in its one order. `run` is a RunConfig.
    `compile_backend` is for tests and benchmarks that time Dynamo without code generation."""
    # the pipeline's plan first: its errors come before any allocation
    pipeline = None
    if getattr(run, "pp", 1) > 1:  # torch.distributed.pipelining takes seconds to import: only pipelines pay for it
        from keel.scale.pipeline import plan_pipeline

        pipeline = plan_pipeline(config, run, device)
    model = (model if model is not None else TransformerLM(config)).to(device)
    if getattr(run, "weights", "float32") == "bfloat16":
        hold_bf16_weights(model, run, device, fsdp)
    # under FSDP2, bf16 comes from its mixed-precision policy (bf16 weights) instead of autocast; a pipeline's
    # stages compute under autocast
    param_dtype = torch.bfloat16 if fsdp and pipeline is None and use_bf16(device, run.dtype) else None
    return parallelize(model, fused_junction=run.fused_junction, ac_every=run.ac_every, compile=run.compile,
                       fsdp=fsdp, pipeline=pipeline, device_type=device.type, param_dtype=param_dtype,
                       fsdp_group=getattr(run, "fsdp_group", 1), compile_backend=compile_backend)


def hold_bf16_weights(model: nn.Module, run, device: torch.device, fsdp: bool = False) -> None:
    """run.weights=bfloat16: every parameter becomes bf16 in place, the residual stream still summed in float32
    (docs/internals.md#keeltrainstephold_bf16_weights)."""
    from keel.errors import ConfigError  # noqa: PLC0415

    if fsdp:
        raise ConfigError("run.weights=bfloat16: under torchrun FSDP2 already holds bf16 copies of float32 shards "
                          "(its mixed-precision policy); set run.weights=float32")
    if not use_bf16(device, run.dtype):
        raise ConfigError(f"run.weights=bfloat16 computes in bf16, and run.dtype={run.dtype} on {device.type} "
                          "computes in float32: set run.dtype=bfloat16")
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)


def total_grad_norm(model: nn.Module) -> torch.Tensor:
    """The 2-norm of `model`'s gradients (under FSDP2 over all shards: the same on every rank)."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


GC_EVERY = 50  # steps between collections of the young generations (TrainStep.__call__)


class TrainStep:
    """Forward and backward over `grad_accum` micro-batches, clip, ask the guard, then step the optimiser; a rejected
    step leaves weights and optimiser untouched (hooks: docs/internals.md#keeltrainsteptrainstep)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, grad_accum: int = 1,
                 grad_clip: float = 1.0, autocast=contextlib.nullcontext, guard: DivergenceGuard | None = None,
                 world: distributed.World | None = None, after_backward: Callable[[nn.Module], None] | None = None,
                 grad_norm: Callable[[nn.Module], torch.Tensor] = total_grad_norm):
        self.model, self.optimizer, self.grad_accum, self.autocast = model, optimizer, grad_accum, autocast
        self.clip = grad_clip if grad_clip > 0 else float("inf")
        self.guard, self.world, self.after_backward, self.grad_norm = guard, world, after_backward, grad_norm
        self.steps = 0

    def forward_backward(self, next_batch: Callable[[], Batch]) -> torch.Tensor:
        """Accumulate gradients over the micro-batches; the mean loss, on the device (no sync)."""
        total = None
        for _ in range(self.grad_accum):
            x, y = next_batch()
            with self.autocast():
                _, loss = self.model(x, y)
            (loss / self.grad_accum).backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total / self.grad_accum

    def __call__(self, next_batch: Callable[[], Batch], lr: float) -> StepResult:
        # Python's cyclic garbage collector off inside the step: a full collection walks every live object,
        # and a deep model is tens of thousands of them (modules, parameters, hooks), so its cost grew with depth
        # at every step that happened to trigger one. Cycles made during steps are collected between them, a
        # young generation every `GC_EVERY` steps (as torchtitan does).
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._step(next_batch, lr)
        finally:
            self.steps += 1
            if enabled:
                gc.enable()
                if self.steps % GC_EVERY == 0:
                    gc.collect(1)

    def _step(self, next_batch: Callable[[], Batch], lr: float) -> StepResult:
        for group in self.optimizer.param_groups:
            if torch.is_tensor(group["lr"]):  # torchao's optimisers hold it as a tensor (their compiled step reads it)
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        loss = self.forward_backward(next_batch)
        if self.after_backward is not None:
            self.after_backward(self.model)
        grad_norm = self.grad_norm(self.model)
        # clip as clip_grad_norm_ does, each rank its own gradients (under FSDP2 its local shards), in one
        # foreach multiply per device and dtype rather than one kernel per parameter (thousands at depth)
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for p in self.model.parameters() if p.grad is not None]
        if grads:  # what clip_grads_with_norm_ does after its norm, on the local tensors (it takes parameters)
            torch._foreach_mul_(grads, (self.clip / (grad_norm + 1e-6)).clamp(max=1.0))
        if self.world is not None:  # the mean over ranks is the global batch's loss, the same on every rank
            loss = distributed.mean(loss, self.world)
        result = StepResult(loss.item(), grad_norm.item(), lr)
        result.diverged = self.guard.check(result.loss, result.grad_norm) if self.guard is not None else None
        if result.diverged is None:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return result


def on_device(batch: Batch, device: torch.device) -> Batch:
    x, y = batch
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


__all__ = ["StepResult", "TrainStep", "build_model", "hold_bf16_weights", "on_device", "total_grad_norm",
           "autocast_for", "resolve_device"]
