"""Divergence: non-finite values and loss spikes, caught the step they happen, and the trainer's answer (stop or
roll back)."""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections import deque

from keel.config import GuardConfig
from keel.runs import checkpoint, resume


class Diverged(Exception):
    pass


class DivergenceGuard:
    """Judges each step's loss and gradient norm before the optimiser step: a spike over the median of recent losses,
    or a loss above a ceiling from the first step (the rules: docs/internals.md#keeltrainguarddivergenceguard)."""

    def __init__(self, cfg: GuardConfig, vocab_size: int | None = None):
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.spike_window)
        self.ceiling = cfg.loss_ceiling * math.log(vocab_size) if vocab_size and cfg.loss_ceiling > 0 else None

    def check(self, loss: float, grad_norm: float) -> str | None:
        """None if the step is healthy (and then it joins the history), else the reason it is not."""
        if not math.isfinite(loss):
            return f"non-finite loss ({loss})"
        if not math.isfinite(grad_norm):
            return f"non-finite gradient norm ({grad_norm})"
        if self.ceiling is not None and loss > self.ceiling:
            return (f"loss blow-up: {loss:.4g} > {self.cfg.loss_ceiling:g} x ln(vocab) = {self.ceiling:.4g} "
                    "(a uniform guess scores ln(vocab))")
        if self.cfg.spike_min_history and len(self.history) >= self.cfg.spike_min_history:
            median = statistics.median(self.history)
            if loss > self.cfg.spike_factor * median and loss - median > self.cfg.spike_min_rise:
                return (f"loss spike: {loss:.4g} > {self.cfg.spike_factor:g} x running median {median:.4g} "
                        f"(and more than {self.cfg.spike_min_rise:g} above it)")
        self.history.append(loss)
        return None

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque(state["history"], maxlen=self.cfg.spike_window)


def handle_divergence(trainer, reason: str, loss: float, grad_norm: float, lr: float, first_draw: int) -> None:
    """A `keel.train.trainer.Trainer`'s answer to a diverged step, by `guard.policy`: stop (raise Diverged, rank 0
    writing the diagnostic) or roll back to the last good checkpoint, skipping this step's batches."""
    c, step = trainer.config.guard, trainer.step + 1
    trainer.log({"step": trainer.step, "event": "divergence", "at_step": step, "reason": reason, "loss": loss,
                 "grad_norm": grad_norm, "lr": lr})
    if c.policy == "rollback" and trainer.rollbacks < c.max_rollbacks:
        bad = set(range(first_draw, trainer.draws))
        rollbacks, skip = trainer.rollbacks + 1, trainer.skip_draws | bad
        lr_scale = trainer.lr_scale * c.rollback_lr_factor
        # as a resume does: past a checkpoint that verifies but does not load (e.g. non-finite weights)
        resume.load_newest(checkpoint.latest_valid(trainer.run_dir), trainer.load_checkpoint,
                           lambda m: trainer.say(m, sys.stderr))
        trainer.rollbacks, trainer.skip_draws, trainer.lr_scale = rollbacks, skip, lr_scale
        if trainer.world.main:  # the steps after the checkpoint are done again: their records go
            trainer.run_dir.truncate_log(trainer.step)
        trainer.t_last, trainer.step_last = time.time(), trainer.step
        trainer.log({"step": trainer.step, "event": "rollback", "reason": reason, "to_step": trainer.step,
                     "skipped_draws": sorted(bad), "lr_scale": lr_scale})
        trainer.say(f"keel: step {step}: {reason}; rolled back to step {trainer.step} "
                    f"({rollbacks}/{c.max_rollbacks}), skipping its batches", file=sys.stderr)
        return
    if c.policy == "rollback":
        reason = f"{reason} (after {trainer.rollbacks} rollbacks)"
    good = checkpoint.list_checkpoints(trainer.run_dir)
    if not trainer.world.main:
        raise Diverged(f"diverged at step {step}: {reason}")
    diagnostic = {"step": step, "reason": reason, "loss": loss, "grad_norm": grad_norm, "lr": lr,
                  "recent_losses": list(trainer.guard.history)[-20:],
                  "last_good_checkpoint": str(good[-1]) if good else None}
    trainer.run_dir.write_diverged(diagnostic)
    raise Diverged(f"diverged at step {step}: {reason}")
