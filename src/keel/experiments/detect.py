"""Failure of a run under a rising LR, judged on its validation curve (docs/experiments.md: `detect`)."""

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
    stagnation_gap: float = 0.30  # nats above the best other scheme at the same step
    stagnation_hold: int = 20  # evaluations the gap must hold (at eval_every=2: 40 steps), and a recovery too
    stagnation_recover: float = 0.15  # nats: back within this of the best other scheme = recovered


@dataclass
class Failure:
    index: int  # the evaluation at which it starts
    rule: str  # non-finite | collapse | unrecovered rise | stagnation
    reference: int | None = None  # stagnation: which of the other curves was the best at the onset


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


def stagnation(values: list[float], others: list[list[float]], rules: FailureRules) -> Failure | None:
    """The first stagnation of `values` against `others` (the other schemes' curves at the same evaluation steps,
    each cut where its own failure starts), or None; `values` should be cut at its own failure too."""
    bad = next((k for k, v in enumerate(values) if not math.isfinite(v)), len(values))
    v = smooth(values[:bad], rules.window)
    refs = [smooth([u for u in o[:next((k for k, u in enumerate(o) if not math.isfinite(u)), len(o))]],
                   rules.window) for o in others]
    gaps, best = [], []
    for k, x in enumerate(v):
        alive = [(r[k], i) for i, r in enumerate(refs) if k < len(r)]
        low = min(alive) if alive else None
        best.append(low)
        gaps.append(None if low is None else x - low[0])
    hold = rules.stagnation_hold

    def run_of(k: int, ok) -> bool:
        window = gaps[k:k + hold]
        return len(window) == hold and all(g is not None and ok(g) for g in window)

    k = 0
    while k < len(gaps):
        if not run_of(k, lambda g: g > rules.stagnation_gap):
            k += 1
            continue
        back = next((j for j in range(k + hold, len(gaps)) if run_of(j, lambda g: g <= rules.stagnation_recover)),
                    None)
        if back is None:
            return Failure(max(0, k - rules.window // 2), "stagnation", best[k][1])
        k = back + hold
    return None


def smooth(losses: list[float], window: int) -> list[float]:
    """Trailing running median over `window` points."""
    out = []
    for t in range(len(losses)):
        chunk = sorted(losses[max(0, t - window + 1): t + 1])
        out.append(chunk[len(chunk) // 2])
    return out
