"""`import keel` changes nothing process-wide; the `keel` command sets OpenMP's wait policy and CUDA's allocator for
its own process, each only where the user set none and only while it can take effect (keel.launch)."""

import os
import subprocess
import sys

import pytest
import torch

from keel import launch

ALLOCATOR = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _python(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", *ALLOCATOR)}
    run = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120,
                         env=base | env)
    assert run.returncode == 0, run.stderr[-1500:]
    return run.stdout


@pytest.mark.slow  # over a second in tests/durations.json
def test_import_keel_sets_no_environment_variable():
    code = ("import os, keel\nprint(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'), os.environ.get('OMP_WAIT_POLICY'))\n"
            "keel.TransformerLM  # the model (and torch) loaded on first use: still nothing set\n"
            "print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'), os.environ.get('OMP_WAIT_POLICY'))")
    assert _python(code) == "None None\nNone None\n"


@pytest.mark.slow  # a Python that imports keel's command line
def test_the_keel_command_sets_both_before_torch_loads_and_keeps_what_the_user_chose():
    code = ("import os, sys\nfrom keel import cli\ncli.main(['--version']) if False else None\n"
            "from keel.launch import launcher_environment\nlauncher_environment()\nimport torch\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))")
    assert _python(code) == "passive expandable_segments:True\n"
    assert _python(code, OMP_WAIT_POLICY="active", PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512") == \
        "active max_split_size_mb:512\n"


def test_the_wait_policy_is_left_alone_once_torch_has_loaded(monkeypatch):
    # too late to take effect (OpenMP read it when torch loaded): setting it would only make run.json say what
    # did not happen
    assert "torch" in sys.modules
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    launch.launcher_environment()
    assert "OMP_WAIT_POLICY" not in os.environ


def test_the_allocator_expands_segments_unless_the_user_chose_a_setting_or_cuda_started(monkeypatch):
    for name in ALLOCATOR:
        monkeypatch.delenv(name, raising=False)
    launch.expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    launch.expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    launch.expandable_segments()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the allocator has read its setting
    launch.expandable_segments()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
