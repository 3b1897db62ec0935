"""Time per sub-layer against depth, Keel and Pre-LN: a step of a deep model should cost no more per sub-layer
than a shallow one's (FLAT_TARGET: within 10% from 128 to 1024 sub-layers), or depth itself costs time.

One training step (forward, backward, clip, AdamW: the TrainStep `keel train` takes) is timed at each depth for
each scheme, one model at a time: each is built, stepped and summarised in a frame of its own and freed before
the next is built (as keel.bench.core's compare does for large models). The whole pass over the depths is
repeated `repeats` times, every other pass deepest first, so a machine whose load drifts does not always favour
the same end of the series; per scheme and depth the median over the passes is kept. Reported: ms per sub-layer,
its ratio to the shallowest depth's, and the largest departure of that ratio from 1 against the 10% target.

Python's garbage collector is watched while the timed steps run (collections by generation and their seconds:
TrainStep turns it off inside a step, so a deep model's tens of thousands of objects are not walked there), and
after each build the number of objects it tracks and the seconds one full collection takes: what a collection
inside a step would cost at that depth.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import Counter
from dataclasses import replace

import torch

from keel.bench.core import Bench, attempt, fresh_compile_state
from keel.config import OptimConfig, RunConfig
from keel.model import ModelConfig
from keel.model.architecture import with_scheme
from keel.runtime import resolve_device

FLAT_SUBLAYERS = (128, 256, 512, 1024)
FLAT_TARGET = 0.10  # largest |ms per sub-layer at a depth / at the shallowest - 1| allowed


class GcWatch:
    """Python's garbage collections while it is entered: how many of each generation, and their seconds."""

    def __init__(self):
        self.collections: Counter = Counter()
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.collections[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def gc_stats() -> dict:
    """The objects Python's collector tracks now, and the seconds one full collection of them takes."""
    start = time.perf_counter()
    gc.collect()
    return {"objects_after_build": len(gc.get_objects()), "full_collect_s": time.perf_counter() - start}


def measure_one(config: ModelConfig, run: RunConfig, steps: int, warmup: int, optim: OptimConfig | None,
                device: torch.device, bench_options: dict) -> dict:
    """One model's median step time over `steps` timed steps after `warmup` untimed ones. Its Bench lives only
    in this frame: nothing of it is left for the next model to sit beside."""
    if run.compile:  # alpha differs at each depth: compile from nothing, well inside Dynamo's recompile limit
        fresh_compile_state()
    b = Bench(config, run, optim, device, **bench_options)
    after_build = gc_stats()
    for _ in range(warmup):
        b.step(record=False)
    with GcWatch() as watch:
        for _ in range(steps):
            b.step()
    step = statistics.median(b.times)
    layers = b.config.n_sublayers  # the sub-layers a step runs (a looped model's unrolled count)
    return {"step_time_s": step, "step_times_s": list(b.times), "ms_per_sublayer": 1e3 * step / layers,
            "peak_memory_bytes": b.peak, "fused_junctions": b.fused,
            "gc": after_build | {"seconds_in_timed_steps": watch.seconds, "collections_in_timed_steps": {
                str(g): c for g, c in sorted(watch.collections.items())}}}


def flatness_series(config: ModelConfig, run: RunConfig, sublayers=FLAT_SUBLAYERS, schemes=("keel", "pre_ln"),
                    steps: int = 5, warmup: int = 1, repeats: int = 1, optim: OptimConfig | None = None,
                    device: torch.device | None = None, deadline: float | None = None, on_row=None,
                    **bench_options) -> dict:
    """Each scheme at each depth (`sublayers`: the paper's L), `repeats` passes; `config` gives the width and
    everything but depth and scheme, `run` the batch, dtype, compile and checkpointing. A scheme that runs out
    of device memory at a depth is not tried deeper; once time.monotonic() passes `deadline` the remaining
    cells are marked skipped. `on_row(summary)` sees the summary so far after every model."""
    device = device or resolve_device(run.device)
    rows, failed = [], {}
    for r in range(repeats):
        for n in (sublayers if r % 2 == 0 else sublayers[::-1]):
            for s in schemes:
                cell = {"repeat": r, "n_sublayers": n, "scheme": s}
                if deadline is not None and time.monotonic() > deadline:
                    rows.append(cell | {"skipped": "time box reached"})
                    continue
                if s in failed and n >= failed[s]:
                    rows.append(cell | {"skipped": f"failed at {failed[s]} sub-layers"})
                    continue
                model = with_scheme(replace(config, n_blocks=n // 2), s)
                out = attempt(lambda model=model: measure_one(model, run, steps, warmup, optim, device,
                                                              bench_options), device)
                if not isinstance(out, dict):
                    failed[s] = min(n, failed.get(s, n))
                rows.append(cell | (out if isinstance(out, dict) else {"failed": out}))
                if on_row is not None:
                    on_row(flatness_summary(rows, sublayers, schemes))
    return flatness_summary(rows, sublayers, schemes)


def flatness_summary(rows: list[dict], sublayers, schemes) -> dict:
    """Per scheme and depth the median step time over the passes that measured it, ms per sub-layer, its ratio
    to the shallowest depth's, the largest departure of that ratio from 1 and whether it is within FLAT_TARGET
    (None until every depth is measured); and Keel/Pre-LN step time at each depth."""
    per_scheme = {}
    for s in schemes:
        step = {}
        for n in sublayers:
            times = [r["step_time_s"] for r in rows if r["scheme"] == s and r["n_sublayers"] == n
                     and "step_time_s" in r]
            if times:
                step[n] = statistics.median(times)
        ms = {n: 1e3 * t / n for n, t in step.items()}
        first = sublayers[0]
        ratio = {n: ms[n] / ms[first] for n in ms} if first in ms else {}
        departure = max((abs(x - 1) for x in ratio.values()), default=None)
        complete = len(ratio) == len(sublayers)
        per_scheme[s] = {"step_time_s": _keyed(step), "ms_per_sublayer": _keyed(ms),
                         "ratio_to_first": _keyed(ratio), "max_departure": departure,
                         "flat": departure <= FLAT_TARGET if complete else None}
    out = {"sublayers": list(sublayers), "schemes": list(schemes), "target_max_departure": FLAT_TARGET,
           "per_scheme": per_scheme, "rows": rows}
    if "keel" in per_scheme and "pre_ln" in per_scheme:
        k, p = per_scheme["keel"]["step_time_s"], per_scheme["pre_ln"]["step_time_s"]
        out["keel_over_pre_ln_step_time"] = {n: k[n] / p[n] for n in k if n in p}
    return out


def _keyed(d: dict) -> dict:
    return {str(k): v for k, v in d.items()}  # JSON's keys are strings: the same dict before and after a dump


def flatness_markdown(summary: dict, title: str) -> list[str]:
    """Lines of a table: ms per sub-layer and its ratio to the shallowest depth's, per scheme."""
    schemes, target = summary["schemes"], summary["target_max_departure"]
    per = summary["per_scheme"]
    lines = [title, "", "| sub-layers | " + " | ".join(f"{s} ms/sub-layer | {s} ratio" for s in schemes)
             + (" | Keel/Pre-LN |" if "keel_over_pre_ln_step_time" in summary else " |"),
             "|---|" + "---|---|" * len(schemes) + ("---|" if "keel_over_pre_ln_step_time" in summary else "")]
    for n in map(str, summary["sublayers"]):
        cells = []
        for s in schemes:
            ms, ratio = per[s]["ms_per_sublayer"].get(n), per[s]["ratio_to_first"].get(n)
            cells += [f"{ms:.3f}" if ms is not None else "-", f"{ratio:.3f}" if ratio is not None else "-"]
        if "keel_over_pre_ln_step_time" in summary:
            kp = summary["keel_over_pre_ln_step_time"].get(n)
            cells.append(f"{kp:.3f}" if kp is not None else "-")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    verdicts = []
    for s in schemes:
        p = per[s]
        if p["max_departure"] is None:
            verdicts.append(f"{s} not measured")
        else:
            state = {True: "met", False: "NOT met", None: "incomplete"}[p["flat"]]
            verdicts.append(f"{s} {p['max_departure']:.1%} ({state})")
    lines += ["", f"Largest departure of ms per sub-layer from the {summary['sublayers'][0]}-sub-layer value "
              f"(target <= {target:.0%}): " + ", ".join(verdicts) + "."]
    failures = [r for r in summary["rows"] if "failed" in r]
    if failures:
        lines.append("Failed: " + ", ".join(f"{r['scheme']} at {r['n_sublayers']} ({r['failed']})"
                                            for r in failures) + ".")
    gc_rows = [r for r in summary["rows"] if "gc" in r]
    if gc_rows:
        deep = max(gc_rows, key=lambda r: r["n_sublayers"])
        shallow = min(gc_rows, key=lambda r: r["n_sublayers"])
        inside = sum(sum(r["gc"]["collections_in_timed_steps"].values()) for r in gc_rows)
        lines.append(f"Garbage collector: {inside} collections inside timed steps in all; a full collection "
                     f"after building took {1e3 * shallow['gc']['full_collect_s']:.0f} ms at "
                     f"{shallow['n_sublayers']} sub-layers ({shallow['gc']['objects_after_build']:,} objects "
                     f"tracked) and {1e3 * deep['gc']['full_collect_s']:.0f} ms at {deep['n_sublayers']} "
                     f"({deep['gc']['objects_after_build']:,}).")
    return lines + [""]
