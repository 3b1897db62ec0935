"""Where code runs and what ran: CPU threads, device, autocast, peak FLOP/s for MFU, and the machine/provenance
record; importing it does not import torch (docs/internals.md#keelruntime)."""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from keel._version import __version__
from keel.errors import ConfigError

if TYPE_CHECKING:
    import torch

# SIGINT/SIGTERM received by the `keel` command before a run took the signals over (keel.cli records them): Python
# only prints an exception raised inside a callback (importlib's module-lock callback during an import, a `__del__`
# or weakref callback while a finished point's model is freed), so the KeyboardInterrupt such a signal raises can be
# swallowed and the command go on. The trainer stops at its first step boundary when one is here.
PENDING_SIGNALS: list[int] = []


def stop_if_signalled() -> None:
    """Raise the KeyboardInterrupt of a signal whose own was swallowed (PENDING_SIGNALS), at a safe boundary: a
    sweep between points, an experiment's training loop between steps."""
    if PENDING_SIGNALS:
        raise KeyboardInterrupt


DEVICES = ("auto", "cpu", "cuda")


def check_device(value: str, name: str) -> None:
    """auto, cpu, cuda or cuda:N; another device torch knows (meta, a GPU of another kind) would fail deep inside a
    command, e.g. `meta` at the first `.item()`."""
    kind, _, index = value.partition(":")
    if value not in DEVICES and not (kind == "cuda" and index.isdigit()):
        raise ConfigError(f"{name}: got {value!r}; allowed: auto, cpu, cuda, cuda:N")


DTYPES = ("auto", "float32", "bfloat16")

# dense bf16 peak FLOP/s by GPU part (vendor datasheets), for MFU and the performance model
PEAK_BF16 = {"H100": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H200": 989e12, "H200 NVL": 835e12,
             "A100": 312e12, "A100 PCIe": 312e12, "L40S": 362e12, "A10G": 70e12, "RTX 4090": 165e12}
# the part of each CUDA device name, matched whole: a name not here has no known peak (no guess from a fragment,
# which gave an H100 PCIe the SXM part's peak)
CUDA_NAMES = {"NVIDIA H100 80GB HBM3": "H100", "NVIDIA H100 PCIe": "H100 PCIe", "NVIDIA H100 NVL": "H100 NVL",
              "NVIDIA H200": "H200", "NVIDIA H200 NVL": "H200 NVL", "NVIDIA A100-SXM4-80GB": "A100",
              "NVIDIA A100-SXM4-40GB": "A100", "NVIDIA A100 80GB PCIe": "A100 PCIe", "NVIDIA A100-PCIE-40GB":
              "A100 PCIe", "NVIDIA L40S": "L40S", "NVIDIA A10G": "A10G", "NVIDIA GeForce RTX 4090": "RTX 4090"}
# bytes one process's tensors can use on the GPUs keel plans for, one figure per GPU: the driver's total (nvidia-smi,
# MiB) less the 1,247 MiB an 80 GB H100 kept back from PyTorch (79.18 GiB CUDA capacity, 0.74 GiB of it the CUDA
# context and libraries: 78.43 GiB reserved or free at an out-of-memory error), assumed the same on the others
GPU_MEMORY = {"H100 80GB": (81559 - 1247) * 2**20, "H200 141GB": (143771 - 1247) * 2**20,
              "A100 80GB": (81920 - 1247) * 2**20}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or `taskset`'s limit, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def physical_cores() -> int:
    """Physical cores among the CPUs this process may use (hyper-threads of one core count once); never more
    than `usable_cpus()`."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return usable_cpus()
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            return len(cpus)  # no topology (some containers): one thread per usable CPU
    return max(1, min(len(cores), len(cpus)))


def default_threads() -> int:
    """run.threads=0: OMP_NUM_THREADS when the user set it, else one thread per physical core this process may
    use. More threads than cores (hyper-threads, or a machine other jobs share) make a step slower, not faster."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.strip().isdigit() and int(env) >= 1:
        return min(int(env), usable_cpus())
    return physical_cores()


def set_threads(threads: int = 0) -> int:
    """Use `threads` CPU threads (0: `default_threads()`) in this process and in the processes it starts; returns
    the number. Call it before any work: torch, if not loaded yet, then starts with it (OMP_NUM_THREADS). OpenMP's
    wait policy is keel.launch's (passive under keel's commands)."""
    n = threads if threads >= 1 else default_threads()
    os.environ["OMP_NUM_THREADS"] = str(n)
    if "torch" in sys.modules:
        import torch

        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
    return n


def busy_note(threads: int) -> str | None:
    """A note when other jobs keep the CPUs busy (load average above the CPUs this process may use): a CPU run
    is then several times slower than on an idle machine, and fewer threads often faster."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    if load <= usable_cpus():
        return None
    hint = "; if it crawls, try run.threads=1" if threads > 1 else ""
    return (f"keel: note: load average {load:.1f} on {usable_cpus()} CPUs: other jobs share this machine, so this "
            f"runs slower than on an idle one{hint}")


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when present, else CPU; `cuda` without a GPU is a config error, not a crash later."""
    import torch

    check_device(name, "run.device")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"run.device: {name!r} requested but no CUDA device is available; allowed: auto, cpu")
    return torch.device(name)


def use_bf16(device: torch.device, dtype: str) -> bool:
    return dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda")


def autocast_for(device: torch.device, dtype: str):
    """bf16 autocast on GPU by default, float32 on CPU. The residual stream stays float32 regardless
    (keel.model.numerics): alpha*x with alpha in the hundreds would swamp a bf16 update."""
    if not use_bf16(device, dtype):
        return contextlib.nullcontext
    import torch

    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOP/s, or None where unknown (CPUs, unlisted GPUs): MFU is then not shown."""
    if device.type != "cuda":
        return None
    import torch

    return peak_of(torch.cuda.get_device_name(device))


def peak_of(cuda_name: str) -> float | None:
    """The dense bf16 peak of the GPU with this CUDA device name, matched whole (CUDA_NAMES); None if unknown."""
    return PEAK_BF16.get(CUDA_NAMES.get(cuda_name.strip(), ""))


def device_memory(device: torch.device) -> int | None:
    """Total bytes of the device's memory (RAM for the CPU), or None where unknown."""
    import torch

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
    import torch

    device = torch.device(device)
    return {
        "keel_version": __version__, "git_commit": git_commit(), "torch_version": torch.__version__,
        "python": platform.python_version(), "platform": platform.platform(), "hostname": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


def provenance(seed: int, device: torch.device) -> dict:
    """`machine()` plus the seed, the command line and the start time: the head of a run's run.json."""
    return machine(device) | {"seed": seed, "command": sys.argv, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
