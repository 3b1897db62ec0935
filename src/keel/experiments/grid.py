"""Interior optima by construction: a hyperparameter chosen at the edge of its grid is not a choice but a
bound, so the grid grows past that edge (by the factor between the edge and its neighbour) and the arm runs
again, until the choice is interior or `max_extensions` points were added on that side (the bound is reported).

Every sweep that chooses a value on the select half can use it: `extend` says which value to add next, from
the scores of the values run so far; the caller runs the new points (all seeds) and asks again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Grid:
    """One arm's grid as it grows: `values` sorted, `added` the values beyond the starting grid (in the order
    they were added), `bound` set when the choice still lies at an edge that may not grow further."""

    values: list[float]
    max_extensions: int = 2
    added: list[float] = field(default_factory=list)
    bound: str | None = None  # "low" or "high": the choice is at that edge and the bound was reached

    def __post_init__(self):
        self.values = sorted(self.values)
        if len(self.values) < 2:
            raise ValueError("a grid that can grow past its edge needs at least two values")
        self.start = (self.values[0], self.values[-1])

    def extend(self, score: Callable[[float], float]) -> float | None:
        """The next value to run, or None when the choice (lowest score; ties go to the first) is interior or
        at a bound. A score that is not finite (every seed diverged) never wins."""
        best = min(self.values, key=lambda v: _finite(score(v)))
        edge = "low" if best == self.values[0] else "high" if best == self.values[-1] else None
        if edge is None:
            self.bound = None
            return None
        grown = sum((v < self.start[0]) if edge == "low" else (v > self.start[1]) for v in self.added)
        if grown >= self.max_extensions:
            self.bound = edge
            return None
        lo, hi = (self.values[0], self.values[1]) if edge == "low" else (self.values[-2], self.values[-1])
        new = float(f"{(lo * lo / hi if edge == 'low' else hi * hi / lo):.6g}")  # same factor, a stable name
        self.values = sorted([*self.values, new])
        self.added.append(new)
        return new

    def choice(self, score: Callable[[float], float]) -> float:
        return min(self.values, key=lambda v: _finite(score(v)))

    def describe(self) -> dict:
        return {"values": self.values, "added": self.added, "bound": self.bound}


def _finite(v: float | None) -> float:
    return v if v is not None and math.isfinite(v) else math.inf


def grown_note(rule: str, grow: int, grown: list[tuple[str, dict]]) -> str:
    """A report's sentence on grids grown past an edge: `grown` (arm, Grid.describe()) for the arms that grew."""
    each = "; ".join(f"{arm} added {', '.join(f'{v:g}' for v in g['added'])}"
                     + (f" (still at the {g['bound']} edge: a bound)" if g["bound"] else "") for arm, g in grown)
    return (f"Grids grown past an edge choice ({rule}: by the same factor, every seed, until interior or {grow} "
            f"values added on that side): {each or 'none needed'}.")
