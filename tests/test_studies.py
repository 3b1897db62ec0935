"""Every committed study is a recipe: `keel sweep results/<study>/study.yaml --report-only` rebuilds its report and
results from its committed points without training one, and every number comes out as committed."""

import json
import shutil
from pathlib import Path

import pytest

from keel.cli import main
from keel.cli.experiment import read_study
from keel.experiments import store

RESULTS = Path(__file__).parent.parent / "results"
STUDIES = sorted(p.parent.name for p in RESULTS.glob("*/study.yaml"))


def body(report: Path) -> str:
    """report.md without its "Produced by" command block (the copy's path differs)."""
    text = report.read_text()
    start = text.index("Produced by:")
    end = text.index("```", text.index("```", start) + 3) + 3
    return text[:start] + text[end:]


def numbers(folder: Path) -> str:
    return json.dumps(store.read_results(folder)["results"], sort_keys=True)  # NaN and inf compare as text


def test_every_results_folder_is_a_study_and_nothing_else_runs_it():
    folders = sorted(p.name for p in RESULTS.iterdir() if p.is_dir())
    assert folders == STUDIES
    assert sorted(p.name for p in RESULTS.glob("*.sh")) == []
    for study in STUDIES:
        kind, _ = read_study(str(RESULTS / study / "study.yaml"))
        if (RESULTS / study / "results.json").exists():
            assert kind == store.read_results(RESULTS / study)["experiment"], study


@pytest.mark.slow
@pytest.mark.parametrize("study", STUDIES)
def test_a_committed_study_reproduces_from_its_points_without_training(study, tmp_path, capsys):
    committed = RESULTS / study
    if not (committed / "results.json").exists():
        pytest.skip(f"{study}: no report yet (its first points are running)")
    if store.read_results(committed)["results"].get("status") == "interim":
        pytest.skip(f"{study}: interim, its points are still being added")
    copy = tmp_path / study
    shutil.copytree(committed, copy, ignore=shutil.ignore_patterns("*.png"))
    assert main(["sweep", str(copy / "study.yaml"), "--report-only"]) == 0, capsys.readouterr().err
    assert body(copy / "report.md") == body(committed / "report.md")
    assert numbers(copy) == numbers(committed)
