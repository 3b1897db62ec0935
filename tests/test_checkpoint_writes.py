"""Writing checkpoints safely: a failing disk is one error and leaves earlier checkpoints intact, and
killed writers' leftovers are cleaned up."""

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from damage import ckpt, same_weights, sharded_run, single_run, small_model
from keel.runs import checkpoint
from keel.runs.checkpoint import CheckpointError


# ---- 1. a failing disk -----------------------------------------------------------------------------
def partial_then(error: BaseException):
    """A writer that gets part of its file onto the disk before failing, as a full disk does (fsync, which
    takes a descriptor, only fails)."""
    def write(obj, f=None, *args, **kwargs):
        if f is not None:
            Path(f).write_bytes(b"\0" * 100)
        raise error
    return write


FAILURES = {  # (what to replace, replacement, what the CheckpointError says)
    "torch.save ENOSPC": ("torch.save", partial_then(OSError(errno.ENOSPC, "No space left on device")),
                          "No space left on device"),
    "torch.save RuntimeError": ("torch.save",
                                partial_then(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos "
                                                          "576 vs 534")), "torch.save failed"),
    "safetensors ENOSPC": ("save_model", partial_then(SafetensorError("Error while serializing: I/O error: No space "
                                                                      "left on device (os error 28)")),
                           "No space left on device"),
    "fsync EIO": ("os.fsync", partial_then(OSError(errno.EIO, "Input/output error")), "Input/output error"),
}


def patch(monkeypatch, target: str, replacement) -> None:
    if target == "save_model":
        monkeypatch.setattr(checkpoint, "save_model", replacement)
    elif target == "torch.save":
        monkeypatch.setattr(torch, "save", replacement)
    else:
        monkeypatch.setattr(os, "fsync", replacement)


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("step", [3, 2], ids=["new-step", "same-step-again"])
def test_a_failing_write_is_one_error_and_damages_nothing(tmp_path, monkeypatch, failure, step):
    run_dir, models = single_run(tmp_path)
    target, replacement, says = FAILURES[failure]
    patch(monkeypatch, target, replacement)
    with pytest.raises(CheckpointError) as raised:
        checkpoint.save(run_dir, step, small_model(7), {"x": torch.arange(3)}, {}, keep=2)
    monkeypatch.undo()
    message = str(raised.value)
    assert message.startswith(f"cannot write checkpoint {ckpt(run_dir, step)}: ") and says in message
    assert "\n" not in message
    assert checkpoint.list_checkpoints(run_dir) == [ckpt(run_dir, 1), ckpt(run_dir, 2)]
    for step_ in (1, 2):
        assert checkpoint.verify(ckpt(run_dir, step_)) is None
        model = small_model(0)
        checkpoint.load(ckpt(run_dir, step_), model)
        assert same_weights(model, models[step_])
    assert sorted(p.name for p in checkpoint.checkpoint_dir(run_dir).iterdir()) == ["step_00000001", "step_00000002"]


def test_a_write_that_fails_on_a_full_disk_says_the_disk_is_full(tmp_path, monkeypatch):
    """torch.save's own message on a full disk ("enforce fail at inline_container.cc ... unexpected pos") does not
    say why; keel adds it when the disk has less room than a checkpoint takes, and only then."""
    run_dir, _ = single_run(tmp_path)
    model = small_model(7)
    need = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    target, replacement, _ = FAILURES["torch.save RuntimeError"]
    for free, full in ((need // 10, True), (need * 10, False)):
        patch(monkeypatch, target, replacement)
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: shutil._ntuple_diskusage(10 * need, 0, free))
        with pytest.raises(CheckpointError) as raised:
            checkpoint.save(run_dir, 3, model, {}, {}, keep=2)
        monkeypatch.undo()
        message = str(raised.value)
        assert ("the disk is full" in message) is full and "\n" not in message
        assert (f"{free / 2**20:.1f} MiB free" in message) is full


def test_a_failing_rename_over_the_same_step_puts_the_old_copy_back(tmp_path, monkeypatch):
    run_dir, models = single_run(tmp_path)
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise OSError(errno.EIO, "Input/output error")
        return real_rename(src, dst)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(CheckpointError, match="step_00000002: Input/output error"):
        checkpoint.save(run_dir, 2, small_model(7), {}, {}, keep=2)
    monkeypatch.undo()
    model = small_model(0)
    checkpoint.load(ckpt(run_dir, 2), model)
    assert same_weights(model, models[2])
    assert not [p for p in checkpoint.checkpoint_dir(run_dir).iterdir() if p.name.startswith(".")]


def test_a_bug_while_writing_keeps_its_traceback_and_still_cleans_up(tmp_path, monkeypatch):
    run_dir, _ = single_run(tmp_path)

    def bug(*args, **kwargs):
        raise TypeError("not an I/O problem")
    monkeypatch.setattr(torch, "save", bug)
    with pytest.raises(TypeError, match="not an I/O problem"):
        checkpoint.save(run_dir, 3, small_model(3), {}, {}, keep=2)
    assert not list(checkpoint.checkpoint_dir(run_dir).glob(".tmp-*"))


@pytest.mark.slow  # a real training run or a subprocess
def test_a_real_write_failure_from_each_library(tmp_path):
    """The libraries' own errors, not imitations: a per-file size limit (RLIMIT_FSIZE) makes the kernel
    refuse the write (EFBIG) in a child process, first in safetensors, then in torch.save."""
    script = textwrap.dedent(f"""
        import json, resource, signal, torch
        from pathlib import Path
        from torch import nn
        from keel.runs import checkpoint
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing us
        run_dir, out = Path({str(tmp_path / 'run')!r}), {{}}
        small = {{"x": torch.zeros(4)}}
        checkpoint.save(run_dir, 1, nn.Linear(4, 4), small, {{}}, keep=5)
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
        big_weights, big_state = (nn.Linear(100, 100), small), (nn.Linear(4, 4), {{"x": torch.zeros(10**5)}})
        for step, (model, state) in {{2: big_weights, 3: big_state}}.items():
            try:
                checkpoint.save(run_dir, step, model, state, {{}}, keep=5)
                out[step] = None
            except checkpoint.CheckpointError as err:
                out[step] = str(err)
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        print(json.dumps(out))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    errors = json.loads(result.stdout)
    run_dir = tmp_path / "run"
    assert errors["2"].startswith(f"cannot write checkpoint {ckpt(run_dir, 2)}: ") and "File too large" in errors["2"]
    assert errors["3"].startswith(f"cannot write checkpoint {ckpt(run_dir, 3)}: torch.save failed")
    assert checkpoint.list_checkpoints(run_dir) == [ckpt(run_dir, 1)] and checkpoint.verify(ckpt(run_dir, 1)) is None
    assert sorted(p.name for p in checkpoint.checkpoint_dir(run_dir).iterdir()) == ["step_00000001"]


@pytest.mark.parametrize("where", ["in DCP", "in state.pt"])
def test_a_failing_sharded_write_is_one_error_and_damages_nothing(tmp_path, monkeypatch, one_rank, where):
    run_dir, models = sharded_run(tmp_path)
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if where == "in DCP" or (isinstance(f, (str, Path)) and Path(f).name == "state.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)
    monkeypatch.setattr(torch, "save", failing_save)
    model = small_model(3)
    with pytest.raises(CheckpointError, match=f"cannot write checkpoint {ckpt(run_dir, 3)}: No space left on device"):
        checkpoint.save_sharded(run_dir, 3, model, torch.optim.AdamW(model.parameters()), {}, {}, keep=2, main=True)
    monkeypatch.undo()
    assert checkpoint.list_checkpoints(run_dir) == [ckpt(run_dir, 1), ckpt(run_dir, 2)]
    assert all(checkpoint.verify(p) is None for p in checkpoint.list_checkpoints(run_dir))
    assert not list(checkpoint.checkpoint_dir(run_dir).glob(".tmp-*"))
    model = small_model(0)
    checkpoint.load(ckpt(run_dir, 2), model)
    assert same_weights(model, models[2])


# ---- 2. leftovers of killed writers ----------------------------------------------------------------
def test_clean_stale_tmp_removes_leftovers_and_puts_back_an_only_copy(tmp_path):
    run_dir, models = single_run(tmp_path, steps=(1, 2, 7))
    root = checkpoint.checkpoint_dir(run_dir)
    (root / ".tmp-step_00000005-4242").mkdir()
    (root / ".tmp-step_00000005-4242" / "model.safetensors").write_bytes(b"half")
    (root / ".tmp-step_00000006-sharded").mkdir()
    (root / ".tmp-step_00000003-1").write_text("a file, not a directory")
    shutil.copytree(ckpt(run_dir, 2), root / ".old-step_00000002-99")  # the rewrite landed: a stale copy
    os.rename(ckpt(run_dir, 7), root / ".old-step_00000007-99")  # killed between the renames: the only copy
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not ours")
    (root / ".tmp-step_00000008-77").symlink_to(outside, target_is_directory=True)
    (root / "notes.txt").write_text("not ours either")

    removed = checkpoint.clean_stale_tmp(run_dir)
    assert sorted(p.name for p in removed) == [".old-step_00000002-99", ".tmp-step_00000003-1",
                                               ".tmp-step_00000005-4242", ".tmp-step_00000006-sharded",
                                               ".tmp-step_00000008-77"]
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt", "step_00000001", "step_00000002", "step_00000007"]
    assert (outside / "keep.txt").exists()
    model = small_model(0)
    checkpoint.load(ckpt(run_dir, 7), model)
    assert same_weights(model, models[7])
    assert checkpoint.clean_stale_tmp(tmp_path / "no-such-run") == []


def test_save_cleans_up_after_a_killed_writer(tmp_path):
    run_dir, _ = single_run(tmp_path, steps=(1,))
    stale = checkpoint.checkpoint_dir(run_dir) / ".tmp-step_00000002-31337"
    stale.mkdir()
    (stale / "state.pt").write_bytes(b"\0" * 1000)
    checkpoint.save(run_dir, 3, small_model(3), {}, {}, keep=5)
    assert not stale.exists()
    assert [p.name for p in checkpoint.list_checkpoints(run_dir)] == ["step_00000001", "step_00000003"]


