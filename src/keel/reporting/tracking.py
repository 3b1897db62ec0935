"""Optional experiment tracking with the ecosystem's own libraries, offline by default: `run.log_to=[tensorboard,
wandb]` (docs/internals.md#keelreportingtracking)."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from keel.errors import optional
from keel.safe_io import check_dir

MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}


def check(names) -> None:
    """Fail before any work if a requested tracker's library is not installed."""
    for name in names:
        optional(MODULES[name], "track", f"run.log_to: {name}")


class Trackers:
    def __init__(self, names, run_dir, config):
        self.tensorboard = self.wandb = None
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            # a planted link would send the event files outside the run directory
            self.tensorboard = SummaryWriter(log_dir=str(check_dir(run_dir, Path(run_dir) / "tensorboard")))
        if "wandb" in names:
            import wandb

            # one W&B run per run directory, so a resumed run continues its own curves
            check_dir(run_dir, Path(run_dir) / "wandb")
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "keel"), name=run_dir.name,
                                    id=run_dir.name.replace("/", "-"), resume="allow", dir=str(run_dir),
                                    config=asdict(config), mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, record: dict) -> None:
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))
                   and not isinstance(v, bool)}
        if not scalars or "step" not in record:
            return
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
