"""Divergence detection: non-finite values and loss spikes, caught the step they happen."""

from __future__ import annotations

import math
import statistics
from collections import deque

from keel.train.config import GuardConfig


class DivergenceGuard:
    """Judges each step's loss and gradient norm before the optimiser step is taken.

    Spike rule: a loss above `spike_factor` x the median of the last `spike_window` accepted losses,
    once `spike_min_history` are known. The median, unlike the mean, is not dragged up by one bad step.
    """

    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.spike_window)

    def check(self, loss: float, grad_norm: float) -> str | None:
        """None if the step is healthy (and then it joins the history), else the reason it is not."""
        if not math.isfinite(loss):
            return f"non-finite loss ({loss})"
        if not math.isfinite(grad_norm):
            return f"non-finite gradient norm ({grad_norm})"
        if self.cfg.spike_min_history and len(self.history) >= self.cfg.spike_min_history:
            median = statistics.median(self.history)
            if loss > self.cfg.spike_factor * median:
                return f"loss spike: {loss:.4g} > {self.cfg.spike_factor:g} x running median {median:.4g}"
        self.history.append(loss)
        return None

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque(state["history"], maxlen=self.cfg.spike_window)
