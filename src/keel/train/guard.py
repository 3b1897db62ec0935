"""Divergence detection: non-finite values and loss spikes, caught the step they happen."""

from __future__ import annotations

import math
import statistics
from collections import deque

from keel.train.config import GuardConfig


class DivergenceGuard:
    """Judges each step's loss and gradient norm before the optimiser step is taken.

    Spike rule: a loss above `spike_factor` x the median of the last `spike_window` accepted losses, and
    at least `spike_min_rise` nats above it, once `spike_min_history` are known. The median, unlike the mean,
    is not dragged up by one bad step; the absolute floor keeps a model that has memorised its data (loss
    0.03, one batch at 0.1) from being called diverged.
    Ceiling rule (with `vocab_size`): a loss above `loss_ceiling` x ln(vocab_size) from the very first step.
    ln(V) is the loss of a uniform guess, where every run starts; a model that does several times worse has
    blown up, and this catches it before the spike rule has any history (a too-high LR can go from 5 to 50
    to 5000 in the first ten steps).
    """

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
