"""Interior optima by construction: a grid grows past an edge choice until the choice is interior or bound."""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

# An arm's search yields the hyper-parameter tuples it needs next (each to run with every seed) and returns its
# choice; `run_searches` runs what all arms ask for at once.
Search = Generator[list[tuple], None, dict]


@dataclass
class Grid:
    """One arm's grid as it grows: `values` sorted, `added` the values beyond the starting grid (in the order
    they were added), `bound` set when the choice still lies at an edge that may not grow further."""

    values: list[float]
    max_extensions: int = 2
    added: list[float] = field(default_factory=list)
    bound: str | None = None  # "low" or "high": the choice is at that edge and the bound was reached
    # which of equal scores wins ("high": warm-ups, where longer is the cautious side, so a grid whose every mean is
    # +inf grows towards longer warm-ups)
    ties: str = "low"
    # values already run in this grid's place (depth-sweep: the arm's grid a depth before): growth past an edge takes
    # the nearest of them first, keeping their spacing (3.33e-4, 1e-3, 3e-3 grows to 1e-2, not 9e-3)
    known: list[float] = field(default_factory=list)
    # whether a value may run at all: one past it (a beta of 1, an LR above the config's limit) is a bound, not an error
    allowed: Callable[[float], bool] | None = None

    def __post_init__(self):
        if self.ties not in ("low", "high"):
            raise ValueError(f"ties must be 'low' or 'high', got {self.ties!r}")
        self.values = sorted(self.values)
        if len(self.values) < 2:
            raise ValueError("a grid that can grow past its edge needs at least two values")
        self.start = (self.values[0], self.values[-1])

    def extend(self, score: Callable[[float], float]) -> float | None:
        """The next value to run, or None when the choice (lowest score; ties by `ties`) is interior or at a
        bound. A score that is not finite (every seed diverged) never wins over a finite one."""
        best = self.choice(score)
        edge = "low" if best == self.values[0] else "high" if best == self.values[-1] else None
        if edge is None:
            self.bound = None
            return None
        grown = sum((v < self.start[0]) if edge == "low" else (v > self.start[1]) for v in self.added)
        new = self.beyond(edge, grown) if grown < self.max_extensions else None
        if new is None or (self.allowed is not None and not self.allowed(new)):
            self.bound = edge
            return None
        self.values = sorted([*self.values, new])
        self.added.append(new)
        return new

    def beyond(self, edge: str, grown: int) -> float | None:
        """The value past `edge` once `grown` values were added there: the nearest `known` value beyond it, else
        the edge times the factor to its neighbour."""
        past = [k for k in self.known if (k < self.values[0] if edge == "low" else k > self.values[-1])]
        if past:
            return max(past) if edge == "low" else min(past)
        lo, hi = (self.values[0], self.values[1]) if edge == "low" else (self.values[-2], self.values[-1])
        return float(f"{(lo * lo / hi if edge == 'low' else hi * hi / lo):.6g}")  # same factor, a stable name

    def choice(self, score: Callable[[float], float]) -> float:
        return min(self.values if self.ties == "low" else self.values[::-1], key=lambda v: _finite(score(v)))

    def describe(self) -> dict:
        return {"values": self.values, "added": self.added, "bound": self.bound}


@dataclass
class LadderGrid(Grid):
    """A grid that grows past an edge through written-out values (warm-ups: 100 -> 30 -> 10 below) instead of Grid's
    factor, by Grid's rule; a ladder that runs out before `max_extensions` is a bound too."""

    below: list[float] = field(default_factory=list)
    above: list[float] = field(default_factory=list)

    def beyond(self, edge: str, grown: int) -> float | None:
        ladder = self.below if edge == "low" else self.above
        return ladder[grown] if grown < len(ladder) else None


def _finite(v: float | None) -> float:
    return v if v is not None and math.isfinite(v) else math.inf


def search_grid(grid: Grid, hp: Callable[[float], tuple], score: Callable[..., float]) -> Generator:
    """One grid's search: yields the hyper-parameters `hp(value)` to run (the whole grid, then each value it
    grows by) and returns the chosen value; `score(*hp(value))` is the value's mean select-half loss over seeds."""
    yield [hp(v) for v in grid.values]
    while (new := grid.extend(lambda v: score(*hp(v)))) is not None:
        yield [hp(new)]
    return grid.choice(lambda v: score(*hp(v)))


def run_searches(searches: dict, run: Callable[[dict], set | None]) -> dict:
    """Several arms' searches side by side: what every unfinished search asks for goes to `run` ({arm: [hp, ...]})
    at once, so a sweep runs those points together. `run` returns the arms whose points are all done (None: all);
    only those advance, so an arm goes on while another's last point still trains (each choice depends on its own
    points alone). Returns each search's result with the hyper-parameters it asked for ("tried", in order)."""
    asked = {arm: next(search) for arm, search in searches.items()}
    tried, done = {arm: [] for arm in searches}, {}
    while asked:
        finished = run(asked)
        following = {}
        for arm, hps in asked.items():
            if finished is not None and arm not in finished:
                following[arm] = hps
                continue
            tried[arm] += [hp for hp in hps if hp not in tried[arm]]
            try:
                following[arm] = next(searches[arm])
            except StopIteration as stop:
                done[arm] = stop.value | {"tried": tried[arm]}
        asked = following
    return {arm: done[arm] for arm in searches}


def grid_note(g: dict) -> str:
    """"; added ...; bound at the ... edge" for a Grid.describe(), empty for a grid that did not grow."""
    return "".join([f"; added {', '.join(f'{v:g}' for v in g['added'])}" if g["added"] else "",
                    f"; bound at the {g['bound']} edge" if g["bound"] else ""])
