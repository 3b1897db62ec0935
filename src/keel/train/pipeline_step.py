"""The training step under pipeline parallelism (keel.scale.pipeline), and its step-time benchmark.

`PipelineStep` is `TrainStep` with the forward/backward replaced by one pipeline schedule step: clipping, the
divergence guard and the optimiser step are TrainStep's own, so they mean the same thing in both. Two things
make TrainStep's clipping and guard right across stages:
  - every rank gets the batch's loss (the last stage broadcasts it), so the guard decides alike everywhere;
  - the gradient norm is the norm over every stage's parameters (see `_AllStages`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from keel.model import ModelConfig, TransformerLM
from keel.scale.pipeline import PipelineModel, build_pipeline, split_blocks
from keel.train.config import OptimConfig, RunConfig
from keel.train.guard import DivergenceGuard
from keel.train.optim import build_optimizer
from keel.train.step import Batch, StepResult, TrainStep


class _AllStages:
    """What TrainStep clips: this rank's parameters, plus one stand-in tensor whose gradient is the rest of the
    global norm, sqrt(total^2 - mine^2), with total^2 summed over the stages. `clip_grad_norm_` over them returns
    the norm over all stages' parameters, the same on every rank, and clips by it, as in one process."""

    def __init__(self, model: PipelineModel):
        self.model = model
        self.rest = torch.zeros(1, device=next(model.parameters()).device)

    def parameters(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), self.rest]

    def gather_norm(self) -> None:
        grads = [p.grad.detach().float() for p in self.model.parameters() if p.grad is not None]
        mine = torch.stack([g.pow(2).sum() for g in grads]).sum() if grads else self.rest.new_zeros(())
        total = mine.clone()
        dist.all_reduce(total, group=self.model.group)
        self.rest.grad = (total - mine).clamp_min(0).sqrt().reshape(1)  # non-finite stays non-finite


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
    TrainStep would accumulate). Same call: `step(next_batch, lr) -> StepResult`. `after_backward` sees the
    PipelineModel."""

    def __init__(self, model: PipelineModel, optimizer: torch.optim.Optimizer, *, grad_accum: int = 1,
                 grad_clip: float = 1.0, autocast=contextlib.nullcontext, guard: DivergenceGuard | None = None,
                 world=None, after_backward: Callable[[torch.nn.Module], None] | None = None):
        self.pipeline = model
        super().__init__(_AllStages(model), optimizer, grad_accum=grad_accum, grad_clip=grad_clip, autocast=autocast,
                         guard=guard, world=world, after_backward=after_backward)
        optimizer.register_load_state_dict_pre_hook(_keep_hyperparameters)

    @property
    def after_backward(self) -> Callable[[torch.nn.Module], None] | None:
        return self._after_backward

    @after_backward.setter
    def after_backward(self, hook: Callable[[torch.nn.Module], None] | None) -> None:
        # TrainStep passes its `model` (here the clipping view): hand the hook the PipelineModel instead
        self._after_backward = None if hook is None else (lambda _: hook(self.pipeline))

    def forward_backward(self, next_batch: Callable[[], Batch]) -> torch.Tensor:
        batches = [next_batch() for _ in range(self.grad_accum)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])  # (grad_accum * B, T)
        with self.autocast():
            loss = self.pipeline.forward_backward(x, y)
        self.model.gather_norm()
        return loss


def bench_pipeline(config: ModelConfig, batch_size: int, seq_len: int, schedule: str = "1f1b", microbatches: int = 4,
                   steps: int = 5, warmup: int = 2) -> dict | None:
    """Seconds per training step (forward, backward, clip, AdamW; the median of `steps` after `warmup`) of
    `config` pipelined over every rank of the running process group, and of the same model in one process (rank
    0, given as many threads as the pipeline has ranks, so both use the same cores), on the same batch. Call on
    every rank under torchrun; rank 0 returns the record, the others None."""
    pp = dist.get_world_size()
    run = RunConfig(batch_size=batch_size, seq_len=seq_len, pp=pp, pp_schedule=schedule, pp_microbatches=microbatches)
    optim = OptimConfig(lr=1e-4, warmup_steps=0)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch = (ids[:, :-1], ids[:, 1:])

    def timed(step) -> float:
        times = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            step(lambda: batch, optim.lr)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    torch.manual_seed(0)
    model = build_pipeline(config, run, torch.device("cpu"))
    piped = timed(PipelineStep(model, build_optimizer(model, optim), world=None))
    dist.barrier()
    record = None
    if dist.get_rank() == 0:
        threads = torch.get_num_threads()
        torch.set_num_threads(threads * pp)
        try:
            torch.manual_seed(0)
            single = TransformerLM(config)
            one = timed(TrainStep(single, build_optimizer(single, optim)))
        finally:
            torch.set_num_threads(threads)
        tokens = batch_size * seq_len
        record = {"stages": pp, "schedule": schedule, "microbatches": microbatches, "batch_size": batch_size,
                  "seq_len": seq_len, "threads_per_stage": threads, "one_process_threads": threads * pp,
                  "split": [[r.start, r.stop] for r in split_blocks(config, len(model.spans))],
                  "one_process_s": one, "pipeline_s": piped, "pipeline_over_one": piped / one,
                  "one_process_tokens_per_s": tokens / one, "pipeline_tokens_per_s": tokens / piped}
    dist.barrier()
    return record


__all__ = ["PipelineStep", "StepResult", "bench_pipeline"]
