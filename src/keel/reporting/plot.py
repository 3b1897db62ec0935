"""`keel plot RUN [RUN ...]`: one PNG comparing runs against the step, and each run's per-sub-layer telemetry as
heatmaps (docs/internals.md#keelreportingplot)."""

from __future__ import annotations

import io
import math
import textwrap
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from keel import safe_io
from keel.reporting.tables import cell, task_scores
from keel.runs.run_dir import RunDir

X_LABEL = "step"
HEATMAPS = (("grad_norm", "gradient norm"), ("stream_rms", "stream RMS after the sub-layer"),
            ("update_ratio", "|F| / |alpha x|"))
MAX_HEATMAP_RUNS = 4
PANEL_WIDTH, PANEL_HEIGHT = 5.0, 3.6  # inches; a row of up to three panels fills 15 inches
WHY_EMPTY = {"val_loss": "no validation loss yet (no evaluation has run)",
             "loss": "no training loss logged yet", "lr": "no learning rate logged yet",
             "grad_norm": "no gradient norm logged yet"}


def _series(records: list[dict], key: str) -> tuple[list, list]:
    points = [(r["step"], r[key]) for r in records if key in r and "step" in r and "event" not in r
              and isinstance(r[key], (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


def _task_series(runs) -> tuple[list, set]:  # [(label, steps, accuracies)] of every task scored, chance levels
    lines, chances = [], set()
    for r in runs:
        series: dict[str, tuple[list, list]] = {}
        for record in r.metrics():
            for name, s in task_scores(record).items():
                if "acc" in s and "step" in record:
                    series.setdefault(name, ([], []))[0].append(record["step"])
                    series[name][1].append(s["acc"])
                    if s.get("chance") is not None:
                        chances.add(s["chance"])
        lines += [(name if len(runs) == 1 else f"{r.name}: {name}", xs, ys) for name, (xs, ys) in series.items()]
    return lines, chances


def _line_panels(runs) -> tuple[list, list[str]]:  # a drawing function per panel with data, a note per one without
    panels, notes, records = [], [], [r.metrics() for r in runs]
    for key, title, log in (("loss", "training loss", False), ("val_loss", "validation loss", False),
                            ("lr", "learning rate", False), ("grad_norm", "gradient norm", True)):
        lines = [(r.name, *_series(rec, key)) for r, rec in zip(runs, records)]
        lines = [line for line in lines if line[1]]
        if not lines:
            notes.append(WHY_EMPTY[key])
            continue

        def draw(ax, lines=lines, key=key, title=title, log=log):
            for label, xs, ys in lines:
                ax.plot(xs, ys, label=label, lw=1.2, marker="o" if key == "val_loss" else None, ms=3)
            ax.set_title(title)
            if log:
                ax.set_yscale("log")
            if len(runs) > 1:
                ax.legend(fontsize=8)
        panels.append(draw)
        if key == "val_loss":
            tasks, chances = _task_series(runs)
            if tasks:
                panels.append(lambda ax, tasks=tasks, chances=chances: _draw_tasks(ax, tasks, chances))
    return panels, notes


def _draw_tasks(ax, tasks, chances) -> None:
    for label, xs, ys in tasks:
        ax.plot(xs, ys, marker="o", ms=3, lw=1.2, label=label)
    for chance in sorted(chances):
        ax.axhline(chance, color="grey", ls=":", lw=1.2)
    ax.set_ylim(0, 1)
    ax.set_title("task accuracy (dotted: chance)")
    ax.legend(fontsize=8)


def _heatmap_panels(r: RunDir, telemetry: list[dict]) -> list:
    steps = [t["step"] for t in telemetry]
    half = (steps[-1] - steps[0]) / (len(steps) - 1) / 2 or 0.5  # each column centred on its step
    panels = []
    for key, title in HEATMAPS:
        grid = [t[key] for t in telemetry if key in t]
        if not grid:
            continue

        def draw(ax, grid=grid, title=title):
            values = [[max(v, 1e-12) for v in column] for column in zip(*grid)]  # (sub-layers, steps)
            image = ax.imshow(values, aspect="auto", origin="lower", norm=LogNorm(), interpolation="nearest",
                              extent=(steps[0] - half, steps[-1] + half, -0.5, len(values) - 0.5))
            ax.figure.colorbar(image, ax=ax)
            ax.set_title(f"{r.name}: {title}", fontsize=9)
            ax.set_ylabel("sub-layer (0 = bottom)")
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        panels.append(draw)
    return panels


def _rows(panels: list, per_row: int = 3) -> list[list]:  # as even as possible: 4 -> 2 + 2, 5 -> 3 + 2
    n_rows = math.ceil(len(panels) / per_row)
    sizes = [len(panels) // n_rows + (i < len(panels) % n_rows) for i in range(n_rows)]
    rows, start = [], 0
    for size in sizes:
        rows.append(panels[start:start + size])
        start += size
    return rows


def build_figure(run_dirs):
    """The comparison figure of `run_dirs` (paths or RunDirs): every axes holds data and is against the step;
    returns the matplotlib Figure (not saved)."""
    runs = [RunDir.open(r) if not isinstance(r, RunDir) else r for r in run_dirs]
    panels, notes = _line_panels(runs)
    rows = _rows(panels)
    for r, telemetry in [(r, t) for r in runs if (t := r.telemetry())][:MAX_HEATMAP_RUNS]:
        if len(telemetry) == 1:
            notes.append(f"{r.name}: one telemetry record (step {telemetry[0]['step']}), no heatmaps: they need "
                         f"two or more (run.telemetry_every at most half of run.steps)")
            continue
        rows += _rows(_heatmap_panels(r, telemetry))
    rows = [row for row in rows if row]
    fig = Figure(figsize=(3 * PANEL_WIDTH, PANEL_HEIGHT * max(1, len(rows)) + 0.4), layout="constrained")
    FigureCanvasAgg(fig)  # without pyplot: importing this module picks no backend for the process
    # six columns, so a row of 1, 2 or 3 panels spans the whole width
    grid, axes = fig.add_gridspec(max(1, len(rows)), 6), []
    for i, row in enumerate(rows):
        span = 6 // len(row)
        for j, draw in enumerate(row):
            ax = fig.add_subplot(grid[i, j * span:(j + 1) * span])
            draw(ax)
            ax.set_xlabel(X_LABEL)
            axes.append(ax)
    if axes:  # one x range for every panel, so a step is at the same place in each
        lo = min(ax.dataLim.x0 for ax in axes)
        hi = max(ax.dataLim.x1 for ax in axes)
        pad = 0.02 * (hi - lo) or 0.5
        for ax in axes:
            ax.set_xlim(lo - pad, hi + pad)
    _fit_titles(fig, axes)
    final = "   ".join(f"{r.name}: final validation loss {_final(r)}" for r in runs)
    title = "\n".join(textwrap.fill(line, 150) for line in [final, *notes])
    fig.suptitle(title, fontsize=9, ha="center")
    return fig


def _fit_titles(fig, axes) -> None:  # wrapped until no wider than its panel (a long run name would run past it)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in axes:
        text, width = ax.get_title(), len(ax.get_title())
        while ax.title.get_window_extent(renderer).width > ax.get_window_extent(renderer).width and width > 8:
            width = int(width * 0.8)
            ax.set_title(textwrap.fill(text, width, break_on_hyphens=False), fontsize=ax.title.get_fontsize())


def _final(r: RunDir) -> str:
    value = (r.summary() or {}).get("final_val_loss")
    return "none yet" if value is None else cell(value)


def plot_runs(run_dirs, out) -> Path:
    """Draw `run_dirs` (paths or RunDirs) into the PNG `out`; returns its path."""
    fig = build_figure(run_dirs)
    out = Path(out)
    png = io.BytesIO()  # drawn in memory, then written without following a link planted at `out`
    fig.savefig(png, dpi=100, format=out.suffix.lstrip(".").lower() or "png")
    safe_io.write_bytes(out.parent, out, png.getvalue())
    return out
