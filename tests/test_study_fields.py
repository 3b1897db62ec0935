"""A study's own fields are checked whole before any point trains: a bad depth, seed list or scheme is one line
naming the field, exit 2, and the output directory stays empty."""

import gzip
import shutil
from pathlib import Path

import pytest
import yaml

from keel.cli import main

DEPTH = Path(__file__).parent.parent / "results" / "depth" / "study.yaml"


@pytest.mark.parametrize("name,override,needle", [
    # a study file's fields are in the file: an override is refused, not half applied
    ("depth", "depths=[3]", "depth: depths: not used here (the study's fields are in its file"),
    ("max-lr", "depths=[0]", "max-lr: depths: not used here (the study's fields are in its file"),
    ("depth-sweep", "marginal_seeds=[-1]", "marginal_seeds: -1 is not a seed"),
    ("equal-tuning", "lrs=[0.0]", "lrs: 0.0 is not a learning rate"),
])
def test_a_bad_study_field_is_one_line_before_any_point(name, override, needle, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["experiment", name, "--quick", "--out", str(out), override]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists() or not any(out.rglob("*"))


@pytest.mark.parametrize("edit,needle", [
    # the depth study's bad values, made the way a user now makes them: in a copy of its study file
    (lambda d: d["arms"]["keel_8"].update({"model.n_blocks": 0}), "arms.keel_8: ModelConfig.n_blocks: got 0"),
    (lambda d: d["arms"]["keel_8"].update({"model.n_blocks": -2}), "arms.keel_8: ModelConfig.n_blocks: got -2"),
    (lambda d: d.update(arms={"keel_8": d["arms"]["keel_8"]}), "arms: at least two arms"),
    (lambda d: d.update(seeds=[]), "seeds: empty"),
    (lambda d: d.update(seeds=[0, 0]), "seeds: distinct integers"),
    (lambda d: d["arms"]["keel_8"].update({"model.scheme": "keeel"}), "arms.keel_8: ModelConfig.scheme: unknown"),
])
def test_a_bad_value_in_a_copied_study_file_is_one_line_before_any_point(edit, needle, tmp_path, capsys):
    copy = tmp_path / "depth" / "study.yaml"
    copy.parent.mkdir()
    shutil.copy(DEPTH, copy)
    doc = yaml.safe_load(copy.read_text())
    edit(doc)
    copy.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert main(["sweep", str(copy)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in copy.parent.iterdir()) == ["study.yaml"]


def test_an_equal_tuning_study_reusing_points_of_another_configuration_is_refused(tmp_path, capsys):
    other = tmp_path / "other" / "points"
    other.mkdir(parents=True)
    (other / "config.json").write_text('{"model": {}, "data": {}, "optim": {}, "guard": {}, "run": {}}')
    assert main(["experiment", "equal-tuning", "--quick", "--out", str(tmp_path / "out"),
                 f"reuse=[{tmp_path / 'other'}]"]) == 2
    err = capsys.readouterr().err
    assert "reuse:" in err and "differ in" in err and err.count("\n") == 1


def test_equal_tuning_reuses_points_recorded_before_a_field_was_added_while_that_field_holds_its_default(tmp_path):
    """A point recorded before data.streaming existed is the run it would be today with streaming off; with the field
    recorded at another value it is refused, naming the section."""
    import json
    from dataclasses import asdict

    from keel.errors import ConfigError
    from keel_studies.equal_tuning import EqualTuningConfig, _reusable_config

    cfg = EqualTuningConfig.quick()
    recorded = json.loads(json.dumps(asdict(cfg)))
    del recorded["data"]["streaming"]
    (tmp_path / "points").mkdir()
    (tmp_path / "points" / "config.json").write_text(json.dumps(recorded))
    assert _reusable_config(cfg, tmp_path) == tmp_path / "points"
    recorded["data"]["streaming"] = True
    (tmp_path / "points" / "config.json").write_text(json.dumps(recorded))
    with pytest.raises(ConfigError, match="differ in data;"):
        _reusable_config(cfg, tmp_path)


@pytest.mark.parametrize("content,why", [
    (b"\x00\xff garbage", "damaged point file"), (gzip.compress(b"\x00\xff"), "damaged point file"),
    (gzip.compress(b""), "damaged point file"), (gzip.compress(b"[1, 2]"), "not a mapping"),
    (gzip.compress(b"[" * 100_000 + b"]" * 100_000), "damaged point file"),
    (gzip.compress(b'{"select_loss": "low"}'), "select_loss is str"),
    (gzip.compress(b'{"report_loss": ' + b"9" * 5000 + b"}"), "damaged point file"),
], ids=["not-gzip", "gzip-of-binary", "empty", "list", "nested-deep", "loss-as-text", "huge-number"])
def test_a_damaged_point_file_is_one_line_naming_it(content, why, tmp_path):
    from keel.errors import ConfigError
    from keel.experiments import store

    (tmp_path / "p.json.gz").write_bytes(content)
    with pytest.raises(ConfigError, match=why) as err:
        store.load(tmp_path, "p")
    assert str(tmp_path / "p.json.gz") in str(err.value) and "\n" not in str(err.value)
