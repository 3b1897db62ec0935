"""The fused junction, activation checkpointing, regional compilation, pipeline stages and FSDP2, applied to a
built model from outside in one fixed order by `parallelize` (docs/internals.md#keelscaleparallel)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from keel.scale import FUSED_JUNCTION, FUSED_JUNCTION_DEFAULT  # noqa: F401 (FUSED_JUNCTION: re-exported)
from keel.scale.fused_junction import apply_fused_junction, handed_norms


def apply_ac(model: nn.Module, every: int) -> int:
    """Checkpoint blocks 0, k, 2k, ... (`every`=k; 1 = every block, 0 = none). Returns how many."""
    if every <= 0:
        return 0
    wrapped = 0
    for i, block in enumerate(model.blocks):
        if i % every == 0:
            model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=True)
            wrapped += 1
    return wrapped


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    """`torch.compile` each block in place, static (`dynamic=False`; why: docs/internals.md#apply_compile)."""
    for block in model.blocks:
        block.compile(backend=backend, dynamic=False)


def apply_fsdp(module: nn.Module, mesh, param_dtype: torch.dtype | None = None, group: int = 1,
               reshard_after_forward: bool = True) -> None:
    """Shard with FSDP2: one unit per `group` consecutive blocks of `module.blocks`, then `module` itself; the
    norms fused junctions hand across blocks form one more unit (docs/internals.md#apply_fsdp)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # a second of import: FSDP runs only

    # cast_forward_inputs=False: FSDP2's default would round the float32 residual stream to bf16 at every unit
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    handed = handed_norms(module)
    if handed:
        fully_shard(handed if len(handed) > 1 else handed[0], mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    blocks = list(module.blocks.values() if isinstance(module.blocks, nn.ModuleDict) else module.blocks)
    for start in range(0, len(blocks), group):
        unit = blocks[start:start + group]
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward)
    # the root holds the embedding and the head; resharding it right before the backward needs it
    # again would only add an all-gather
    fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    if handed:  # after FSDP2's root pre-forward hook, which initialises every unit on the first forward
        module.register_forward_pre_hook(lambda *_: handed[0].unshard())


def parallelize(model: nn.Module, *, fused_junction: str = FUSED_JUNCTION_DEFAULT, ac_every: int = 0,
                compile: bool = False, fsdp: bool = False, pipeline=None, device_type: str = "cpu",
                param_dtype: torch.dtype | None = None, fsdp_group: int = 1,
                compile_backend: str = "inductor", one_pass_norms: bool = True) -> nn.Module:
    """Apply the fused junction, AC, compile and FSDP2 in the documented order to `model`, already on its device;
    returns it (modified), or with `pipeline` (a keel.scale.pipeline.PipelinePlan) this rank's `PipelineModel`."""
    # a checkpointed block keeps only its input: handing it (stream, LN_in(stream)) would keep two tensors per
    # block boundary instead of one, so under AC the kernel's junctions stay inside blocks (the compiler's hand on
    # the sum alone: keel.scale.fused_junction.SumHandoff)
    stage_starts = [span.start for span in pipeline.spans[1:]] if pipeline is not None else ()
    apply_fused_junction(model, fused_junction, compiled=compile, checkpointed=ac_every > 0, stage_starts=stage_starts,
                         one_pass=one_pass_norms)
    apply_ac(model, ac_every)
    if compile:
        apply_compile(model, compile_backend)
    if pipeline is not None:
        stages = pipeline.cut(model)
        if pipeline.dp_size > 1:
            for stage in stages.values():
                apply_fsdp(stage, pipeline.mesh["dp"], param_dtype, fsdp_group, reshard_after_forward=False)
        return pipeline.assemble(model, stages)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
        apply_fsdp(model, mesh, param_dtype, fsdp_group)
    return model
