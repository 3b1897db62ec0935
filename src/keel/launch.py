"""What keel's own commands set for their process before torch loads; `import keel` sets nothing process-wide.

Each is set only when the user has not chosen a value, and only while it can still take effect:
- OMP_WAIT_POLICY=passive (before torch loads: OpenMP reads it once): idle OpenMP threads sleep instead of
  spinning. On a machine other jobs share, spinning threads made CPU work 6 to 34 times slower on this project's
  2-core machine at load 5-6; OMP_WAIT_POLICY=active keeps spinning (9% faster on a machine that is yours alone).
- PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (before CUDA starts; not when PYTORCH_CUDA_ALLOC_CONF or
  PYTORCH_ALLOC_CONF is set): on one H100, `paper-2048` with run.weights=bfloat16 ran out of memory in its second
  step under the default allocator (63.9 GiB in tensors, 14.5 GiB reserved but free in fragments) and trained with
  expandable segments (benchmarks/gpu/h100-2026-11-26-b.md).
A Python program that imports keel as a library sets these itself if it wants them, as torchtitan's launcher does.
"""

import os
import sys


def launcher_environment() -> None:
    """The `keel` command's process settings (above), each only where the user set none."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    expandable_segments()


def expandable_segments() -> None:
    """Let CUDA's caching allocator grow segments in place rather than leave freed blocks stranded: only while CUDA
    has not started and no allocator setting was chosen."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
