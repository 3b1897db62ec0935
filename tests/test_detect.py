"""The max-lr failure detector on noisy synthetic validation curves with known answers.

Measured rates (300 curves per family, fixed generator seed; evaluation noise: AR(1), marginal SD 0.01 to
0.05 nats, as on a fixed validation batch set):
  - false positives on healthy curves (decay, decay with a transient excursion up to 1.5 nats that recovers,
    slow upward drift of up to 0.15 nats): 2 / 900 (0.2%);
  - misses on failing curves (collapse to the unigram level, an unrecovered rise of 0.5 to 1.5 nats,
    a NaN), onset after evaluation 150: 0 / 900; the onset is found within 3 evaluations of the truth in
    every detected case.
The tests assert <= 1% for both rates, so a change to the rules that makes them worse fails here.
Limit: with evaluation noise of SD 0.1 nats the false-positive rate is ~80% (the running best is biased low
by the noise); max-lr therefore records the noise of every curve, and verdicts on curves noisier than
0.05 nats are marked unreliable.
"""

import math
import random

import pytest

from keel.experiments.detect import FailureRules, detect

RULES = FailureRules()
U = 3.3  # unigram level
N = 500  # evaluations per curve
TRIALS = 300


def noise(rng: random.Random, n: int, sd: float, rho: float = 0.8) -> list[float]:
    out, e = [], 0.0
    innov = sd * math.sqrt(1 - rho * rho)
    for _ in range(n):
        e = rho * e + rng.gauss(0, innov)
        out.append(e)
    return out


def healthy(rng: random.Random) -> list[float]:
    floor, tau, sd = rng.uniform(1.8, 2.8), rng.uniform(10, 80), rng.uniform(0.01, 0.05)
    base = [floor + (5.5 - floor) * math.exp(-k / tau) for k in range(N)]
    kind = rng.choice(["plain", "excursion", "drift"])
    if kind == "excursion":  # a spike the curve recovers from within the confirmation window
        k0, length, height = rng.randrange(100, N - 60), rng.randrange(2, RULES.confirm - 2), rng.uniform(0.4, 1.5)
        base = [b + (height if k0 <= k < k0 + length else 0.0) for k, b in enumerate(base)]
    elif kind == "drift":  # slow degradation at high LR, smaller than the rise threshold
        rise = rng.uniform(0.0, 0.15)
        base = [b + rise * max(0, k - 250) / 250 for k, b in enumerate(base)]
    return [b + e for b, e in zip(base, noise(rng, N, sd))]


def failing(rng: random.Random) -> tuple[list[float], int, str]:
    curve = healthy_plain(rng)
    k0, kind = rng.randrange(150, N - 40), rng.choice(["collapse", "unrecovered rise", "non-finite"])
    sd = rng.uniform(0.01, 0.05)
    tail = noise(rng, N - k0, sd)
    if kind == "collapse":
        curve[k0:] = [U + rng.uniform(-0.05, 0.3) + e for e in tail]
    elif kind == "unrecovered rise":
        jump = rng.uniform(0.5, 1.5)
        best = min(curve[:k0])
        curve[k0:] = [best + jump + e for e in tail]
    else:
        curve[k0] = float("nan")
    return curve, k0, kind


def healthy_plain(rng: random.Random) -> list[float]:
    floor, tau, sd = rng.uniform(1.8, 2.8), rng.uniform(10, 50), rng.uniform(0.01, 0.05)
    return [floor + (5.5 - floor) * math.exp(-k / tau) + e for k, e in enumerate(noise(rng, N, sd))]


@pytest.mark.slow
def test_false_positive_rate_on_noisy_healthy_curves():
    rng = random.Random(0)
    flagged = sum(detect(healthy(rng), U, RULES) is not None for _ in range(3 * TRIALS))
    assert flagged / (3 * TRIALS) <= 0.01, f"false positives {flagged}/{3 * TRIALS}"


@pytest.mark.slow
def test_miss_rate_and_onset_on_noisy_failing_curves():
    rng = random.Random(1)
    missed, late = 0, []
    for _ in range(3 * TRIALS):
        curve, k0, kind = failing(rng)
        hit = detect(curve, U, RULES)
        if hit is None:
            missed += 1
            continue
        late.append(abs(hit.index - k0))
    assert missed / (3 * TRIALS) <= 0.01, f"missed {missed}/{3 * TRIALS}"
    assert max(late) <= 3, sorted(late)[-10:]


def test_clean_curves():
    decay = [2.0 + 3.5 * math.exp(-k / 30) for k in range(200)]
    assert detect(decay, U, RULES) is None
    collapsed = decay[:100] + [U + 0.1] * 100
    assert detect(collapsed, U, RULES).rule == "collapse"
    assert abs(detect(collapsed, U, RULES).index - 100) <= 1
    risen = decay[:120] + [decay[119] + 0.6] * 80
    hit = detect(risen, U, RULES)
    assert hit.rule == "unrecovered rise" and abs(hit.index - 120) <= 1
    nan = decay[:50] + [float("nan")]
    assert (detect(nan, U, RULES).index, detect(nan, U, RULES).rule) == (50, "non-finite")


def test_a_run_in_progress_is_flagged_only_once_confirmed():
    decay = [2.0 + 3.5 * math.exp(-k / 30) for k in range(100)]
    started = decay + [U + 0.1] * 5
    assert detect(started, U, RULES, final=False) is None  # could still recover
    assert detect(started, U, RULES, final=True) is not None  # the run ended there: judged as it stands
    assert detect(decay + [U + 0.1] * (RULES.confirm + RULES.window), U, RULES, final=False).rule == "collapse"


def test_a_run_that_never_learns_fails_only_after_a_long_stall():
    plateau = [5.5 - 0.2 * k for k in range(12)] + [U + 0.05] * 60 + [2.5] * 100  # the early plateau, then learns
    assert detect(plateau, U, RULES) is None
    stuck = [5.5 - 0.2 * k for k in range(12)] + [U + 0.05] * (RULES.stall + 10)
    assert detect(stuck, U, RULES).rule == "collapse"
