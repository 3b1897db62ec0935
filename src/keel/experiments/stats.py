"""The statistics every verdict uses: paired two-sided t-tests, Holm's adjustment, curves compared."""

from __future__ import annotations

import math
import statistics

import numpy as np

ALPHA = 0.05  # the significance level every rule uses


def paired(a: list[float | None], b: list[float | None]) -> dict:
    """Paired two-sided t-test of a - b over the seeds where both are finite: n, the mean and SD of the differences,
    t, p and the 95% CI of the mean. With fewer than 2 pairs, or all differences equal (SD 0), t and p are None: no
    test is possible, which a verdict must read as inconclusive."""
    diffs = [x - y for x, y in zip(a, b) if _finite(x) and _finite(y)]
    n = len(diffs)
    out = {"n": n, "mean": statistics.fmean(diffs) if diffs else float("nan"), "sd": None, "t": None, "p": None,
           "ci95": None}
    if n < 2:
        return out
    sd = statistics.stdev(diffs)
    out["sd"] = sd
    if sd == 0:
        return out
    from scipy import stats  # noqa: PLC0415 (scipy takes a second to import; only verdicts need it)

    se = sd / math.sqrt(n)
    t = out["mean"] / se
    half = stats.t.ppf(1 - ALPHA / 2, n - 1) * se
    out |= {"t": t, "p": float(2 * stats.t.sf(abs(t), n - 1)), "ci95": [out["mean"] - half, out["mean"] + half]}
    return out


def significant(test: dict) -> bool:
    return test["p"] is not None and test["p"] < ALPHA


def verdict(test: dict, lower_is: str, higher_is: str) -> str:
    """`lower_is` when a - b is significantly negative, `higher_is` when significantly positive, else
    "inconclusive"."""
    if not significant(test):
        return "inconclusive"
    return lower_is if test["mean"] < 0 else higher_is


def describe(test: dict, digits: int = 3) -> str:
    """'-0.123 [-0.2, -0.05], p=0.012 (n=3)' for a table cell."""
    if not test["n"]:
        return "-"
    text = f"{test['mean']:+.{digits}f}"
    if test["ci95"] is not None:
        lo, hi = test["ci95"]
        text += f" [{lo:+.{digits}f}, {hi:+.{digits}f}]"
    p = test["p"]
    text += f", p={p:.2g}" if p is not None else ", p=n/a"
    return text + f" (n={test['n']})"


def _finite(v) -> bool:
    return v is not None and math.isfinite(v)


def holm(ps: list[float | None]) -> list[float | None]:
    """Holm-adjusted p-values (step-down, family-wise error at ALPHA), in the order given. A test without a p
    (inconclusive by construction) stays None and is not counted in the family."""
    order = sorted((p, i) for i, p in enumerate(ps) if p is not None)
    m, out, running = len(order), [None] * len(ps), 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))  # adjusted p never falls as raw p rises
        out[i] = running
    return out


def crossing(a, b, steps: list[int], early: float) -> dict:
    """Two arms' curves (arrays, seeds x evaluations at `steps`) by their seed means, d = a - b: d at the first
    evaluation past `early` of the run, "starts_slower" (d > 0; "tie" when |d| is below the larger seed SD there),
    the first evaluation from which d < 0 at every later one (`cross_step`, None: none), and d at the last."""
    tol = np.maximum(*(c.std(0, ddof=1) if len(c) > 1 else 0 * c.mean(0) for c in (a, b)))
    diff = a.mean(0) - b.mean(0)
    first = next(i for i, s in enumerate(steps) if s + 1 >= early * (steps[-1] + 1))
    cross = next((i for i in range(len(steps)) if all(diff[j] < 0 for j in range(i, len(steps)))), None)
    return {"early_step": steps[first], "early_diff": float(diff[first]), "early_tol": float(tol[first]),
            "starts_slower": "tie" if abs(diff[first]) < tol[first] else bool(diff[first] > 0),
            "cross_step": steps[cross] if cross is not None else None, "final_diff": float(diff[-1]),
            "final_tol": float(tol[-1])}
