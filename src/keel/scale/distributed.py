"""The process group: started from torchrun's environment, one rank per device, gloo on CPU, NCCL on GPU; in a
single process every helper is the identity."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    """This process's place: `rank` of `size` processes; `owner` says whether it started the group."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    owner: bool = False

    @property
    def distributed(self) -> bool:
        return self.size > 1 or dist.is_initialized()

    @property
    def main(self) -> bool:
        """Rank 0: the one process that writes files, prints and shows progress."""
        return self.rank == 0


def current() -> World:
    """This process's place now, the one answer to "which rank am I": the process group's where one is running,
    else torchrun's environment (a rank before its group starts, or after it closed), else the single process."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    if launched_by_torchrun():
        return World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    return World()


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init(device_type: str) -> World:
    """Join (or start) the process group torchrun describes; a plain `World()` outside torchrun."""
    if dist.is_initialized():
        return current()
    if not launched_by_torchrun():
        return World()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timedelta(minutes=10))
    return World(dist.get_rank(), dist.get_world_size(), local_rank, owner=True)


def close(world: World) -> None:
    if world.owner and dist.is_initialized():
        dist.destroy_process_group()


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def mean(value: torch.Tensor, world: World) -> torch.Tensor:
    """The mean of `value` over ranks (a copy; `value` itself is left alone)."""
    value = value.detach().clone()
    if world.distributed:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= world.size
    return value


def broadcast_object(obj, world: World):
    """Rank 0's `obj` on every rank."""
    if not world.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
