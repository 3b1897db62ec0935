"""Every committed study is a recipe: `keel sweep results/<study>/study.yaml --report-only` rebuilds its report and
results from its committed points without training one, and every number comes out as committed."""

import json
import shutil
from pathlib import Path

import pytest

from keel.cli import main
from keel.cli.experiment import read_study, study_files
from keel.experiments import store

RESULTS = Path(__file__).parent.parent / "results"
STUDIES = sorted(p.parent.name for p in RESULTS.glob("*/study.yaml"))
DECLARED = sorted(study_files())  # the studies declared as data (keel.experiments.declared)


def body(report: Path) -> str:
    """report.md without its "Produced by" command block (the copy's path differs)."""
    text = report.read_text()
    start = text.index("Produced by:")
    end = text.index("```", text.index("```", start) + 3) + 3
    return text[:start] + text[end:]


def recorded(folder: Path) -> dict:
    """results.json as written, its points named but not read: store.read_results(folder) less the filling-in of
    every point from points/ (seconds for a large study), for what results.json itself says."""
    return json.loads((folder / "results.json").read_text())


def numbers(folder: Path) -> str:
    return json.dumps(store.read_results(folder)["results"], sort_keys=True)  # NaN and inf compare as text


@pytest.mark.slow  # 1.09 s on a core of its own in tests/durations.json (638530e's CI run)
def test_every_results_folder_is_a_study_and_nothing_else_runs_it():
    folders = sorted(p.name for p in RESULTS.iterdir() if p.is_dir())
    assert folders == STUDIES
    assert sorted(p.name for p in RESULTS.glob("*.sh")) == []
    for study in STUDIES:
        if study in DECLARED:  # run by the engine alone, named by its folder
            kind = study
        else:
            kind, _ = read_study(str(RESULTS / study / "study.yaml"))
        if (RESULTS / study / "results.json").exists():
            assert kind == recorded(RESULTS / study)["experiment"], study


@pytest.fixture
def figures_not_rendered(monkeypatch):
    """Each figure is built from the points but not laid out or rendered (half of these tests' CPU seconds):
    this file compares report.md and the numbers, not the PNGs (the copy leaves them out); the figures themselves are
    tests/test_plot_readable.py's and tests/test_experiments.py's."""
    from matplotlib.figure import Figure

    monkeypatch.setattr(Figure, "tight_layout", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: None)


@pytest.mark.slow
@pytest.mark.parametrize("study", STUDIES)
def test_a_committed_study_reproduces_from_its_points_without_training(study, tmp_path, capsys, figures_not_rendered):
    committed = RESULTS / study
    if not (committed / "results.json").exists():
        pytest.skip(f"{study}: no report yet (its first points are running)")
    if recorded(committed)["results"].get("status") == "interim":
        pytest.skip(f"{study}: interim, its points are still being added")
    copy = tmp_path / study
    shutil.copytree(committed, copy, ignore=shutil.ignore_patterns("*.png"))
    assert main(["sweep", str(copy / "study.yaml"), "--report-only"]) == 0, capsys.readouterr().err
    assert body(copy / "report.md") == body(committed / "report.md")
    assert numbers(copy) == numbers(committed)


def rejudge_rows(family: str) -> list[list[str]]:
    """results/rejudge.md's rows of one experiment: [mean [95% CI] (n), p, Holm p within the experiment]."""
    rows = [line.split(" | ") for line in (RESULTS / "rejudge.md").read_text().splitlines()
            if line.startswith("| ") and f" | {family} | " in line]
    return [r[4:7] for r in rows if r[1] == family]


@pytest.mark.parametrize("study", [s for s in DECLARED if rejudge_rows(s)
                                   and "tests" in recorded(RESULTS / s)["results"]])
def test_a_declared_studys_tests_are_the_rows_rejudge_judged_it_by(study):
    """A study moved from code to a study file keeps every number its tests had: each test's mean, 95% interval, n,
    raw p and Holm p (over the study's tests) is its row of results/rejudge.md, which re-judged the same runs before
    the move (test_results_verdicts.py rebuilds those rows from the point files). A study whose rule tests without
    Holm (downstream: its equal-loss pairs and rankings, each at its raw p) has its rows rebuilt there alone."""
    tests = recorded(RESULTS / study)["results"]["tests"]
    ours = [[f"{t['mean']:+.4f}" + ("" if t["ci95"] is None else " [{:+.4f}, {:+.4f}]".format(*t["ci95"]))
             + f" (n={t['n']})", fmt(t["p"]), fmt(t["p_holm"])] for t in tests]
    assert ours == rejudge_rows(study)


def fmt(p):
    return "n/a" if p is None else f"{p:.2g}"
