"""Plots a person can read at once: curves.png has one x-axis, no empty panels, no blank third and titles that
fit; heatmap columns centred on their steps, a line (not a sliver) for one telemetry record; a quick experiment's
report and figures say they are a smoke test, and its y-limits hold every point."""

import json
import math
import shutil

import pytest
from matplotlib.collections import PathCollection

from keel.cli import main
from keel.cli.experiment import build
from keel.experiments import common
from keel.reporting.plot import build_figure
from keel_studies import frontier

# every test here draws on a trained run or the tiny study's points (module fixtures of 2 to 3 CPU s each), and
# each figure drawn costs about a CPU second: the whole module is in the slow tier (CI)
pytestmark = pytest.mark.slow

TRAIN = ["--preset", "tiny", "run.steps=12", "run.telemetry_every=4", "run.eval_every=1000", "run.progress=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A trained run, and a copy without any validation record (as before its first evaluation), under a
    name long enough to push a heatmap title past its panel if titles were not fitted."""
    root = tmp_path_factory.mktemp("plot")
    assert main(["train", *TRAIN, f"run.out_dir={root}", "run.name=a"]) == 0
    noval = root / "a-run-whose-name-is-long-enough-to-overflow-a-heatmap-title"
    shutil.copytree(root / "a", noval)
    lines = (root / "a" / "metrics.jsonl").read_text().splitlines()
    kept = [line for line in lines if "val_loss" not in json.loads(line)]
    assert len(kept) < len(lines)  # the trained run did evaluate: the copy really loses its validation records
    (noval / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    (noval / "summary.json").unlink()
    bare = root / "no-telemetry"  # the line panels alone: nothing below them to fill the width
    shutil.copytree(root / "a", bare)
    (bare / "telemetry.jsonl").unlink()
    return root / "a", noval, bare


def data_axes(fig):
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


def has_data(ax) -> bool:
    return any(len(line.get_xdata()) for line in ax.lines) or bool(ax.images) or bool(ax.collections)


def test_a_run_without_validation_has_no_empty_panel_and_says_why(runs):
    fig = build_figure([runs[1]])
    assert [ax.get_title() for ax in data_axes(fig) if not has_data(ax)] == []
    assert "validation loss" not in [ax.get_title() for ax in fig.axes]
    assert "no validation loss yet" in fig._suptitle.get_text()


def test_every_panel_is_against_the_step_over_one_range(runs):
    fig = build_figure(list(runs[:2]))
    axes = data_axes(fig)
    assert len(axes) == 4 + 2 * 3  # loss, validation, lr, gradient norm; three heatmaps per run
    assert {ax.get_xlabel() for ax in axes} == {"step"}
    assert len({tuple(round(x, 6) for x in ax.get_xlim()) for ax in axes}) == 1


@pytest.mark.parametrize("which", [0, 1, 2])
def test_the_figure_fills_the_canvas_and_every_title_fits(runs, which):
    fig = build_figure([runs[which]])
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()
    canvas = fig.bbox
    # no blank third on the right: the panels that hold data (with their labels and colour bars) span the width
    drawn = [ax.get_tightbbox(renderer) for ax in fig.axes if has_data(ax) or ax.get_label() == "<colorbar>"]
    left, right = min(b.x0 for b in drawn), max(b.x1 for b in drawn)
    assert right - left >= 0.9 * canvas.width, (left, right, canvas.width)
    for ax in data_axes(fig):
        title = ax.title.get_window_extent(renderer)
        assert canvas.x0 <= title.x0 and title.x1 <= canvas.x1, ax.get_title()
        assert title.width <= ax.get_window_extent(renderer).width * 1.05, ax.get_title()


def _tiny_study(corpus):
    return build("frontier", True, ["model.d_model=16", "model.n_heads=2", "model.n_kv_heads=1", "run.seq_len=16",
                                    "run.batch_size=2", "depths=[2,4]", "lrs={post_ln: [0.01], keel: [0.01]}",
                                    "run.steps=4", "curve_every=2", "seeds=[0]", *corpus])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import argparse
    import inspect

    root = tmp_path_factory.mktemp("text")
    (root / "text.txt").write_text(inspect.getsource(argparse) * 2)
    return [f"data.source={root / 'text.txt'}", f"data.cache_dir={root / 'cache'}"]


@pytest.fixture(scope="module")
def study_points(corpus, tmp_path_factory):
    """The tiny frontier study's points, trained once: each test below copies them and only reports and plots."""
    out = tmp_path_factory.mktemp("frontier")
    frontier.run(_tiny_study(corpus), out, "keel experiment frontier")
    return out / "points"


def _run_study(corpus, points, out, quick: bool, monkeypatch):
    """The frontier study as `keel experiment frontier [--quick]` runs it (on saved `points`); every figure it saves
    is kept."""
    shutil.copytree(points, out / "points")
    figures = []
    real = common.save

    def keep(fig, out, name):
        fig.canvas.draw()
        figures.append((name, fig))
        return real(fig, out, name)

    monkeypatch.setattr(frontier, "save", keep)
    with common.smoke_test(quick):
        frontier.run(_tiny_study(corpus), out, "keel experiment frontier" + (" --quick" if quick else ""))
    return figures


def test_a_quick_report_and_its_figures_say_smoke_test(corpus, study_points, tmp_path, monkeypatch):
    figures = _run_study(corpus, study_points, tmp_path / "quick", True, monkeypatch)
    report = (tmp_path / "quick" / "report.md").read_text()
    assert common.SMOKE_TEST_BANNER in report.splitlines()[0]
    assert figures and all(common.SMOKE_TEST_BANNER in fig._suptitle.get_text() for _, fig in figures)
    curves = dict(figures)["frontier.png"]
    assert all(len(ax.lines) > 1 for ax in curves.axes)  # curves drawn (beside the unigram line), not empty frames
    for name, fig in figures:  # every plotted point lies inside its axes' y-limits
        for ax in fig.axes:
            lo, hi = sorted(ax.get_ylim())
            ys = [y for line in ax.lines if line.get_linestyle() != "None" or line.get_marker() not in ("", "None")
                  for y in line.get_ydata() if math.isfinite(y)]
            for c in ax.collections:  # scatter dots sit at their offsets; bands and error bars are data paths
                points = c.get_offsets() if isinstance(c, PathCollection) else [v for p in c.get_paths()
                                                                                for v in p.vertices]
                ys += [y for _, y in points if math.isfinite(y)]
            if ax.get_yscale() == "log":
                ys = [y for y in ys if y > 0]
            assert all(lo <= y <= hi for y in ys), (name, ax.get_title(), (lo, hi), min(ys), max(ys))


def test_a_full_report_carries_no_banner(corpus, study_points, tmp_path, monkeypatch):
    figures = _run_study(corpus, study_points, tmp_path / "full", False, monkeypatch)
    assert common.SMOKE_TEST_BANNER not in (tmp_path / "full" / "report.md").read_text()
    assert not any(fig._suptitle is not None and common.SMOKE_TEST_BANNER in fig._suptitle.get_text()
                   for _, fig in figures)


# ---- heatmaps of short runs ----------------------------------------------------------------------------------
def test_heatmap_columns_are_centred_on_their_steps(runs):
    images = [im for ax in build_figure([runs[0]]).axes for im in ax.images]
    assert len(images) == 3  # gradient norm, stream RMS, |F| / |alpha x|
    # three columns at steps 4, 8, 12, each 4 steps wide (before: (4, 12), steps 4 and 12 at the columns' edges)
    assert {tuple(im.get_extent()[:2]) for im in images} == {(2.0, 14.0)}


def test_a_run_with_one_telemetry_record_gets_a_line_not_a_sliver_at_step_0(runs, tmp_path):
    short = tmp_path / "short"
    shutil.copytree(runs[0], short)
    first = (short / "telemetry.jsonl").read_text().splitlines()[0]
    (short / "telemetry.jsonl").write_text(first + "\n")
    fig = build_figure([short])
    assert [ax for ax in fig.axes if ax.images] == []
    assert ("short: one telemetry record (step 4), no heatmaps: they need two or more (run.telemetry_every at "
            "most half of run.steps)") in fig._suptitle.get_text().replace("\n", " ")
    assert all(ax.get_xlim()[0] > 0 for ax in fig.axes)  # the curves keep their own range: nothing drawn at 0
