"""Divergence in a loss curve, by the paper's three criteria, each an explicit rule (Table 1).

The curve is first smoothed with a running median over `window` steps (single noisy batches are not
events). With s_t the smoothed loss and b_t = min(s_0..s_t) the best so far:
  - non-finite: the first non-finite loss.
  - unrecovered spike: the first t with s_t > b_t + spike, after which s never comes back below
    b_t + spike / 2. A spike the loss recovers from is not divergence.
  - stagnation (early plateau): the last step that set a new best by more than `min_improvement`
    is t*, and the curve runs on for at least `patience` more steps without a new best while staying
    within `spike` of it (flat, not a spike): divergence at t*.
    (Under a rising LR a healthy run keeps improving; a plateau means the LR has become too high.)
  - silent degradation: against a reference curve r (same steps, e.g. the best curve of all schemes
    at this depth and seed), the first t >= `burn_in` from which s stays above r_t + `silent` for
    `patience` consecutive steps.
The divergence step is the earliest of these; the maximum tolerable LR is the LR at the step before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class DetectorConfig:
    window: int = 9
    spike: float = 0.5  # nats above the best so far
    min_improvement: float = 0.01  # nats
    patience: int = 50  # steps
    silent: float = 0.5  # nats above the reference
    burn_in: int = 50  # steps before the silent rule applies


def smooth(losses: list[float], window: int) -> list[float]:
    out = []
    for t in range(len(losses)):
        chunk = sorted(losses[max(0, t - window + 1): t + 1])
        out.append(chunk[len(chunk) // 2])
    return out


def detect(losses: list[float], cfg: DetectorConfig, reference: list[float] | None = None) -> tuple[int, str] | None:
    """(divergence step, criterion) or None for a healthy curve."""
    found = []
    bad = next((t for t, v in enumerate(losses) if not math.isfinite(v)), None)
    if bad is not None:
        found.append((bad, "non-finite"))
        losses = losses[:bad]
    if not losses:
        return min(found) if found else None
    s = smooth(losses, cfg.window)
    best = []
    for v in s:
        best.append(min(v, best[-1]) if best else v)

    for t in range(len(s)):
        if s[t] > best[t] + cfg.spike and all(v > best[t] + cfg.spike / 2 for v in s[t:]):
            found.append((t, "unrecovered spike"))
            break

    last_gain, record = 0, s[0]
    for t, v in enumerate(s):
        if v < record - cfg.min_improvement:
            last_gain, record = t, v
    if len(s) - 1 - last_gain >= cfg.patience and max(s[last_gain:]) <= record + cfg.spike:
        found.append((last_gain, "stagnation"))

    if reference is not None:
        r = smooth(reference, cfg.window)
        run = 0
        for t in range(min(len(s), len(r))):
            run = run + 1 if t >= cfg.burn_in and s[t] > r[t] + cfg.silent else 0
            if run >= cfg.patience:
                found.append((t - cfg.patience + 1, "silent degradation"))
                break
    return min(found) if found else None
