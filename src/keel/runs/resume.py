"""Resuming a run: which checkpoint (the next older one that loads, when the newest does not), and whether it holds
what a resume restores (docs/internals.md#keelrunsresume)."""

from __future__ import annotations

import sys
from pathlib import Path

from keel.errors import CheckpointError, ConfigError
from keel.runs.checkpoint import list_checkpoints, verify

# what a resume restores besides the weights and the optimiser; `load` checks their types when present
RESUMED = {"meta.json": ("draws", "lr_scale", "rollbacks", "skip_draws", "guard"), "state.pt": ("sampler", "torch_rng")}


def check_resumable(path: Path, state: dict, meta: dict, sharded: bool = False) -> None:
    """Refuse to resume from a checkpoint without training state: weights only (keel import-hf) is a
    ConfigError; training state with a field missing is damage (a CheckpointError, so a resume falls back)."""
    if "draws" not in meta or not (sharded or "optimizer" in state):
        raise ConfigError(f"resume: checkpoint {path} holds weights only (e.g. from keel import-hf); "
                          "it can be evaluated, sampled or exported, not resumed")
    for name, held in (("meta.json", meta), ("state.pt", state)):
        if missing := [key for key in RESUMED[name] if key not in held]:
            raise CheckpointError(f"checkpoint {path}: {name} has no {missing[0]}, which a resume restores")


def check_resume_fits(run_path: Path, config, checkpoint: Path) -> None:
    """Before a resume builds anything: the run's model sizes (config.yaml, which may come from elsewhere)
    against `checkpoint`'s weights and the memory of the device it trains on, as `keel eval` checks them."""
    from keel.runs.untrusted import check_model_fits
    from keel.runtime import device_memory, resolve_device

    check_model_fits(Path(run_path) / "config.yaml", config.model, Path(checkpoint),
          device_memory(resolve_device(config.run.device)))


def load_newest(path: Path, load, warn=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """`load(path)`, or, when that raises a CheckpointError (content `verify` does not read: non-finite weights,
    training state of the wrong type or shape), `load` of the next older checkpoint that verifies, reporting
    each one skipped. Returns the checkpoint loaded; with none left, the first error is raised."""
    path = Path(path)
    try:
        load(path)
        return path
    except CheckpointError as first:
        return load_older(path, load, first, warn)


def load_older(path: Path, load, first: CheckpointError, warn=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """After `load(path)` raised `first`: `load` of the newest checkpoint older than `path` that verifies and
    loads, reporting each one skipped; with none, `first` is raised."""
    path = Path(path)
    if not (path.name.startswith("step_") and path.name[5:].isdigit()):  # not one of a run's checkpoints
        raise first
    older = [p for p in list_checkpoints(path.parent.parent) if int(p.name[5:]) < int(path.name[5:])]
    if not older:  # nothing to fall back to: the one line is the error itself
        raise first
    warn(f"keel: {first}; trying an older one")
    for candidate in reversed(older):
        if (problem := verify(candidate)) is not None:
            warn(f"keel: checkpoint {candidate} is damaged ({problem}); trying an older one")
            continue
        try:
            load(candidate)
            return candidate
        except CheckpointError as err:
            warn(f"keel: {err}; trying an older one")
    raise first from None
