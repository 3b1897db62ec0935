"""Pipeline parallelism: the blocks split into contiguous stages, one (or two) per rank, run by PyTorch's own
schedules (`torch.distributed.pipelining`).

`build_pipeline` builds the whole `TransformerLM` on every rank (same seed, same weights as one process), applies
activation checkpointing and compile from outside (keel.scale.parallel), and keeps this rank's stages: the
embedding goes with the first stage, the final norm and LM head with the last, and the split balances cost
(`split_blocks`). The result, a `PipelineModel`, holds the kept modules under the full model's names, so the
optimiser, `state_dict` and DCP checkpoints (keel.train.checkpoint.save_sharded) see the same parameter names
as in one process: a checkpoint written by the stages loads in one process, and the reverse.

One step (`PipelineModel.forward_backward`) is one `schedule.step()` over the batch, split into micro-batches.
Each micro-batch's loss is its mean token cross-entropy and the schedule divides the summed gradients by the
number of micro-batches (`scale_grads`), so with equal-sized micro-batches (training windows never hold ignored
tokens) loss and gradients are the full batch's mean, as in one process. The training step itself (clipping
over all stages, the divergence guard, the optimiser) is keel.train.pipeline_step.PipelineStep.

With more processes than stages, pipeline and data parallelism compose, as torchtitan composes them: the
world_size = pp x dp ranks form a 2-D DeviceMesh ("pp", "dp"), pp outermost, so rank = pp_coord * dp +
dp_coord. Each row of ranks with one dp coordinate runs the whole pipeline for its data-parallel replica (its
share of the global batch); each column with one pp coordinate holds the same stages, sharded with FSDP2
(`fully_shard` over the "dp" sub-mesh) before PyTorch's PipelineStage wraps them. Putting pp outermost keeps each
FSDP group on consecutive ranks (one node, where its all-gathers and reduce-scatters of every block run), and
sends only the activations between nodes. FSDP2 averages the gradients over the dp replicas, so a step's
gradients are the global batch's mean, as in one process.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from keel.errors import ConfigError
from keel.model import ModelConfig, TransformerLM, count_params
from keel.model.numerics import upcast
from keel.scale.parallel import apply_ac, apply_compile

# run.pp_schedule -> (torch.distributed.pipelining class, stages per rank, stage placement); only the schedules
# this PyTorch has. Interleaved schedules place stage s on rank s % pp; ZBV places two stages per rank in a V.
_SCHEDULES = {
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
}
SCHEDULES = {name: spec for name, spec in _SCHEDULES.items() if hasattr(pipelining, spec[0])}


def check_config(model: ModelConfig, run) -> None:
    """Why `run` (a RunConfig) cannot be pipelined with `model`, as a ConfigError; nothing if it can."""
    if run.pp == 1:
        return
    if run.pp_schedule not in SCHEDULES:
        raise ConfigError(f"run.pp_schedule: {run.pp_schedule!r} is not in this PyTorch "
                          f"({torch.__version__}); allowed: {', '.join(SCHEDULES)}")
    if model.loop_blocks is not None:
        raise ConfigError("run.pp: a looped model (model.loop_blocks) shares blocks between passes, which stages "
                          "cannot split; allowed: run.pp=1, or model.loop_blocks=null")
    if model.tie_embeddings:
        raise ConfigError("run.pp: tied embeddings would put one matrix on the first and the last stage; allowed: "
                          "run.pp=1, or model.tie_embeddings=false")
    stages = run.pp * SCHEDULES[run.pp_schedule][1]
    if model.n_blocks < stages:
        raise ConfigError(f"run.pp: {stages} stages ({run.pp_schedule}, {SCHEDULES[run.pp_schedule][1]} per rank) "
                          f"need at least as many blocks, model.n_blocks={model.n_blocks}")
    if run.batch_size % run.pp_microbatches:
        raise ConfigError(f"run.pp_microbatches: {run.pp_microbatches} does not divide run.batch_size="
                          f"{run.batch_size}; allowed: a divisor of run.batch_size")
    if run.fused_junction == "on":
        raise ConfigError("run.fused_junction=on: a junction across a stage boundary would pass two tensors; "
                          "allowed with run.pp > 1: auto or off")


def split_blocks(config: ModelConfig, n_stages: int) -> list[range]:
    """Contiguous block ranges, one per stage, balanced by cost: a block costs 1; the embedding (first stage)
    and the final norm + LM head (last stage) cost their parameter count over a block's."""
    d, V, n = config.d_model, config.vocab_size, config.n_blocks
    embed, head = V * d, V * d + d
    per_block = (count_params(config) - embed - head) / n
    lead, total = embed / per_block, (embed + head) / per_block + n
    bounds = [0]
    for s in range(1, n_stages):  # blocks before stage s: as close to s/n_stages of the total cost as allowed
        ideal = round(s * total / n_stages - lead)
        bounds.append(min(max(ideal, bounds[-1] + 1), n - (n_stages - s)))
    bounds.append(n)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class Stage(nn.Module):
    """A contiguous slice of a `TransformerLM`: the embedding (first stage), `blocks[span]`, the final norm and
    LM head (last stage). Its forward is `TransformerLM.forward`'s, cut: token ids or the float32 residual
    stream in, the stream or the logits out."""

    def __init__(self, model: TransformerLM, span: range, first: bool, last: bool):
        super().__init__()
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in span})
        self.final_norm = model.final_norm if last else None
        self.lm_head = model.lm_head if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        if self.embed is not None:
            x = upcast(self.embed(x))  # (B, T, d): the stream is float32 from here to the head
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for block in self.blocks.values():
            x = block(x, cos, sin)
        if self.lm_head is None:
            return x  # (B, T, d), float32: what the next stage receives
        return self.lm_head(self.final_norm(x).to(self.lm_head.weight.dtype))  # (B, T, V)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One micro-batch's mean next-token loss, as `TransformerLM.forward` computes it."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


def shard_stage(stage: Stage, dp_mesh: DeviceMesh) -> None:
    """Shard a stage's parameters over the data-parallel ranks with FSDP2: one unit per block, then the stage
    (embedding, final norm, head). As keel.scale.parallel.apply_fsdp, the stream is never cast
    (`cast_forward_inputs=False`) and gradients are reduced in float32; mixed precision comes from autocast,
    as without dp. No unit reshards after its forward: a stage runs a forward per micro-batch before the
    backwards, and resharding would all-gather every block again each time (torchtitan's default under pp);
    the schedule reshards after the last backward."""
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in stage.blocks.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(stage, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)


class PipelineModel(nn.Module):
    """This rank's stages. Their modules are registered here under the full model's names (`embed`,
    `blocks.<i>`, `final_norm`, `lm_head`), so parameters, optimiser state and checkpoints are named as in one
    process. `forward(idx)` is a plain forward pass down the stages (for evaluation) that returns the logits
    on every rank; training goes through `forward_backward`.

    `mesh` is the ("pp", "dp") DeviceMesh: the pipeline runs over this rank's "pp" group; with more than one
    dp replica the stages are sharded over the "dp" group (`shard_stage`), and the parameters are DTensors.
    `dp_rank` of `dp_size` says which share of the global batch this rank's replica reads."""

    def __init__(self, model: TransformerLM, spans: list[range], stage_ids: list[int], placement: dict[int, int],
                 mesh: DeviceMesh, schedule_cls: type, n_microbatches: int, device: torch.device):
        super().__init__()
        self.config, self.spans, self.placement = model.config, spans, placement
        self.group = mesh.get_group("pp")
        self.pp_rank, n = mesh.get_local_rank("pp"), len(spans)
        self.dp_rank, self.dp_size = mesh.get_local_rank("dp"), mesh["dp"].size()
        self.stages = {s: Stage(model, spans[s], first=s == 0, last=s == n - 1) for s in stage_ids}
        if self.dp_size > 1:
            for stage in self.stages.values():
                shard_stage(stage, mesh["dp"])
        if 0 in self.stages:
            self.embed = model.embed
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for s in stage_ids for i in spans[s]})
        if n - 1 in self.stages:
            self.final_norm, self.lm_head = model.final_norm, model.lm_head
        self.is_first, self.is_last = 0 in self.stages, n - 1 in self.stages
        pipeline_stages = [pipelining.PipelineStage(self.stages[s], s, n, device, group=self.group)
                           for s in stage_ids]
        stage_arg = pipeline_stages if len(pipeline_stages) > 1 else pipeline_stages[0]
        try:
            self.schedule = schedule_cls(stage_arg, n_microbatches=n_microbatches, loss_fn=_loss, scale_grads=True)
        except (ValueError, RuntimeError) as err:  # the schedule's own rules (micro-batches per round, compile)
            raise ConfigError(f"run.pp_schedule: {schedule_cls.__name__} refuses this setup: {err}") from None
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
        return logits, None if targets is None else _loss(logits, targets)


def build_pipeline(config: ModelConfig, run, device: torch.device, model: TransformerLM | None = None
                   ) -> PipelineModel:
    """This rank's `PipelineModel` for `run` (a RunConfig: pp, pp_schedule, pp_microbatches, grad_accum,
    ac_every, compile), in a process group of run.pp x dp ranks (dp >= 1 data-parallel replicas). `model` (else
    `TransformerLM(config)`, which every rank must build from the same seed) is split, after activation
    checkpointing and compile are applied to it from outside, as keel.scale.parallel does; with dp > 1 each
    stage is then sharded over its dp group (`shard_stage`)."""
    check_config(config, run)
    if not dist.is_initialized():
        raise ConfigError(f"run.pp={run.pp}: launch with torchrun --nproc_per_node={run.pp}")
    world = dist.get_world_size()
    if world % run.pp:
        raise ConfigError(f"run.pp={run.pp} with {world} processes: the processes must be run.pp x the number of "
                          f"data-parallel replicas; launch a multiple of {run.pp}")
    mesh = init_device_mesh(device.type, (run.pp, world // run.pp), mesh_dim_names=("pp", "dp"))
    name, per_rank, style = SCHEDULES[run.pp_schedule]
    n_stages = run.pp * per_rank
    model = (model if model is not None else TransformerLM(config)).to(device)
    apply_ac(model, run.ac_every)
    if run.compile:
        apply_compile(model)
    placement = {s: s % run.pp if style == "loop" else min(s, n_stages - 1 - s) for s in range(n_stages)}
    mine = [s for s in range(n_stages) if placement[s] == mesh.get_local_rank("pp")]
    return PipelineModel(model, split_blocks(config, n_stages), mine, placement, mesh,
                         getattr(pipelining, name), run.pp_microbatches * run.grad_accum, device)


__all__ = ["SCHEDULES", "PipelineModel", "Stage", "build_pipeline", "check_config", "shard_stage", "split_blocks"]
