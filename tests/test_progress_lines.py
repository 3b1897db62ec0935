"""Output that is not a terminal gets a plain progress line at least every PROGRESS_EVERY_S (no tqdm bar, whose
carriage returns leave a log file one long line), and nothing when run.progress is off."""

import re

import pytest

from keel.cli import main
from keel.train import trainer


@pytest.mark.slow  # trains a tiny model
@pytest.mark.parametrize("every,progress,lines", [(0.0, "true", 6), (1e9, "true", 0), (0.0, "false", 0)])
def test_a_log_file_gets_a_line_per_interval(every, progress, lines, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(trainer, "PROGRESS_EVERY_S", every)
    assert main(["train", "--preset", "tiny", "run.steps=6", "run.eval_every=0", f"run.progress={progress}",
                 f"run.out_dir={tmp_path}", "run.name=r"]) == 0
    out = capsys.readouterr().out  # captured: not a terminal
    said = re.findall(r"^step (\d+)/6: loss [0-9.]+, lr [0-9.e+-]+, [0-9,]+ tok/s$", out, re.M)
    assert [int(s) for s in said] == list(range(1, lines + 1)), out
    assert "\r" not in out
