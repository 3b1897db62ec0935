"""`keel bench`'s own flags: a bad --depths or --out is one line, exit 2, before any timing; files are written only
inside --out, never through a link planted there."""

import os

import pytest

from keel.cli import main


def one_line(capsys, needle: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("keel: error: ") and needle in err[0], err


@pytest.mark.parametrize("depths", ["x", "4,,8", "4.5", "-2", "0", "1", "3", f"{2**20}"])
def test_a_bad_depth_list_is_one_line(depths, capsys):
    assert main(["bench", "--preset", "tiny", "--depths", depths]) == 2
    one_line(capsys, "--depths: got")


def test_out_naming_a_file_or_a_device_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("keep")
    for out, needle in [(tmp_path / "file", "exists and is not a directory"), ("/dev/null", "not a directory"),
                        ("/dev/full/x", "cannot make")]:
        assert main(["bench", "--preset", "tiny", "--out", str(out)]) == 2
        one_line(capsys, needle)
    assert (tmp_path / "file").read_text() == "keep"


@pytest.mark.slow  # times a tiny model for one step
def test_bench_never_writes_through_a_planted_link(tmp_path, capsys):
    out, victim = tmp_path / "out", tmp_path / "victim.json"
    out.mkdir()
    victim.write_text("keep")
    os.symlink(victim, out / "bench.json")
    assert main(["bench", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--depths", "",
                 "--out", str(out)]) == 2
    assert "is a symbolic link" in capsys.readouterr().err and victim.read_text() == "keep"
    os.unlink(out / "bench.json")
    assert main(["bench", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--depths", "",
                 "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"bench.json", "bench.md"}


def test_a_depth_or_shape_the_device_cannot_hold_is_refused_by_the_memory_plan(monkeypatch, capsys):
    """Before anything is built: a first depth whose weights, gradients and AdamW state alone exceed the device is
    one line naming it (was: built until the allocator failed); so is a comparison shape whose batch does not fit.
    The device here is made 1 GiB so the sizes stay small; the plan's own figure is checked against
    count_params x 16 bytes (float32 weights, gradients, two moments)."""
    from keel import runtime
    from keel.model import count_params
    from keel.model.sizes import tiny
    from keel.reporting import plan

    monkeypatch.setattr(plan, "device_memory", lambda device: 2**30)
    deep = tiny(n_blocks=4096)
    assert 16 * count_params(deep) > 2**30  # its model states alone do not fit 1 GiB
    assert main(["bench", "--preset", "tiny", "--depths", "8192", "--steps", "1"]) == 2
    one_line(capsys, "--depths 8192, model.d_model: the model's weights, gradients and optimizer state alone")
    assert main(["bench", "--preset", "tiny", "run.batch_size=100000", "--depths", "4", "--steps", "1"]) == 2
    one_line(capsys, "run.batch_size: one training step needs about")
    assert runtime.device_memory is not plan.device_memory  # the real one is untouched
