"""The `keel` command as a user types it."""

import subprocess
import sys

import pytest

from keel.cli import main


def test_summary_reports_blocks_and_sublayers(capsys):
    assert main(["summary", "--preset", "tiny", "n_blocks=3", "scheme=keel", "alpha=sqrtL"]) == 0
    out = capsys.readouterr().out
    assert "blocks: 3   sub-layers (the paper's L): 6" in out
    assert "alpha=2.44949" in out


def test_bad_override_names_the_field(capsys):
    assert main(["summary", "scheme=pre_ln", "alpha=4"]) == 2
    err = capsys.readouterr().err
    assert "ModelConfig.alpha" in err and err.count("\n") == 1
    assert main(["summary", "n_layers=4"]) == 2
    assert "n_layers" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "keel.cli", "summary", "--preset", "tiny"],
                         capture_output=True, text=True, check=True).stdout
    assert "parameters:" in out


@pytest.mark.slow  # a Python process importing torch
def test_a_reader_that_closes_the_pipe_early_gets_no_traceback():
    # `keel summary | head -1`: the reader is gone before keel prints, as with head on a long table
    proc = subprocess.Popen([sys.executable, "-m", "keel.cli", "summary", "--preset", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and "Traceback" not in err and "BrokenPipe" not in err
