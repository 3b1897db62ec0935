"""Where a run's checkpoints are: finding them needs no torch (`keel runs` lists runs without importing it);
reading and writing them is keel.runs.checkpoint."""

from __future__ import annotations

import os
import re
from pathlib import Path

from keel.errors import CheckpointError

STEP = re.compile(r"step_\d+")


def checkpoint_dir(run_dir: Path) -> Path:
    """`run_dir`/checkpoints, refused when it is a symlink: saving would write, and pruning delete, outside
    the run directory."""
    root = Path(run_dir) / "checkpoints"
    if root.is_symlink():
        raise CheckpointError(f"{root}: is a symbolic link to {os.readlink(root)}; keel does not follow it")
    return root


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The `step_N` entries of checkpoints/, oldest first: directories, and symlinks so that `latest_valid`
    reports them (temporary ones excluded). Nothing is checked here; see `verify`."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP.fullmatch(p.name) and (p.is_symlink() or p.is_dir())]
    return sorted(found, key=lambda p: int(p.name[len("step_"):]))
