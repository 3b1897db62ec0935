"""`keel plot RUN [RUN ...]`: one PNG comparing runs, and each run's per-sub-layer telemetry as heatmaps.

Top row: training loss against tokens seen (runs overlaid, so runs of different batch sizes line up),
validation loss against step and, for runs that scored `run.eval_tasks`, task accuracy against step (one
line per task, chance dotted); second row: learning rate and gradient norm against step. For every run with
telemetry.jsonl, a row of depth x step heatmaps: per-sub-layer gradient norm, stream RMS and |F| / |alpha x|
(log colour scale; sub-layer 0 at the bottom, as in the paper's figures).
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

from keel import safe_io  # noqa: E402
from keel.train.report import cell, task_scores  # noqa: E402
from keel.train.run_dir import RunDir  # noqa: E402

HEATMAPS = (("grad_norm", "gradient norm of the sub-layer's parameters"), ("stream_rms", "stream RMS after it"),
            ("update_ratio", "|F| / |alpha x|"))
MAX_HEATMAP_RUNS = 4


def _series(records: list[dict], key: str, x: str = "step") -> tuple[list, list]:
    points = [(r[x], r[key]) for r in records if key in r and x in r and "event" not in r
              and isinstance(r[key], (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


def _task_panel(ax, runs) -> bool:
    """Task accuracy against step, one line per task (and run), each chance level dotted; False if no run
    scored tasks."""
    chances, drawn = set(), False
    for r in runs:
        series: dict[str, tuple[list, list]] = {}
        for record in r.metrics():
            for name, s in task_scores(record).items():
                if "acc" in s and "step" in record:
                    series.setdefault(name, ([], []))[0].append(record["step"])
                    series[name][1].append(s["acc"])
                    if s.get("chance") is not None:
                        chances.add(s["chance"])
        for name, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", ms=3, lw=1.2, label=name if len(runs) == 1 else f"{r.name}: {name}")
            drawn = True
    if not drawn:
        return False
    for chance in sorted(chances):
        ax.axhline(chance, color="grey", ls=":", lw=1.2)
    ax.set_ylim(0, 1)
    ax.set_title("task accuracy (dotted: chance)")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    return True


def plot_runs(run_dirs, out) -> Path:
    """Draw `run_dirs` (paths or RunDirs) into the PNG `out`; returns its path."""
    runs = [RunDir.open(r) if not isinstance(r, RunDir) else r for r in run_dirs]
    probed = [r for r in runs if r.telemetry()][:MAX_HEATMAP_RUNS]
    rows = 2 + len(probed)
    fig, axes = plt.subplots(rows, 3, figsize=(15, 3.6 * rows), squeeze=False)
    panels = [(axes[0][0], "loss", "tokens", "training loss"), (axes[0][1], "val_loss", "step", "validation loss"),
              (axes[1][0], "lr", "step", "learning rate"), (axes[1][1], "grad_norm", "step", "gradient norm")]
    for r in runs:
        records, label = r.metrics(), r.name
        for ax, key, x, title in panels:
            xs, ys = _series(records, key, x)
            if xs:
                ax.plot(xs, ys, label=label, lw=1.2, marker="o" if key == "val_loss" else None, ms=3)
            ax.set_title(title)
            ax.set_xlabel("tokens seen" if x == "tokens" else "step")
    axes[1][1].set_yscale("log")
    axes[0][0].legend(fontsize=8)
    if not _task_panel(axes[0][2], runs):
        axes[0][2].axis("off")
    axes[1][2].axis("off")
    summary = [f"{r.name}: {cell((r.summary() or {}).get('final_val_loss'))}" for r in runs]
    axes[1][2].text(0, 1, "final validation loss\n" + "\n".join(summary), va="top", family="monospace", fontsize=8)
    for row, r in enumerate(probed, start=2):
        telemetry = r.telemetry()
        steps = [t["step"] for t in telemetry]
        for col, (key, title) in enumerate(HEATMAPS):
            ax = axes[row][col]
            grid = [t[key] for t in telemetry if key in t]
            if not grid:
                ax.axis("off")
                continue
            values = [[max(v, 1e-12) for v in column] for column in zip(*grid)]  # (sub-layers, steps)
            image = ax.imshow(values, aspect="auto", origin="lower", norm=LogNorm(), interpolation="nearest",
                              extent=(steps[0], steps[-1], -0.5, len(values) - 0.5) if len(steps) > 1 else None)
            fig.colorbar(image, ax=ax)
            ax.set_title(f"{r.name}: {title}", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel("sub-layer (0 = bottom)")
    fig.tight_layout()
    out = Path(out)
    png = io.BytesIO()  # drawn in memory, then written without following a link planted at `out`
    fig.savefig(png, dpi=100, format=out.suffix.lstrip(".").lower() or "png")
    plt.close(fig)
    safe_io.write_bytes(out.parent, out, png.getvalue())
    return out
