"""Where code runs and what ran: device, autocast, peak FLOP/s for MFU, and the machine/provenance record.

Runs, experiments and benchmarks all describe themselves with `machine()`, so their results can be compared.
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from keel._version import __version__
from keel.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")

# dense bf16 peak FLOP/s by GPU name fragment, for MFU
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "4090": 165e12}


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when present, else CPU; `cuda` without a GPU is a config error, not a crash later."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.split(":")[0] == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"run.device: {name!r} requested but no CUDA device is available; allowed: auto, cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"run.device: got {name!r}; allowed: {', '.join(DEVICES)}") from None


def use_bf16(device: torch.device, dtype: str) -> bool:
    return dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda")


def autocast_for(device: torch.device, dtype: str):
    """bf16 autocast on GPU by default, float32 on CPU. The residual stream stays float32 regardless
    (keel.model.numerics): alpha*x with alpha in the hundreds would swamp a bf16 update."""
    if not use_bf16(device, dtype):
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOP/s, or None where unknown (CPUs, unlisted GPUs): MFU is then not shown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def device_memory(device: torch.device) -> int | None:
    """Total bytes of the device's memory (RAM for the CPU), or None where unknown."""
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError, RuntimeError):
        return None


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine(device: torch.device | str = "cpu") -> dict:
    """What ran: versions and hardware, as runs, experiments and benchmarks record it."""
    device = torch.device(device)
    return {
        "keel_version": __version__, "git_commit": git_commit(), "torch_version": torch.__version__,
        "python": platform.python_version(), "platform": platform.platform(), "hostname": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


def provenance(seed: int, device: torch.device) -> dict:
    """`machine()` plus the seed, the command line and the start time: the head of a run's run.json."""
    return machine(device) | {"seed": seed, "command": sys.argv, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
