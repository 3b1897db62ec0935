"""Pipeline parallelism: the blocks split into contiguous stages, one (or two) per rank, run by PyTorch's own
schedules (`torch.distributed.pipelining`); docs/scale.md says what a user sees, docs/internals.md#keelscalepipeline
how it is built."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from keel.errors import ConfigError
from keel.model import ModelConfig, TransformerLM, lm_loss
from keel.model.counting import block_params, root_params
from keel.scale import PP_SCHEDULE_SPECS, check_pipeline

# the schedules this PyTorch has
SCHEDULES = {name: spec for name, spec in PP_SCHEDULE_SPECS.items() if hasattr(pipelining, spec[0])}


def check_config(model: ModelConfig, run) -> None:
    """Why `run` (a RunConfig) cannot be pipelined with `model`, as a ConfigError; nothing if it can."""
    if run.pp == 1:
        return
    if run.pp_schedule not in SCHEDULES:
        raise ConfigError(f"run.pp_schedule: {run.pp_schedule!r} is not in this PyTorch "
                          f"({torch.__version__}); allowed: {', '.join(SCHEDULES)}")
    check_pipeline(model, run)


def split_blocks(config: ModelConfig, n_stages: int) -> list[range]:
    """Contiguous block ranges, one per stage, balanced by cost: a block costs 1; the embedding (first stage)
    and the final norm + LM head (last stage) cost their parameter count over a block's."""
    n = config.n_blocks
    root = root_params(config)
    embed, head = root["embed"], root["head"] + root["final_norm"]
    per_block = sum(block_params(config)) / n
    lead, total = embed / per_block, (embed + head) / per_block + n
    bounds = [0]
    for s in range(1, n_stages):  # blocks before stage s: as close to s/n_stages of the total cost as allowed
        ideal = round(s * total / n_stages - lead)
        bounds.append(min(max(ideal, bounds[-1] + 1), n - (n_stages - s)))
    bounds.append(n)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def stage_placement(pp: int, schedule: str) -> dict[int, int]:
    """Stage -> pp rank: stage s on rank s % pp (one stage per rank, or interleaved), or ZBV's V (rank r holds
    stages r and 2 pp - 1 - r)."""
    _, per_rank, style = SCHEDULES[schedule]
    n = pp * per_rank
    return {s: s % pp if style == "loop" else min(s, n - 1 - s) for s in range(n)}


class Stage(nn.Module):
    """A contiguous slice of a `TransformerLM`: the embedding (first stage), `blocks[span]`, the final norm and
    LM head (last stage), run by the model's own pieces: token ids or the float32 residual stream in, the stream
    or the logits out."""

    def __init__(self, model: TransformerLM, span: range, first: bool, last: bool):
        super().__init__()
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in span})
        self.final_norm = model.final_norm if last else None
        self.lm_head = model.lm_head if last else None
        self._model = (model,)  # its methods, not its modules: a tuple is not registered (the rest are not ours)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self._model[0]
        if self.embed is not None:
            x = model.embed_tokens(x)  # (B, T, d)
        x = model.run_blocks(x, ((block, False, None) for block in self.blocks.values()))
        return x if self.lm_head is None else model.head(x)  # the stream (B, T, d) for the next stage, or logits


@dataclass
class PipelinePlan:
    """Which blocks each stage holds (`spans`), where each stage runs (`placement`: stage -> pp rank) and which
    are this rank's (`mine`), on the ("pp", "dp") `mesh`; keel.scale.parallel.parallelize builds with it."""

    spans: list[range]
    placement: dict[int, int]
    mine: list[int]
    mesh: DeviceMesh
    schedule_cls: type
    n_microbatches: int
    device: torch.device

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()

    def cut(self, model: TransformerLM) -> dict[int, Stage]:
        n = len(self.spans)
        return {s: Stage(model, self.spans[s], first=s == 0, last=s == n - 1) for s in self.mine}

    def assemble(self, model: TransformerLM, stages: dict[int, Stage]) -> PipelineModel:
        return PipelineModel(model, stages, self)


def plan_pipeline(config: ModelConfig, run, device: torch.device) -> PipelinePlan:
    """This rank's `PipelinePlan` for `run` (a RunConfig, or anything with its pp, pp_schedule, pp_microbatches,
    batch_size and grad_accum), in a process group of run.pp x dp ranks (dp >= 1 data-parallel replicas)."""
    check_config(config, run)
    if not dist.is_initialized():
        raise ConfigError(f"run.pp={run.pp}: launch with torchrun --nproc_per_node={run.pp}")
    world = dist.get_world_size()
    if world % run.pp:
        raise ConfigError(f"run.pp={run.pp} with {world} processes: the processes must be run.pp x the number of "
                          f"data-parallel replicas; launch a multiple of {run.pp}")
    mesh = init_device_mesh(device.type, (run.pp, world // run.pp), mesh_dim_names=("pp", "dp"))
    placement = stage_placement(run.pp, run.pp_schedule)
    mine = [s for s in placement if placement[s] == mesh.get_local_rank("pp")]
    return PipelinePlan(split_blocks(config, len(placement)), placement, mine, mesh,
                        getattr(pipelining, SCHEDULES[run.pp_schedule][0]), run.pp_microbatches * run.grad_accum,
                        device)


class PipelineModel(nn.Module):
    """This rank's stages, registered under the full model's names; `forward(idx)` is a plain forward down the stages
    that returns the logits on every rank, training goes through `forward_backward`
    (docs/internals.md#keelscalepipelinepipelinemodel)."""

    def __init__(self, model: TransformerLM, stages: dict[int, Stage], plan: PipelinePlan):
        super().__init__()
        self.config, self.spans, self.placement = model.config, plan.spans, plan.placement
        mesh, n = plan.mesh, len(plan.spans)
        self.group = mesh.get_group("pp")
        self.pp_rank = mesh.get_local_rank("pp")
        self.dp_rank, self.dp_size = mesh.get_local_rank("dp"), plan.dp_size
        self.stages = stages
        if 0 in stages:
            self.embed = model.embed
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for s in stages for i in plan.spans[s]})
        if n - 1 in stages:
            self.final_norm, self.lm_head = model.final_norm, model.lm_head
        self.is_first, self.is_last = 0 in stages, n - 1 in stages
        pipeline_stages = [pipelining.PipelineStage(stages[s], s, n, plan.device, group=self.group) for s in stages]
        stage_arg = pipeline_stages if len(pipeline_stages) > 1 else pipeline_stages[0]
        try:
            self.schedule = plan.schedule_cls(stage_arg, n_microbatches=plan.n_microbatches, loss_fn=lm_loss,
                                              scale_grads=True)
        except (ValueError, RuntimeError) as err:  # the schedule's own rules (micro-batches per round, compile)
            raise ConfigError(f"run.pp_schedule: {plan.schedule_cls.__name__} refuses this setup: {err}") from None
        self._step_options = {"return_outputs": False} if "return_outputs" in inspect.signature(
            self.schedule.step).parameters else {}

    def _global(self, stage: int) -> int:
        return dist.get_global_rank(self.group, self.placement[stage])

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One schedule step over the batch (x, y), (B, T) each, every rank of the pipeline passing the same
        batch (its replica's share): gradients accumulate in this rank's parameters (averaged over the dp
        replicas under FSDP2). Returns the batch's mean loss on every rank of the pipeline."""
        losses: list[torch.Tensor] = []
        args = (x,) if self.is_first else ()
        kwargs = {"target": y, "losses": losses} if self.is_last else {}
        self.schedule.step(*args, **kwargs, **self._step_options)
        loss = torch.stack(losses).mean().detach() if self.is_last else torch.zeros((), device=x.device)
        dist.broadcast(loss, src=self._global(len(self.spans) - 1), group=self.group)
        return loss

    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradients, the same on every rank: each rank holds a disjoint part of
        them (its stages, and under FSDP2 its shard of each), so the squares are summed over every rank."""
        local = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).detach().float()
                 for p in self.parameters() if p.grad is not None]
        total = torch.stack([g.pow(2).sum() for g in local]).sum() if local else torch.zeros((), device=self._device())
        dist.all_reduce(total)
        return total.sqrt()

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """(logits, loss) on every rank, like `TransformerLM.forward`: the stream goes down the stages one at a
        time, without micro-batches; the last stage's logits are then broadcast. No KV cache."""
        B, T = idx.shape
        x, n = None, len(self.spans)
        for s in range(n):
            here = self.placement[s] == self.pp_rank
            if here and s > 0 and self.placement[s - 1] != self.pp_rank:
                x = torch.empty(B, T, self.config.d_model, device=idx.device)  # the float32 stream
                dist.recv(x, src=self._global(s - 1), group=self.group)
            if here:
                x = self.stages[s](idx if s == 0 else x)
            if here and s < n - 1 and self.placement[s + 1] != self.pp_rank:
                dist.send(x.contiguous(), dst=self._global(s + 1), group=self.group)
        logits = x.float() if self.is_last else torch.empty(B, T, self.config.vocab_size, device=idx.device)
        dist.broadcast(logits, src=self._global(n - 1), group=self.group)
        return logits, None if targets is None else lm_loss(logits, targets)


__all__ = ["SCHEDULES", "PipelineModel", "PipelinePlan", "Stage", "check_config", "plan_pipeline", "split_blocks",
           "stage_placement"]
