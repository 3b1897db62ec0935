"""Failure of a training run under a rising learning rate, judged on a validation curve (paper Table 1).

The curve is the loss on one fixed set of held-out batches, evaluated every few steps while the LR rises
linearly, at steps t_0 < t_1 < ...; v_k is its trailing running median over `window` evaluations (so one
noisy evaluation is not an event; an onset found in v is moved back by window // 2 evaluations, the
median's lag). The rules were written down before any max-lr run:
  - non-finite: the first evaluation (or training step) whose loss is NaN or infinite.
  - collapse: the model has fallen back to the unigram level U (the loss of predicting the training
    split's token frequencies, whatever the input; ~3.29 nats for stdlib bytes). Once the curve has been
    below U - margin, the first evaluation k with v_k >= U - margin, provided every evaluation from k for
    `confirm` evaluations stays there. A run that never gets below U - margin fails at the first
    evaluation that reaches U + margin if it then stays at or above U - margin for `stall` evaluations
    (it stalled at the marginal; `stall` is long so that the plateau every run crosses early is not one).
  - unrecovered rise: the first evaluation k with v_k > b_k + rise, b_k = min(v_0..v_{k-1}) the running
    best, provided the next `confirm` evaluations all stay above b_k + rise / 2 (no recovery).
"Confirm" means: held for `confirm` evaluations, or to the end of the curve if that comes first (and then
for at least 2 evaluations; a single bad point at the very end is not enough). The failure is the
earliest of these; the max tolerable LR is the LR at the last evaluation before it. A healthy curve has
none. The thresholds are fixed in `FailureRules`; the tests measure false-positive and miss rates on noisy
synthetic curves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class FailureRules:
    margin: float = 0.10  # nats: "at the unigram level" means within this of it
    rise: float = 0.30  # nats above the running best
    confirm: int = 20  # evaluations a failure must persist (at eval_every=2: 40 steps)
    window: int = 5  # evaluations in the running median
    stall: int = 100  # evaluations a never-learned run must sit at the unigram level (at eval_every=2: 200 steps)


@dataclass
class Failure:
    index: int  # the evaluation at which it starts
    rule: str  # non-finite | collapse | unrecovered rise


def _held(values: list[float], k: int, ok, confirm: int, final: bool) -> bool:
    window = values[k:k + confirm]
    if len(window) < confirm and not (final and len(window) >= 2):
        return False
    return all(ok(v) for v in window)


def detect(values: list[float], unigram: float, rules: FailureRules, final: bool = True) -> Failure | None:
    """The first failure in the validation curve `values`, or None. `final=False` while the run is still
    going: a failure is then reported only once fully confirmed (the run can stop there)."""
    found = []
    bad = next((k for k, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:
        values = values[:bad]
    hit = _rules(smooth(values, rules.window), unigram, rules, final)
    if hit is not None:
        found.append(Failure(max(0, hit.index - rules.window // 2), hit.rule))
    if bad is not None:
        found.append(Failure(bad, "non-finite"))
    return min(found, key=lambda f: f.index) if found else None


def _rules(values: list[float], unigram: float, rules: FailureRules, final: bool) -> Failure | None:
    found = []
    level = unigram - rules.margin
    learned = next((k for k, v in enumerate(values) if v < level), None)
    if learned is None:
        k = next((k for k, v in enumerate(values) if v <= unigram + rules.margin), None)
        if k is not None and _held(values, k, lambda v: v >= level, rules.stall, final):
            found.append(Failure(k, "collapse"))
    else:
        for k in range(learned + 1, len(values)):
            if values[k] >= level and _held(values, k, lambda v: v >= level, rules.confirm, final):
                found.append(Failure(k, "collapse"))
                break
    best = math.inf
    for k, v in enumerate(values):
        if v > best + rules.rise and _held(values, k + 1, lambda u, b=best: u > b + rules.rise / 2,
                                           rules.confirm - 1, final):
            found.append(Failure(k, "unrecovered rise"))
            break
        best = min(best, v)
    return min(found, key=lambda f: f.index) if found else None


def smooth(losses: list[float], window: int) -> list[float]:
    """Trailing running median over `window` points."""
    out = []
    for t in range(len(losses)):
        chunk = sorted(losses[max(0, t - window + 1): t + 1])
        out.append(chunk[len(chunk) // 2])
    return out
