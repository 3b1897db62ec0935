"""Keel: deep Transformer language models with the Keel residual connection and its baselines.

`import keel` loads nothing heavy: the names below come from `keel.model` (and torch) on first use, and
nothing of Hugging Face loads until `keel.hf.register()` registers `KeelConfig` and `KeelForCausalLM` with
`transformers`' Auto classes when you want them.

`import keel` before torch lets torch's idle OpenMP threads sleep (OMP_WAIT_POLICY=passive) unless you chose a
policy: on a machine other jobs share, spinning threads made CPU work 6 to 34 times slower on this project's
2-core machine at load 5-6. OpenMP reads the variable once, when torch loads, so with torch already imported it
is left alone and, on a busy machine with more than one torch thread, a warning says so (one thread starts no
OpenMP pool: nothing spins). OMP_WAIT_POLICY=active keeps spinning (9% faster on a machine that is yours alone).

`import keel` before CUDA starts also sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless you chose an
allocator setting (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF): on one H100 (2026-11-26), `paper-2048` with
run.weights=bfloat16 ran out of memory in its second step under the default allocator (63.9 GiB in tensors, 14.5
GiB reserved but free in fragments) and trained with expandable segments (peak 73.2 GiB; the plan's 72.6).
"""

import os as _os
import sys as _sys

from keel._version import __version__

__all__ = [
    "ModelConfig", "TransformerLM", "SublayerInfo", "SCHEMES", "PRESETS", "preset", "tiny", "cpu_demo",
    "paper_64", "paper_128", "paper_512", "paper_1024", "paper_2048", "count_params", "flops_per_token", "__version__",
]


def _passive_openmp() -> str | None:
    """Set OMP_WAIT_POLICY=passive while it can still take effect (torch not loaded, no policy chosen); returns
    a warning when it cannot and it matters: torch loaded first, no policy chosen, more than one torch thread (one
    starts no OpenMP pool: OMP_NUM_THREADS=1 runs a single OS thread), load above the usable CPUs."""
    if "OMP_WAIT_POLICY" in _os.environ:
        return None
    if "torch" not in _sys.modules:
        _os.environ["OMP_WAIT_POLICY"] = "passive"
        return None
    try:  # keel.runtime.busy_note's test, here because `import keel` imports no more of keel than the model
        load, cpus = _os.getloadavg()[0], len(_os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if load <= cpus or _sys.modules["torch"].get_num_threads() <= 1:
        return None
    return (f"keel: torch was imported before keel, so its idle OpenMP threads spin; with load average {load:.1f} "
            f"on {cpus} CPUs that can make CPU work several times slower: import keel before torch, or set "
            f"OMP_WAIT_POLICY=passive before Python starts (OMP_WAIT_POLICY=active: keep spinning, no warning)")


if (_note := _passive_openmp()) is not None:
    import warnings as _warnings

    _warnings.warn(_note, RuntimeWarning, stacklevel=2)


def _expandable_segments() -> None:
    """Let CUDA's caching allocator grow segments in place (PyTorch's expandable_segments) rather than leave freed
    blocks stranded, while it can still take effect: CUDA not started, no allocator setting chosen."""
    if "PYTORCH_CUDA_ALLOC_CONF" in _os.environ or "PYTORCH_ALLOC_CONF" in _os.environ:
        return
    torch = _sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return
    _os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


_expandable_segments()


def __getattr__(name: str):
    # keel.model (and torch with it) loads on first use, not on `import keel`: the `keel` command imports
    # this package before it can catch Ctrl-C, and torch takes seconds to import
    if name in __all__:
        from keel import model

        return getattr(model, name)
    raise AttributeError(f"module 'keel' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
