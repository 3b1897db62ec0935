"""A point's progress while it trains, so that a sweep killed mid-point continues that point where it was."""

from __future__ import annotations

import contextlib
import contextvars
import json
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from keel._version import __version__
from keel.errors import CheckpointError
from keel.runs import checkpoint
from keel.runs.paths import list_checkpoints

EVERY_SECONDS = 120.0  # between saves: a killed point loses at most this much training
_DIR: contextvars.ContextVar[Path | None] = contextvars.ContextVar("partial_dir", default=None)


def partial_dir() -> Path | None:
    """The directory where the point now running keeps its progress (set by `Sweep`), or None outside a sweep."""
    return _DIR.get()


@contextlib.contextmanager
def keeping_progress_in(path: Path) -> Iterator[None]:
    token = _DIR.set(Path(path))
    try:
        yield
    finally:
        _DIR.reset(token)


def discard(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Partial:
    """`path`: the partial directory; `identity`: what the point is (its whole configuration, JSON); `state`: the
    caller's JSON-able state, saved with the training state and updated in place on a resume."""

    path: Path
    identity: dict  # with how it computes added (threads, torch and keel versions, device)
    state: dict = field(default_factory=dict)
    every_seconds: float | None = None  # None: EVERY_SECONDS
    resumed_at: list[int] = field(default_factory=list)  # the steps this point continued from (none: trained whole)
    _saved_at: float = field(default_factory=time.monotonic, repr=False)

    def __post_init__(self):
        # how the point computes, beside what it is: a continued point must compute as its first part did (CPU
        # reductions differ with the thread count; other torch or keel code may compute otherwise)
        self.identity = {"point": self.identity, "threads": torch.get_num_threads(), "torch": torch.__version__,
                         "keel": __version__}

    @property
    def key(self) -> str:
        """The point's key, as the sweep names its file."""
        return self.path.name.removesuffix(".partial")

    def restore(self, model, optimizer, sampler, guard) -> tuple[int, list, list, float] | None:
        """(steps done, losses, lrs, seconds trained) loaded into the fresh objects, or None: nothing to continue.
        Progress of another configuration, or that does not load, is discarded (`Discarded`: build them again)."""
        if not self.path.exists():
            return None
        try:
            found = list_checkpoints(self.path)
            if not found:
                return None
            state, meta = checkpoint.load(found[-1], model)
            device = next(model.parameters()).device
            if meta.get("identity") != self._identity(device):
                raise CheckpointError(f"{found[-1]}: saved by a point of another configuration or computed otherwise")
            optimizer.load_state_dict(state["optimizer"])
            sampler.load_state_dict(state["sampler"])
            torch.set_rng_state(state["torch_rng"])
            if device.type == "cuda":
                torch.cuda.set_rng_state(state["cuda_rng"], device)
            guard.load_state_dict(meta["guard"])
            progress = meta["step"], list(meta["losses"]), list(meta["lrs"]), float(meta["seconds"])
            self.state.update(meta["caller"])
        except torch.cuda.OutOfMemoryError:
            raise  # the device's trouble, not the saved progress's
        except (CheckpointError, OSError, KeyError, TypeError, ValueError, RuntimeError) as err:
            print(f"keel: {self.path}: not continued ({str(err).splitlines()[0]}); the point starts over",
                  file=sys.stderr, flush=True)
            discard(self.path)
            if self.path.exists():  # else the caller would find the same progress again, and again
                raise CheckpointError(f"{self.path}: cannot be removed; remove it and run the sweep again") from None
            raise Discarded from None
        self.resumed_at = list(meta.get("resumed_at", [])) + [progress[0]]
        print(f"keel: {self.key}: continued from step {progress[0]} (its saved progress)", file=sys.stderr,
              flush=True)
        self._saved_at = time.monotonic()
        return progress

    def maybe_save(self, steps: int, model, optimizer, sampler, guard, losses: list, lrs: list,
                   seconds: float) -> None:
        """Save after `steps` steps if `every_seconds` have passed since the last save (or the start)."""
        every = EVERY_SECONDS if self.every_seconds is None else self.every_seconds
        if time.monotonic() - self._saved_at >= every:
            self.save(steps, model, optimizer, sampler, guard, losses, lrs, seconds)

    def save(self, steps: int, model, optimizer, sampler, guard, losses: list, lrs: list, seconds: float) -> None:
        """Save the progress after `steps` steps now (`maybe_save` on its clock; `train_curve` when signalled)."""
        device = next(model.parameters()).device
        state = {"optimizer": optimizer.state_dict(), "sampler": sampler.state_dict(),
                 "torch_rng": torch.get_rng_state()}
        if device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(device)
        meta = {"identity": self._identity(device), "guard": guard.state_dict(), "losses": losses, "lrs": lrs,
                "seconds": seconds, "caller": self.state, "resumed_at": self.resumed_at}
        checkpoint.save(self.path, steps, model, state, json.loads(json.dumps(meta)), keep=1)
        self._saved_at = time.monotonic()

    def _identity(self, device: torch.device) -> dict:
        return json.loads(json.dumps(self.identity | {"device": str(device)}))


class Discarded(Exception):
    """The saved progress was discarded: the caller builds the point again from its seed (the objects it passed
    to `restore` may hold part of what was loaded)."""
