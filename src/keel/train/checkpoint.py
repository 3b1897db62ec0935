"""Checkpoints: atomic, checksummed, never unpickling arbitrary objects.

A checkpoint is a directory `checkpoints/step_XXXXXXXX/` holding
  model.safetensors   the weights (safetensors: tensors only)
  state.pt            optimiser, data-sampler and RNG state (tensors and plain containers only,
                      loaded with `torch.load(weights_only=True)`)
  meta.json           step, schedule and guard state
  manifest.json       SHA-256 of each file above, written last
It is built under a temporary name, every file fsync'ed, then renamed into place, so a crash leaves
either the complete checkpoint or none; a checkpoint whose manifest does not match is skipped.

Runs under torchrun write sharded checkpoints instead (`save_sharded`): the same directory, but the
weights and optimiser state are a `torch.distributed.checkpoint` (DCP) save, `.metadata` plus one
`__<rank>_0.distcp` file per rank, in place of model.safetensors and the optimiser in state.pt. DCP
reshards on load, so a checkpoint written by N ranks loads on M ranks, or in a single process
(`load`, `load_sharded`), and `export_safetensors` turns one into a single safetensors file. The
manifest then lists every file, and the same temporary-directory-then-rename rule holds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from keel.errors import CheckpointError

FILES = ("model.safetensors", "state.pt", "meta.json")
DCP_METADATA = ".metadata"  # the file DCP writes last; its presence marks a sharded checkpoint


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir: Path, step: int, model: nn.Module, state: dict, meta: dict, keep: int) -> Path:
    """Write checkpoint `step` atomically and keep only the newest `keep` checkpoints."""
    root, tmp, final = _paths(run_dir, step, f"-{os.getpid()}")
    try:
        _fresh(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(state, tmp / "state.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1))
        _commit(tmp, final, FILES)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint {final}: {err.strerror or err}") from None
    _prune(run_dir, keep)
    return final


def _paths(run_dir: Path, step: int, suffix: str) -> tuple[Path, Path, Path]:
    root = checkpoint_dir(run_dir)
    return root, root / f".tmp-step_{step:08d}{suffix}", root / f"step_{step:08d}"


def _fresh(tmp: Path) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()


def _commit(tmp: Path, final: Path, names) -> None:
    """Checksum `names` in `tmp` into its manifest, fsync everything, then rename `tmp` to `final`."""
    manifest = {name: _sha256(tmp / name) for name in names}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for name in (*names, "manifest.json"):
        _fsync(tmp / name)
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    if final.exists():  # the same step written again (e.g. after a rollback): set the old one aside first,
        os.rename(final, old)  # so a crash between the renames still leaves a complete copy on disk
    os.rename(tmp, final)
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _prune(run_dir: Path, keep: int) -> None:
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def save_sharded(run_dir: Path, step: int, model: nn.Module, optimizer, state: dict, meta: dict, keep: int,
                 main: bool) -> Path:
    """Collective: every rank calls this. Model and optimiser go through DCP (each rank writes its own
    shards); rank 0 (`main`) adds `state` and `meta`, the manifest, and renames the directory into place.
    The temporary name carries no pid, so that every rank writes into the same one."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root, tmp, final = _paths(run_dir, step, "-sharded")
    if main:
        _fresh(tmp)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
    if main:
        try:
            torch.save(state, tmp / "state.pt")
            (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1))
            _commit(tmp, final, sorted(p.name for p in tmp.iterdir()))
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"cannot write checkpoint {final}: {err.strerror or err}") from None
        _prune(run_dir, keep)
    dist.barrier()
    return final


def is_sharded(path: Path) -> bool:
    return (Path(path) / DCP_METADATA).is_file()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first (temporary ones excluded)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))


def verify(path: Path) -> str | None:
    """None if the checkpoint at `path` is intact, else what is wrong with it."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return "manifest.json missing or unreadable"
    for name in (manifest if DCP_METADATA in manifest else FILES):
        if not (path / name).is_file():
            return f"{name} missing"
        if manifest.get(name) != _sha256(path / name):
            return f"{name} does not match its checksum"
    return None


def latest_valid(run_dir: Path, warn=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """The newest intact checkpoint; corrupt newer ones are reported and skipped, never deleted."""
    for path in reversed(list_checkpoints(run_dir)):
        problem = verify(path)
        if problem is None:
            return path
        warn(f"keel: checkpoint {path} is damaged ({problem}); trying an older one")
    raise CheckpointError(f"{checkpoint_dir(run_dir)}: no intact checkpoint to resume from")


def load(path: Path, model: nn.Module) -> tuple[dict, dict]:
    """Load weights into `model`; return (state, meta). The caller restores the state it needs."""
    problem = verify(path)
    if problem:
        raise CheckpointError(f"checkpoint {path}: {problem}")
    if is_sharded(path):
        return load_sharded(path, model)
    try:
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    except RuntimeError as err:  # shape mismatch
        detail = str(err).strip().splitlines()[-1]
        raise CheckpointError(f"checkpoint {path}: weights do not fit the model ({detail})") from None
    if missing or unexpected:
        names = ", ".join(sorted(missing or unexpected)[:3])
        raise CheckpointError(f"checkpoint {path}: weights do not fit the model ({names})")
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    meta = json.loads((path / "meta.json").read_text())
    return state, meta


def load_sharded(path: Path, model: nn.Module, optimizer=None) -> tuple[dict, dict]:
    """Load a DCP checkpoint into `model` (and `optimizer`), whatever the number of ranks now: sharded
    (FSDP2) under torchrun, or a plain model in a single process. Returns (state, meta) as `load` does;
    with a process group, every rank must call it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: intended
        try:
            if optimizer is None:
                model_sd = get_model_state_dict(model)
                dcp.load({"model": model_sd}, checkpoint_id=str(path))
                set_model_state_dict(model, model_sd)
            else:
                model_sd, optim_sd = get_state_dict(model, optimizer)
                both = {"model": model_sd, "optimizer": optim_sd}
                dcp.load(both, checkpoint_id=str(path))
                set_state_dict(model, optimizer, model_state_dict=both["model"], optim_state_dict=both["optimizer"])
        except (RuntimeError, ValueError, KeyError) as err:  # missing keys, shapes that do not fit
            detail = (str(err).strip().splitlines() or [type(err).__name__])[-1][:200]
            raise CheckpointError(f"checkpoint {path}: weights do not fit the model ({detail})") from None
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    meta = json.loads((path / "meta.json").read_text())
    return state, meta


def export_safetensors(path: Path, model: nn.Module, out: Path) -> Path:
    """Write checkpoint `path` (sharded or not) as one safetensors file at `out`, via `model` (a plain,
    unsharded model of the run's config, which it loads)."""
    load(Path(path), model)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, str(out))
    return out
