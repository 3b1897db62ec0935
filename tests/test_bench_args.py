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
