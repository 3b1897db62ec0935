"""A study's own fields are checked whole before any point trains: a bad depth, seed list or scheme is one line
naming the field, exit 2, and the output directory stays empty."""

import pytest

from keel.cli import main


@pytest.mark.parametrize("name,override,needle", [
    ("depth", "depths=[3]", "depths: 3 is not a depth in sub-layers"),  # trained 18 points, then KeyError: '3'
    ("depth", "depths=[0]", "depths: 0 is not"),
    ("depth", "depths=[-2]", "depths: -2 is not"),
    ("depth", "depths=[]", "depths: empty"),
    ("depth", "seeds=[]", "seeds: empty"),
    ("depth", "seeds=[0,0]", "seeds: [0, 0] repeats a seed"),
    ("depth", "schemes=[keeel]", "schemes: 'keeel' is not a scheme"),
    ("max-lr", "depths=[0]", "depths: 0 is not"),
    ("depth-sweep", "marginal_seeds=[-1]", "marginal_seeds: -1 is not a seed"),
    ("equal-tuning", "lrs=[0.0]", "lrs: 0.0 is not a learning rate"),
])
def test_a_bad_study_field_is_one_line_before_any_point(name, override, needle, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["experiment", name, "--quick", "--out", str(out), override]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists() or not any(out.rglob("*"))


def test_an_equal_tuning_study_reusing_points_of_another_configuration_is_refused(tmp_path, capsys):
    other = tmp_path / "other" / "points"
    other.mkdir(parents=True)
    (other / "config.json").write_text('{"model": {}, "data": {}, "optim": {}, "guard": {}, "run": {}}')
    assert main(["experiment", "equal-tuning", "--quick", "--out", str(tmp_path / "out"),
                 f"reuse=[{tmp_path / 'other'}]"]) == 2
    err = capsys.readouterr().err
    assert "reuse:" in err and "differ in" in err and err.count("\n") == 1


@pytest.mark.parametrize("content,why", [
    (b"\x00\xff garbage", "damaged point file"), (b"", "damaged point file"), (b"[1, 2]", "not a mapping"),
    (b"[" * 100_000 + b"]" * 100_000, "damaged point file"), (b'{"select_loss": "low"}', "select_loss is str"),
    (b'{"report_loss": ' + b"9" * 5000 + b"}", "damaged point file"),
])
def test_a_damaged_point_file_is_one_line_naming_it(content, why, tmp_path):
    from keel.errors import ConfigError
    from keel.experiments import store

    (tmp_path / "p.json").write_bytes(content)
    with pytest.raises(ConfigError, match=why) as err:
        store.load(tmp_path, "p")
    assert str(tmp_path / "p.json") in str(err.value) and "\n" not in str(err.value)
