"""The training step under pipeline parallelism: `TrainStep` with one pipeline schedule step as its forward/backward
(docs/internals.md#keeltrainpipeline_step)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from keel.scale.pipeline import PipelineModel
from keel.train.guard import DivergenceGuard
from keel.train.step import Batch, StepResult, TrainStep


def _keep_hyperparameters(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Optimizer load pre-hook. DCP stores the optimiser's param_groups (names and hyper-parameters) once, from
    one rank; a stage whose parameter names are not in that copy gets groups without hyper-parameters. They are
    the run's configuration either way: take them from the optimiser as built."""
    for saved, group in zip(state_dict["param_groups"], optimizer.param_groups):
        for key, value in group.items():
            if key != "params":
                saved.setdefault(key, value)
    return state_dict


class PipelineStep(TrainStep):
    """`TrainStep` for a `PipelineModel`: the `grad_accum` batches are joined and run as one schedule step of
    `run.pp_microbatches x grad_accum` micro-batches (equal-sized, so the mean loss and gradients are those
    TrainStep would accumulate). Same call: `step(next_batch, lr) -> StepResult`."""

    def __init__(self, model: PipelineModel, optimizer: torch.optim.Optimizer, *, grad_accum: int = 1,
                 grad_clip: float = 1.0, autocast=contextlib.nullcontext, guard: DivergenceGuard | None = None,
                 world=None, after_backward: Callable[[torch.nn.Module], None] | None = None):
        super().__init__(model, optimizer, grad_accum=grad_accum, grad_clip=grad_clip, autocast=autocast,
                         guard=guard, world=world, after_backward=after_backward, grad_norm=PipelineModel.grad_norm)
        optimizer.register_load_state_dict_pre_hook(_keep_hyperparameters)

    def forward_backward(self, next_batch: Callable[[], Batch]) -> torch.Tensor:
        batches = [next_batch() for _ in range(self.grad_accum)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])  # (grad_accum * B, T)
        with self.autocast():
            return self.model.forward_backward(x, y)


__all__ = ["PipelineStep", "StepResult"]
