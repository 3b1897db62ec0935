"""A person's day with Keel, attacked on purpose (issue 22): interrupts at any moment, damaged logs, presets
and summaries that must not mislead. Each test failed on 868f8d0."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keel.cli import main

KEEL = Path(sys.executable).parent / "keel"
ENV = os.environ | {"OMP_NUM_THREADS": "1"}


# ---- interrupts at any moment ---------------------------------------------------------------------------
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_at_any_moment_is_one_line_and_exit_130(tmp_path, signum):
    """Signalled during Python's imports of torch (the first seconds), while a run starts, and mid-training:
    exit 130 and at most a line or two on stderr, never a traceback. A delay that the process outlives
    unsignalled would prove nothing, so each run trains far longer than the test waits."""
    for delay in (0.3, 1.0, 2.5, 6.0):
        proc = subprocess.Popen([str(KEEL), "train", "--preset", "tiny", "run.steps=100000", "run.progress=false",
                                 f"run.out_dir={tmp_path / str(delay)}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        time.sleep(delay)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, (delay, proc.returncode, err[-2000:])
        assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, (delay, err[-2000:])
