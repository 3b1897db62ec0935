"""The fused junction, activation checkpointing, regional compilation, pipeline stages and FSDP2, applied to a
built model from outside: `parallelize` is the one place that decides them, for the plain and the pipelined model.

The model (keel.model.transformer) is single-device code and knows nothing of this. `parallelize` applies, in
this fixed order (torchtitan's, with the kernel swap first, as its model converters come first):

  0. `apply_fused_junction`  (keel.scale.fused_junction) compute each Keel junction (`LN_out` of one sub-layer and
                     `LN_in` of the next) in one piece, by swapping the two sub-layers' `Residual` modules for
                     `FusedResidual`s (as torchtitan's model converters swap modules): with the fused kernel of
                     keel.kernels.junction on CUDA, or, for a compiled model elsewhere, composed inside the
                     compiled block that ends with `LN_out`, so the compiler fuses it across the block boundary;
  1. `apply_ac`      wrap every k-th block in activation checkpointing (its inner activations are
                     recomputed in the backward pass instead of kept);
  2. `apply_compile` compile each block on its own (regional compilation): blocks of the same shape
                     share one compiled graph, so compile time does not grow with depth;
  3. pipeline        under run.pp > 1, cut the model into this rank's stages (keel.scale.pipeline);
  4. `apply_fsdp`    shard the parameters over the ranks with FSDP2 (`fully_shard`), one unit per
                     group of blocks, then the root (embedding, final norm, head): the whole model over
                     every rank, or under a pipeline each stage over its data-parallel replicas. The norms a
                     junction applies outside their own block form one more unit, gathered for the whole step.

The junction goes first: its swapped-in modules hold the very norm modules they replace (the same parameters
under the same names), which AC, compile and FSDP then wrap like any other (under pipeline stages no junction
crosses into another stage; see `apply_fused_junction`), and the compiler sees the fused op as one node. AC goes
inside compile so the compiler sees the checkpoint boundary, and both go inside the stages and FSDP so a unit's
all-gather covers what the wrapped block computes. Each step keeps the parameter names of the state dict as
they were (`checkpoint_wrapper` strips its prefix from state dicts; `Module.compile` compiles in place), so
checkpoints are interchangeable between runs with and without any of them.
"""

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
    """`torch.compile` each block in place, static (`dynamic=False`).

    Dynamo guards on each `Residual`'s python-float `alpha`, so blocks recompile only where alpha or
    the norm layout changes: Keel (first_layer="v2") has two block shapes (block 0 and the rest), so
    compiling N blocks compiles 2 graphs for any N (tests/test_parallel.py counts them). Schemes with
    more distinct block shapes than `torch._dynamo.config.recompile_limit` would fall back to eager
    for the extra ones; none of the built-in schemes has more than two.

    Static, because the recompile from block 0 (alpha 1) to block 1 (alpha L) otherwise makes Dynamo's automatic
    dynamic mark alpha a symbolic float: on CUDA that graph then carries a CPU scalar, and Inductor spent 42 s
    generating and compiling its code (one H200, d=1024, 64 sub-layers: Keel's cold first step 53-56 s against
    Pre-LN's 7.7-7.9 s; benchmarks/gpu/h200-2026-11-26.md). Every block keeps one shape in training, so nothing
    else needs to be dynamic.
    """
    for block in model.blocks:
        block.compile(backend=backend, dynamic=False)


def apply_fsdp(module: nn.Module, mesh, param_dtype: torch.dtype | None = None, group: int = 1,
               reshard_after_forward: bool = True) -> None:
    """Shard with FSDP2: one unit per `group` consecutive blocks of `module.blocks`, then `module` itself (the
    whole model, or one pipeline stage: the embedding, final norm and head it holds).

    Mixed precision: `param_dtype` (e.g. bf16) is the dtype parameters are all-gathered in and the
    branches compute in; gradients are reduced in float32. `cast_forward_inputs=False` is essential:
    FSDP2's default casts every floating-point input of a unit to `param_dtype`, which would round
    the residual stream to bf16 at every block boundary and drop Keel's small updates (see
    keel.model.numerics). The model itself casts branch inputs to the weights' dtype.
    `reshard_after_forward=False` keeps every block gathered from its forward to its backward (a pipeline
    stage runs a forward per micro-batch before the backwards: resharding would gather each block again).

    A fused junction between two blocks applies a norm the other block holds (keel.scale.fused_junction.handed_norms:
    the previous block's norm_out, under the sum handoff). Those norms (d_model values each) form one unit of
    their own, sharded first so that no block's unit claims them, and gathered by the root's pre-forward for the
    whole step: one more all-gather and reduce-scatter a step, d_model values per block. They are never called as
    modules (the compiled blocks read their weights), so FSDP2's own hooks on them never fire: the root gathers
    them, and the root's end-of-backward callback reduce-scatters their gradients and reshards them, as it does for
    the root's own parameters.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # a second of import: FSDP runs only

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
    """Apply the fused junction, AC, compile and FSDP2 in the documented order to `model`, which must already be
    on its device; returns it (modified), or with `pipeline` this rank's stages of it.

    `pipeline` (a keel.scale.pipeline.PipelinePlan, for run.pp > 1) cuts the model into this rank's stages
    after compile, shards each stage over its data-parallel group when there is more than one replica (FSDP2,
    `fsdp` is then not used), and returns the `PipelineModel`. Under a pipeline no junction crosses into another
    stage (its norm would be on another rank); under FSDP2 junctions cross blocks as in one process (`apply_fsdp`
    gathers the norms they hand across). `one_pass_norms`: the compiler's junctions run their two RMSNorms as one
    op with a one-pass backward (keel.scale.fused_junction.NormPair); False composes the two norm modules.
    """
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
