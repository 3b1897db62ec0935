"""Damaged logs: metrics.jsonl, telemetry.jsonl and summary.json torn, mistyped, binary or replaced by a directory
are skipped with one note by `keel runs`, `keel plot` and resume; the log readers never raise on any lines."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keel.cli import main


# ---- damaged logs -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 4-step tiny run with validation and telemetry, copied by each test before damaging it. Its data
    cache is the module's, so each resumed copy reads the prepared tokens instead of preparing them again."""
    out = tmp_path_factory.mktemp("runs")
    assert main(["train", "--preset", "tiny", "run.steps=4", "run.eval_every=2", "run.telemetry_every=2",
                 "run.progress=false", f"run.out_dir={out}", "run.name=clean", f"data.cache_dir={out / 'cache'}"]) == 0
    return out / "clean"


def _append(name, text):
    return lambda run: (run / name).open("a").write(text)


def _metrics_dir(run):
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()


DAMAGE = {
    "string loss": _append("metrics.jsonl", '{"step": 3, "loss": "nan-ish", "lr": 0.001}\n'),
    "string val_loss": _append("metrics.jsonl", '{"step": 4, "val_loss": "5.1"}\n'),
    "no step": _append("metrics.jsonl", '{"loss": 5.0, "lr": 0.001}\n'),
    "null step": _append("metrics.jsonl", '{"step": null, "loss": 5.0}\n'),
    "string step": _append("metrics.jsonl", '{"step": "3", "loss": 5.0}\n'),
    "list record, then a good one": _append("metrics.jsonl", '[1, 2]\n{"step": 4, "loss": 5.0}\n'),
    "binary line in the middle": _append("metrics.jsonl", '\x00\xff{{\n{"step": 4, "loss": 5.0}\n'),
    "metrics.jsonl is a directory": _metrics_dir,
    "torn summary": lambda run: (run / "summary.json").write_text('{"final_val_loss": 5.'),
    "binary summary": lambda run: (run / "summary.json").write_bytes(b"\x80\x00\xfe"),
    "list summary": lambda run: (run / "summary.json").write_text("[1, 2]"),
    "telemetry without step": _append("telemetry.jsonl", '{"grad_norm": [1.0, 2.0, 3.0, 4.0]}\n'),
    "telemetry scalar": _append("telemetry.jsonl", '{"step": 4, "grad_norm": 3.0}\n'),
    "telemetry string list": _append("telemetry.jsonl", '{"step": 4, "grad_norm": ["a", "b"]}\n'),
}


# one damage also draws the resumed run's curves (the others skip that second plot of the same logs)
DRAWS_AGAIN = ("torn summary",)


@pytest.mark.slow  # the module's tiny run, then a plot and a resumed run per damage: 6 CPU s for the first
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_logs_are_skipped_with_one_note(trained, tmp_path, capsys, monkeypatch, damage):
    """keel runs, keel plot and keel train resume= on a run whose logs were damaged: no traceback; a damaged
    record is skipped with one note naming the file, an unusable file is ignored (runs, plot) or refused in
    one line (resume cannot rewrite a directory)."""
    import shutil

    from keel.train.trainer import Trainer

    if damage not in DRAWS_AGAIN:  # the resumed run's curves are `keel plot`'s figure of the same damaged logs,
        # drawn just before it: one case draws them again, the others skip that second plot
        monkeypatch.setattr(Trainer, "draw_curves", lambda self, quiet=False: None)
    runs = tmp_path / "runs"
    run = runs / "clean"
    shutil.copytree(trained, run)
    DAMAGE[damage](run)
    capsys.readouterr()

    assert main(["runs", str(runs), "--json"]) == 0
    out, err = capsys.readouterr()
    row = json.loads(out)[0]
    assert row["run"] == "clean" and row["steps"] == "4/4"  # the summary's step when the metrics are unusable
    assert len(err.strip().splitlines()) <= 1 and "Traceback" not in err
    notes = err

    assert main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) <= 2 and "Traceback" not in err
    notes += err  # keel runs reads no telemetry; plot does (a note is printed once per process)
    damaged = next((name for name in ("summary.json", "telemetry.jsonl") if name.split(".")[0] in damage),
                   "metrics.jsonl")
    assert notes.count(damaged) == 1, notes

    code = main(["train", f"resume={run}", "run.steps=6", "run.progress=false"])
    err = capsys.readouterr().err
    assert code == (2 if damage == "metrics.jsonl is a directory" else 0), err
    assert len(err.strip().splitlines()) <= 2 and "Traceback" not in err


# ---- the log readers under fuzzed input ------------------------------------------------------------------
_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                   max_size=3), max_leaves=6)
_keys = st.sampled_from(["step", "loss", "val_loss", "lr", "grad_norm", "tokens", "event", "reason", "stream_rms"])
_lines = st.lists(st.one_of(st.dictionaries(_keys, _values, max_size=5).map(json.dumps), _values.map(json.dumps),
                            st.text(max_size=12)), max_size=6)


@pytest.mark.slow  # 80 examples
@settings(max_examples=80, deadline=None)
@given(metrics=_lines, telemetry=_lines, summary=st.one_of(_values.map(json.dumps), st.text(max_size=12)))
def test_log_readers_never_raise_on_any_lines(trained, metrics, telemetry, summary):
    """Whatever the lines of metrics.jsonl / telemetry.jsonl and summary.json hold (any JSON, huge integers,
    NaN, text), the readers return only well-typed records and `keel runs`' row and status never raise."""
    import contextlib
    import io
    import tempfile

    from keel.runs.run_dir import RunDir, latest_run

    with tempfile.TemporaryDirectory() as root, contextlib.redirect_stderr(io.StringIO()):
        run = Path(root) / "fuzzed"
        run.mkdir()
        (run / "config.yaml").write_text((trained / "config.yaml").read_text())
        (run / "metrics.jsonl").write_text("\n".join(metrics))
        (run / "telemetry.jsonl").write_text("\n".join(telemetry))
        (run / "summary.json").write_text(summary)
        r = RunDir.open(run)
        for record in r.metrics() + r.telemetry():
            assert isinstance(record["step"], int) and record["step"] >= 0
        for record in r.metrics():
            assert all(isinstance(v, (int, float, type(None))) or k in ("event", "reason") for k, v in record.items())
        assert r.summary() is None or isinstance(r.summary(), dict)
        row = r.describe()
        assert row["status"] in ("finished", "diverged", "interrupted")
        assert latest_run(root) == r
