"""Checkpoints: atomic, checksummed, never unpickling arbitrary objects.

A checkpoint is a directory `checkpoints/step_XXXXXXXX/` holding
  model.safetensors   the weights (safetensors: tensors only)
  state.pt            optimiser, data-sampler and RNG state (tensors and plain containers only,
                      loaded with `torch.load(weights_only=True)`)
  meta.json           step, schedule and guard state
  manifest.json       SHA-256 of each file above, written last
It is built under a temporary name, every file fsync'ed, then renamed into place, so a crash leaves
either the complete checkpoint or none; a checkpoint whose manifest does not match is skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch import nn

FILES = ("model.safetensors", "state.pt", "meta.json")


class CheckpointError(ValueError):
    """A checkpoint cannot be written or no usable one exists; the message names the path."""


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
    root = checkpoint_dir(run_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(state, tmp / "state.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1))
        manifest = {name: _sha256(tmp / name) for name in FILES}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        for name in (*FILES, "manifest.json"):
            _fsync(tmp / name)
        if final.exists():  # the same step written again (e.g. after a rollback): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(root)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint {final}: {err.strerror or err}") from None
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


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
    for name in FILES:
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
