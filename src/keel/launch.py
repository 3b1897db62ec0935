"""What keel's own commands set for their process before torch loads, each only when the user has not chosen a
value; `import keel` sets nothing process-wide (why each: docs/internals.md#keellaunch)."""

import os
import sys


def launcher_environment() -> None:
    """The `keel` command's process settings (docs/internals.md#keellaunch), each only where the user set none."""
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
