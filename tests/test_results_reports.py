"""results/ reads as its numbers run: every committed report's "Produced by" command is its study file run by
`keel sweep`, which parses and merges, with today's command line, to the configuration its points recorded; the
one-minute per-depth table is the depth sweep's results.json. Reads files only;
trains nothing. (Every test and verdict recomputed from the point files: test_results_verdicts.py.)"""

import json
import re
import statistics
from pathlib import Path

import pytest

from keel.experiments import store

RESULTS = Path(__file__).parent.parent / "results"
pytestmark = pytest.mark.skipif(not (RESULTS / "rejudge.py").exists(), reason="no committed results")


def fmt(p: float) -> str:
    """A p-value as results/ prints it."""
    return f"{p:.2g}"


REPORTS = sorted(p.parent.name for p in RESULTS.glob("*/report.md"))


SLOW_REPORTS = {"tuned-alpha"}  # over a CPU second in the fast tier (tests/durations.json)


@pytest.mark.parametrize("folder", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW_REPORTS else f
                                    for f in REPORTS])
def test_a_reports_command_parses_and_merges_to_the_configuration_its_points_recorded(folder, monkeypatch):
    """The "Produced by" command of every committed report, parsed by keel's own command line (keel.cli._main, up
    to the experiment's function, which is replaced here) and passed through the merge (no training), builds the
    configuration the sweep recorded in points/config.json."""
    import shlex
    from dataclasses import asdict

    import keel.cli
    import keel.cli.experiment as experiment_cli
    from keel.experiments import declared
    from keel.experiments.sweep import EXECUTION_FIELDS, _differences, adds_points

    text = (RESULTS / folder / "report.md").read_text()
    command = re.search(r"Produced by:\n\n```bash\n(.*?)\n```", text, re.S).group(1)
    words = shlex.split(command)
    assert words == ["keel", "sweep", f"results/{folder}/study.yaml"], command
    seen = {}

    def merge_only(args):
        doc = experiment_cli.load_study(args.study)
        if experiment_cli.declared_file(doc):  # a study declared as data: what the sweep records is the study as read
            seen["cfg"], seen["kind"] = declared.read(doc, args.study), folder
            return 0
        kind, fields = experiment_cli.read_study(args.study)
        seen["cfg"], seen["kind"] = experiment_cli.build(kind, False, [*fields, *args.overrides]), kind
        return 0

    monkeypatch.setattr(experiment_cli, "cmd_sweep", merge_only)
    assert keel.cli._main(words[1:]) == 0
    cfg = seen["cfg"]
    recorded = json.loads((RESULTS / folder / "points" / "config.json").read_text())
    mine, defaults = json.loads(json.dumps(asdict(cfg))), json.loads(json.dumps(asdict(type(cfg)())))
    assert [k for k in _differences(mine, recorded, defaults) if k not in EXECUTION_FIELDS + adds_points(cfg)] == []
    # a field that only adds points (more seeds, a grid grown further by a rule running now) may have grown since
    # the report was written, never shrunk: the report's points are all still there
    for field in adds_points(cfg):
        if field in mine:
            grown, had = recorded.get(field, defaults[field]), mine[field]
            assert set(had) <= set(grown) if isinstance(had, list) else had <= grown, field
    assert store.read_results(RESULTS / folder)["experiment"] == seen["kind"]


@pytest.mark.slow  # over a second in tests/durations.json
def test_the_one_minute_depth_table_is_the_depth_sweeps_results():
    """Each depth row of the one-minute per-depth table: the scheme with the lowest mean report loss over seeds 0-2
    and Keel's mean, as depth-sweep/results.json has them; a depth the sweep has finished is not left out."""
    names = {"keel": "Keel", "pre_ln": "Pre-LN", "post_ln": "Post-LN", "deepnorm": "DeepNorm"}
    res = store.read_results(RESULTS / "depth-sweep")["results"]
    text = (RESULTS / "README.md").read_text()
    table = text[text.index("| sub-layers | lowest mean report loss | Keel |"):].split("\n\n")[0].splitlines()[2:]
    rows = {r.split(" | ")[0].strip("| "): r.strip("|").split(" | ") for r in table}
    for depth in res["depths_done"]:
        means = {names[s]: statistics.mean(a["report_losses"]) for s, a in res["arms"][str(depth)].items()}
        best = min(means, key=means.get)
        cells = [c.strip() for c in rows[str(depth)]]
        assert cells[1:3] == [f"{best} {means[best]:.3f}", f"{means['Keel']:.3f}"], depth
        for scheme, cell in zip(("pre_ln", "post_ln", "deepnorm"), cells[3:6]):  # Keel - X, its n, p and Holm
            t = next(t for t in res["tests"] if t["id"] == f"{scheme}@{depth}")
            said = re.fullmatch(r"\**([+-]\d\.\d{3})\**(?: \((\d) seeds)?[;(, ]+p=([0-9.e-]+), Holm ([0-9.e-]+)\)",
                                cell)
            assert said, cell
            assert (float(said[1]), int(said[2] or 3), said[3], said[4]) == (
                round(t["test"]["mean"], 3), t["test"]["n"], fmt(t["p"]), fmt(t["p_holm"])), (depth, scheme, cell)
    to_come = len(store.read_results(RESULTS / "depth-sweep")["config"]["depths"]) > len(
        res["depths_done"])
    assert len(rows) == len(res["depths_done"]) + to_come  # and a row for the depths to come, while there are any
