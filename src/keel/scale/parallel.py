"""Activation checkpointing, regional compilation and FSDP2, applied to a built model from outside.

The model (keel.model.transformer) is single-device code and knows nothing of this. `parallelize` applies, in
this fixed order (torchtitan's):

  1. `apply_ac`      wrap every k-th block in activation checkpointing (its inner activations are
                     recomputed in the backward pass instead of kept);
  2. `apply_compile` compile each block on its own (regional compilation): blocks of the same shape
                     share one compiled graph, so compile time does not grow with depth;
  3. `apply_fsdp`    shard the parameters over the ranks with FSDP2 (`fully_shard`), one unit per
                     group of blocks, then the root (embedding, final norm, head).

AC goes inside compile so the compiler sees the checkpoint boundary, and both go inside FSDP so a
unit's all-gather covers what the wrapped block computes. Each step keeps the parameter names of the
state dict as they were (`checkpoint_wrapper` strips its prefix from state dicts; `Module.compile`
compiles in place), so checkpoints are interchangeable between runs with and without any of them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


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
    """`torch.compile` each block in place.

    Dynamo guards on each `Residual`'s python-float `alpha`, so blocks recompile only where alpha or
    the norm layout changes: Keel (first_layer="v2") has two block shapes (block 0 and the rest), so
    compiling N blocks compiles 2 graphs for any N (tests/test_parallel.py counts them). Schemes with
    more distinct block shapes than `torch._dynamo.config.recompile_limit` would fall back to eager
    for the extra ones; none of the built-in schemes has more than two.
    """
    for block in model.blocks:
        block.compile(backend=backend)


def apply_fsdp(model: nn.Module, mesh, param_dtype: torch.dtype | None = None, group: int = 1,
               reshard_after_forward: bool = True) -> None:
    """Shard with FSDP2: one unit per `group` consecutive blocks, then the root.

    Mixed precision: `param_dtype` (e.g. bf16) is the dtype parameters are all-gathered in and the
    branches compute in; gradients are reduced in float32. `cast_forward_inputs=False` is essential:
    FSDP2's default casts every floating-point input of a unit to `param_dtype`, which would round
    the residual stream to bf16 at every block boundary and drop Keel's small updates (see
    keel.model.numerics). The model itself casts branch inputs to the weights' dtype.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    blocks = list(model.blocks)
    for start in range(0, len(blocks), group):
        unit = blocks[start:start + group]
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward)
    # the root holds the embedding and the head; resharding it right before the backward needs it
    # again would only add an all-gather
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def parallelize(model: nn.Module, *, ac_every: int = 0, compile: bool = False, fsdp: bool = False,
                device_type: str = "cpu", param_dtype: torch.dtype | None = None, fsdp_group: int = 1) -> nn.Module:
    """Apply AC, compile and FSDP2 in the documented order; returns the same (modified) model."""
    apply_ac(model, ac_every)
    if compile:
        apply_compile(model)
    if fsdp:
        mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
        apply_fsdp(model, mesh, param_dtype, fsdp_group)
    return model
