"""Checkpoints that are hostile, broken or half-written (issue 11): planted pickles never run, every invalid
checkpoint is reported in one line and the next older intact one used, a failing disk leaves earlier
checkpoints intact, and killed writers' leftovers are cleaned up.

A planted pickle is one whose unpickling creates a marker file; each test asserts the marker never appears,
and `test_the_planted_pickle_does_run_when_unpickled` shows that it would if anything unpickled it."""

import errno
import hashlib
import inspect
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch import nn

from keel.train import checkpoint, resume, untrusted
from keel.train.checkpoint import CheckpointError


class Planted:
    """Unpickling this creates the file `marker`: code execution made visible."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def plant(path: Path, marker: Path, as_torch: bool = False) -> None:
    if as_torch:  # what torch.load(weights_only=False) and DCP's byte items would unpickle
        torch.save(Planted(marker), path)
    else:
        path.write_bytes(pickle.dumps(Planted(marker)))


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rehash(ckpt: Path, *names: str) -> None:
    """Make the manifest agree with files changed on purpose, so that only the content is wrong."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest.update({name: sha(ckpt / name) for name in names})
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def small_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def single_run(tmp_path: Path, steps=(1, 2)) -> tuple[Path, dict[int, nn.Module]]:
    """A run directory with single-process checkpoints at `steps`, each of a differently seeded model."""
    run_dir, models = tmp_path / "run", {}
    for step in steps:
        models[step] = small_model(step)
        checkpoint.save(run_dir, step, models[step], {"x": torch.arange(3)}, {"draws": step}, keep=10)
    return run_dir, models


def ckpt(run_dir: Path, step: int) -> Path:
    return checkpoint.checkpoint_dir(run_dir) / f"step_{step:08d}"


@pytest.fixture
def one_rank():
    """A one-process gloo group, enough for DCP's collectives and `save_sharded`."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded_run(tmp_path: Path, steps=(1, 2)) -> tuple[Path, dict[int, nn.Module]]:
    run_dir, models = tmp_path / "run", {}
    for step in steps:
        models[step] = model = small_model(step)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
        checkpoint.save_sharded(run_dir, step, model, optimizer, {"x": torch.arange(3)}, {"draws": step}, keep=10,
                                main=True)
    return run_dir, models


class Warnings(list):
    def __call__(self, message):
        self.append(message)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A real `keel train --preset tiny` run with checkpoints at steps 3 and 6 (copy it before changing it)."""
    import argparse

    from keel.cli import main

    tmp = tmp_path_factory.mktemp("trained")
    (tmp / "corpus.txt").write_text(inspect.getsource(argparse))
    assert main(["train", "--preset", "tiny", f"data.source={tmp / 'corpus.txt'}", f"data.cache_dir={tmp / 'cache'}",
                 f"run.out_dir={tmp / 'runs'}", "run.name=run", "run.steps=6", "run.ckpt_every=3",
                 "run.progress=false"]) == 0
    return tmp / "runs" / "run"


def keel_command() -> list[str]:
    keel = shutil.which("keel", path=os.path.dirname(sys.executable)) or shutil.which("keel")
    return [keel] if keel else [sys.executable, "-m", "keel.cli"]


# ---- 1. code execution from a checkpoint ------------------------------------------------------------
def test_the_planted_pickle_does_run_when_unpickled(tmp_path):
    plant(tmp_path / "p.pkl", tmp_path / "marker")
    pickle.loads((tmp_path / "p.pkl").read_bytes())
    assert (tmp_path / "marker").exists()


def test_the_manifest_names_the_format_and_only_it_decides(tmp_path, one_rank):
    single, saved_single = single_run(tmp_path / "single", steps=(1,))
    sharded, saved_sharded = sharded_run(tmp_path / "sharded", steps=(1,))
    for run_dir, fmt, saved in ((single, "safetensors", saved_single), (sharded, "dcp", saved_sharded)):
        path = ckpt(run_dir, 1)
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["format"] == fmt and checkpoint.is_sharded(path) == (fmt == "dcp")
        del manifest["format"]  # as written before this field: inferred from the files listed
        (path / "manifest.json").write_text(json.dumps(manifest))
        assert checkpoint.is_sharded(path) == (fmt == "dcp") and checkpoint.verify(path) is None
        model = small_model(0)
        checkpoint.load(path, model)
        assert same_weights(model, saved[1]) and not same_weights(model, small_model(0)), fmt


@pytest.mark.parametrize("old_manifest", [False, True], ids=["manifest", "manifest-without-format"])
def test_pickles_planted_in_a_single_process_checkpoint_are_never_parsed(tmp_path, old_manifest):
    run_dir, models = single_run(tmp_path)
    path, marker = ckpt(run_dir, 2), tmp_path / "marker"
    if old_manifest:  # as written before the manifest named its format
        manifest = json.loads((path / "manifest.json").read_text())
        del manifest["format"]
        (path / "manifest.json").write_text(json.dumps(manifest))
    plant(path / ".metadata", marker)
    plant(path / "__0_0.distcp", marker, as_torch=True)
    plant(path / "state.pt.bak", marker, as_torch=True)
    plant(path / "extra.pkl", marker)

    assert not checkpoint.is_sharded(path)
    assert checkpoint.verify(path) is None  # files the manifest does not list are not part of the checkpoint
    assert checkpoint.latest_valid(run_dir) == path
    model = small_model(0)
    state, meta = checkpoint.load(path, model)
    assert same_weights(model, models[2]) and meta == {"step": 2, "draws": 2}
    assert torch.equal(state["x"], torch.arange(3))
    with pytest.raises(CheckpointError, match=f"{path}: not a sharded checkpoint"):
        checkpoint.load_sharded(path, small_model(0))
    checkpoint.export_safetensors(path, small_model(0), tmp_path / "out.safetensors")
    assert not marker.exists()


@pytest.mark.slow  # a real training run or a subprocess
def test_keel_eval_and_resume_ignore_a_planted_metadata(trained_run, tmp_path):
    from keel.cli import main

    run_dir = shutil.copytree(trained_run, tmp_path / "run")
    marker = tmp_path / "marker"
    for path in checkpoint.list_checkpoints(run_dir):
        plant(path / ".metadata", marker)
    out = subprocess.run([*keel_command(), "eval", str(run_dir), "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["checkpoint"].endswith("step_00000006")
    assert main(["train", f"resume={run_dir}", "run.steps=7", "run.progress=false"]) == 0
    assert checkpoint.latest_valid(run_dir).name == "step_00000007"
    assert not marker.exists()


def test_a_pickle_planted_as_dcp_metadata_is_rejected_by_its_checksum(tmp_path, one_rank):
    run_dir, models = sharded_run(tmp_path)
    path, marker = ckpt(run_dir, 2), tmp_path / "marker"
    plant(path / ".metadata", marker)  # manifest left as it was
    assert checkpoint.verify(path) == ".metadata does not match its checksum"
    for load in (checkpoint.load, checkpoint.load_sharded):
        with pytest.raises(CheckpointError, match=f"checkpoint {path}: .metadata does not match its checksum"):
            load(path, small_model(0))
    warned = Warnings()
    assert checkpoint.latest_valid(run_dir, warn=warned) == ckpt(run_dir, 1)
    assert len(warned) == 1 and "step_00000002 is damaged (.metadata does not match" in warned[0]
    model = small_model(0)
    checkpoint.load(ckpt(run_dir, 1), model)
    assert same_weights(model, models[1])
    assert not marker.exists()


def test_a_sharded_checkpoint_with_a_matching_manifest_still_never_unpickles_code(tmp_path, monkeypatch, one_rank):
    """Checksums catch corruption, not a hostile checkpoint whose manifest agrees with it: the DCP
    metadata and the hyper-parameters DCP pickles into its shards must be parsed safely as well."""
    run_dir, _ = sharded_run(tmp_path, steps=(1, 2, 3))
    marker = tmp_path / "marker"
    metadata_path = ckpt(run_dir, 2)
    plant(metadata_path / ".metadata", marker)
    rehash(metadata_path, ".metadata")
    assert "open is not part of DCP metadata" in checkpoint.verify(metadata_path)

    # a pickled value (an optimiser hyper-parameter) pointed at a planted pickle appended to a shard
    shard_path = ckpt(run_dir, 3)
    shard = shard_path / "__0_0.distcp"
    evil = shard_path / "evil"
    plant(evil, marker, as_torch=True)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(evil.read_bytes())
    metadata = pickle.loads((shard_path / ".metadata").read_bytes())  # our own file: safe to unpickle here
    key = next(k for k in metadata.storage_data if k.fqn.endswith("param_groups.0.lr"))
    metadata.storage_data[key].offset, metadata.storage_data[key].length = offset, evil.stat().st_size
    (shard_path / ".metadata").write_bytes(pickle.dumps(metadata))
    evil.unlink()
    rehash(shard_path, ".metadata", "__0_0.distcp")
    problem = checkpoint.verify(shard_path)  # verify parses the pickled values too, weights-only
    assert problem.startswith("__0_0.distcp: optimizer.param_groups.0.lr cannot be read") and "open" in problem

    model = small_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for path in (metadata_path, shard_path):
        with pytest.raises(CheckpointError, match=f"checkpoint {path}: "):
            checkpoint.load_sharded(path, model, optimizer)
    warned = Warnings()
    assert checkpoint.latest_valid(run_dir, warn=warned) == ckpt(run_dir, 1) and len(warned) == 2
    # and should a file change between verify and load, loading itself never unpickles code either
    monkeypatch.setattr(untrusted, "check_shards", lambda *args: None)
    assert checkpoint.verify(shard_path) is None
    with pytest.raises(CheckpointError, match=f"checkpoint {shard_path}: "):
        checkpoint.load_sharded(shard_path, model, optimizer)
    assert not marker.exists()


def escape(metadata) -> None:
    next(iter(metadata.storage_data.values())).relative_path = "../../../outside.distcp"


def past_the_end(metadata) -> None:
    next(iter(metadata.storage_data.values())).offset = 10**9


def no_offset(metadata) -> None:
    del next(iter(metadata.storage_data.values())).offset


def not_a_dict(metadata) -> None:
    metadata.state_dict_metadata = 5


def not_storage_info(metadata) -> None:
    key = next(iter(metadata.storage_data))
    metadata.storage_data[key] = "__0_0.distcp"


@pytest.mark.parametrize("damage", [escape, past_the_end, no_offset, not_a_dict, not_storage_info])
def test_malformed_dcp_metadata_with_a_matching_manifest_is_one_line(tmp_path, one_rank, damage):
    run_dir, models = sharded_run(tmp_path)
    newest = ckpt(run_dir, 2)
    metadata = pickle.loads((newest / ".metadata").read_bytes())  # our own file: safe to unpickle here
    damage(metadata)
    (newest / ".metadata").write_bytes(pickle.dumps(metadata))
    rehash(newest, ".metadata")
    problem = checkpoint.verify(newest)
    assert problem and "\n" not in problem
    warned = Warnings()
    assert checkpoint.latest_valid(run_dir, warn=warned) == ckpt(run_dir, 1) and len(warned) == 1
    with pytest.raises(CheckpointError, match=f"checkpoint {newest}: "):
        checkpoint.load_sharded(newest, small_model(0))


# ---- 2. invalid checkpoints: one line, and the next older intact one -------------------------------
def fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def symlink_elsewhere(path: Path) -> None:
    target = path.parent.parent / "elsewhere.json"
    shutil.copy(path, target)
    path.unlink()
    path.symlink_to(target)


def writes(text: str):
    return lambda path: path.write_text(text)


def wrong_types(path: Path) -> None:
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "state.pt": 5}))


def unknown_format(path: Path) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), "format": "zip"}))


def lists_a_stranger(path: Path) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), "../../x.pkl": "0" * 64}))


@pytest.mark.parametrize("damage", [
    writes("[]"), writes("123"), writes("null"), writes('"step_00000002"'), writes("{"), writes(""), writes("{}"),
    wrong_types, unknown_format, lists_a_stranger, fifo, directory, symlink_elsewhere, Path.unlink,
], ids=["list", "number", "null", "string", "bad-json", "empty", "empty-object", "wrong-types", "unknown-format",
        "unlisted-name", "fifo", "directory", "symlink", "missing"])
def test_an_invalid_manifest_is_one_line_and_the_older_checkpoint_is_used(tmp_path, damage):
    run_dir, models = single_run(tmp_path)
    newest = ckpt(run_dir, 2)
    damage(newest / "manifest.json")
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("reading the checkpoint hung"))
    signal.alarm(30)  # a FIFO opened for reading waits for a writer that never comes
    try:
        problem = checkpoint.verify(newest)
        warned = Warnings()
        found = checkpoint.latest_valid(run_dir, warn=warned)
        with pytest.raises(CheckpointError) as raised:
            checkpoint.load(newest, small_model(0))
        assert not checkpoint.is_sharded(newest)
    finally:
        signal.alarm(0)
    assert problem and "\n" not in problem and "manifest.json" in problem
    assert found == ckpt(run_dir, 1)
    assert len(warned) == 1 and str(newest) in warned[0] and "\n" not in warned[0]
    assert str(newest) in str(raised.value) and "\n" not in str(raised.value)


def bad_safetensors_header(path: Path) -> str:
    data = bytearray((path / "model.safetensors").read_bytes())
    data[8:16] = b'{"a":1 '  # JSON, but not a safetensors header
    (path / "model.safetensors").write_bytes(bytes(data))
    return "model.safetensors"


def huge_header_length(path: Path) -> str:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(b"\xff" * 8 + data[8:])
    return "model.safetensors"


def truncated_weights(path: Path) -> str:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) - 7])
    return "model.safetensors"


def truncated_state(path: Path) -> str:
    data = (path / "state.pt").read_bytes()
    (path / "state.pt").write_bytes(data[: len(data) // 2])
    return "state.pt"


def state_not_a_dict(path: Path) -> str:
    torch.save([1, 2], path / "state.pt")
    return "state.pt"


def meta_not_an_object(path: Path) -> str:
    (path / "meta.json").write_text("[]")
    return "meta.json"


@pytest.mark.parametrize("damage", [bad_safetensors_header, huge_header_length, truncated_weights, truncated_state,
                                    state_not_a_dict, meta_not_an_object])
def test_content_that_matches_its_checksum_but_does_not_parse_is_rejected(tmp_path, damage):
    run_dir, models = single_run(tmp_path)
    newest = ckpt(run_dir, 2)
    damaged = damage(newest)
    rehash(newest, damaged)
    problem = checkpoint.verify(newest)
    assert problem.startswith(f"{damaged} ") and "\n" not in problem
    warned = Warnings()
    assert checkpoint.latest_valid(run_dir, warn=warned) == ckpt(run_dir, 1) and len(warned) == 1
    with pytest.raises(CheckpointError, match=f"checkpoint {newest}: "):
        checkpoint.load(newest, small_model(0))
    model = small_model(0)
    checkpoint.load(checkpoint.latest_valid(run_dir), model)
    assert same_weights(model, models[1])


@pytest.mark.slow  # a real training run or a subprocess
def test_a_resumed_run_falls_back_past_checksummed_but_broken_checkpoints(trained_run, tmp_path, capsys):
    from keel.cli import main

    run_dir = shutil.copytree(trained_run, tmp_path / "run")
    newest = ckpt(run_dir, 6)
    rehash(newest, truncated_state(newest))
    assert main(["train", f"resume={run_dir}", "run.steps=7", "run.progress=false"]) == 0
    err = capsys.readouterr().err
    assert "step_00000006 is damaged (state.pt cannot be read" in err
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "loss" in r and "event" not in r][-4:] == [4, 5, 6, 7]  # redone from 3


def non_finite(path: Path, value: float = float("nan")) -> str:
    """One weight tensor of the checkpoint at `path` set to `value` (checksums not yet updated)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    name = sorted(weights)[len(weights) // 2]
    weights[name] = torch.full_like(weights[name], value)
    save_file(weights, path / "model.safetensors")
    return "model.safetensors"


@pytest.mark.slow  # a real training run
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_weights_are_one_line_naming_the_step_in_eval_and_export(trained_run, tmp_path, capsys, value):
    from keel.cli import main

    run_dir = shutil.copytree(trained_run, tmp_path / "run")
    newest = ckpt(run_dir, 6)
    rehash(newest, non_finite(newest, value))
    argvs = [["eval", str(run_dir), "--batches", "1", "--device", "cpu"], ["generate", str(run_dir),
                                                                             "--max-new-tokens", "2"]]
    if pytest.importorskip("transformers"):
        argvs.append(["export-hf", str(run_dir), str(tmp_path / "export")])
    for argv in argvs:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("keel: error:")]
        assert "Traceback" not in err and len(lines) == 1, err
        assert "(step 6)" in lines[0] and "NaN or inf" in lines[0] and str(newest) in lines[0]
    assert not (tmp_path / "export").exists()


@pytest.mark.slow  # a real training run
def test_a_resumed_run_falls_back_past_non_finite_weights(trained_run, tmp_path, capsys):
    from keel.cli import main

    run_dir = shutil.copytree(trained_run, tmp_path / "run")
    newest = ckpt(run_dir, 6)
    rehash(newest, non_finite(newest))
    assert main(["train", f"resume={run_dir}", "run.steps=7", "run.progress=false"]) == 0
    err = capsys.readouterr().err
    assert f"checkpoint {newest} (step 6): weight" in err and "NaN or inf; trying an older one" in err
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "loss" in r and "event" not in r][-4:] == [4, 5, 6, 7]  # redone from 3


def non_finite_at(run_dir: Path, models: dict, step: int, value: float) -> None:
    from safetensors.torch import save_model

    with torch.no_grad():
        models[step][0].weight.fill_(value)
    save_model(models[step], str(ckpt(run_dir, step) / "model.safetensors"))
    rehash(ckpt(run_dir, step), "model.safetensors")


def test_load_newest_falls_back_only_as_far_as_it_must_and_raises_the_first_error(tmp_path):
    run_dir, models = single_run(tmp_path, steps=(1, 2, 3))
    non_finite_at(run_dir, models, 3, float("nan"))
    non_finite_at(run_dir, models, 2, float("inf"))
    loaded, warned = small_model(0), Warnings()
    assert resume.load_newest(ckpt(run_dir, 3), lambda p: checkpoint.load(p, loaded), warned) == ckpt(run_dir, 1)
    assert same_weights(loaded, models[1])
    assert len(warned) == 2 and "(step 3)" in warned[0] and "(step 2)" in warned[1]
    non_finite_at(run_dir, models, 1, float("nan"))
    with pytest.raises(CheckpointError, match=r"\(step 3\): weight 0.weight holds NaN or inf$"):
        resume.load_newest(ckpt(run_dir, 3), lambda p: checkpoint.load(p, small_model(0)), Warnings())


def test_a_checkpoint_directory_that_is_a_symlink_is_refused(tmp_path):
    run_dir, models = single_run(tmp_path, steps=(1,))
    elsewhere, _ = single_run(tmp_path / "other", steps=(5,))
    link = ckpt(run_dir, 9)
    link.symlink_to(ckpt(elsewhere, 5), target_is_directory=True)
    assert checkpoint.list_checkpoints(run_dir) == [ckpt(run_dir, 1), link]
    assert "symbolic link" in checkpoint.verify(link)
    warned = Warnings()
    assert checkpoint.latest_valid(run_dir, warn=warned) == ckpt(run_dir, 1)
    assert "step_00000009 is damaged" in warned[0] and "symbolic link" in warned[0]
    with pytest.raises(CheckpointError, match=f"checkpoint {link}: is a symbolic link"):
        checkpoint.load(link, small_model(0))
    checkpoint.save(run_dir, 2, small_model(2), {}, {}, keep=1)  # pruning leaves the link and its target alone
    assert link.is_symlink() and checkpoint.verify(ckpt(elsewhere, 5)) is None
    assert checkpoint.list_checkpoints(run_dir) == [ckpt(run_dir, 2), link]


def test_a_listed_file_that_is_a_symlink_or_a_fifo_is_refused(tmp_path):
    run_dir, _ = single_run(tmp_path)
    newest = ckpt(run_dir, 2)
    shutil.copy(newest / "model.safetensors", tmp_path / "weights")
    (newest / "model.safetensors").unlink()
    (newest / "model.safetensors").symlink_to(tmp_path / "weights")
    assert checkpoint.verify(newest) == "model.safetensors is a symbolic link"
    (newest / "model.safetensors").unlink()
    os.mkfifo(newest / "model.safetensors")
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("reading the checkpoint hung"))
    signal.alarm(30)
    try:
        assert checkpoint.verify(newest) == "model.safetensors is not a regular file"
    finally:
        signal.alarm(0)


# ---- 3. a failing disk -----------------------------------------------------------------------------
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
        from keel.train import checkpoint
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


# ---- 4. leftovers of killed writers ----------------------------------------------------------------
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


def test_a_rollback_falls_back_past_non_finite_weights_as_a_resume_does(args, capsys):
    """guard.policy=rollback: the newest checkpoint (step 6) verifies but holds NaN weights, so the rollback
    after the blow-up at step 8 goes on to step 3 instead of stopping the run."""
    from keel.train.config import load_config
    from keel.train.trainer import Trainer

    def spoil_then_blow_up(trainer, step):
        if step == 7:  # after the step-6 checkpoint was written, before the blow-up
            newest = ckpt(trainer.run_dir, 6)
            rehash(newest, non_finite(newest))
        if step == 8 and trainer.rollbacks == 0:
            with torch.no_grad():
                trainer.model.lm_head.weight[0, 0] = float("nan")
    config = load_config(args("guard.policy=rollback", "run.ckpt_every=3", "run.steps=12", "run.progress=false"),
                         preset="tiny")
    trainer = Trainer(config, Path(config.run.out_dir) / config.run.name, [spoil_then_blow_up])
    summary = trainer.run()
    assert not summary["diverged"] and summary["rollbacks"] == 1 and summary["steps"] == 12
    assert "(step 6)" in capsys.readouterr().err
    events = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert next(e for e in events if e.get("event") == "rollback")["to_step"] == 3


@pytest.mark.parametrize("damage", ["betas", "amsgrad", "lr"])
def test_sharded_optimiser_state_of_the_wrong_content_is_refused_at_load(tmp_path, one_rank, damage):
    """A DCP checkpoint whose optimiser state is well-formed for DCP but not what keel's AdamW holds (as a buggy
    writer could leave it): refused in one line at load, as state.pt's is, not a TypeError at the first step."""
    run_dir = tmp_path / "run"
    model = small_model(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    if damage == "betas":
        optimizer.param_groups[0]["betas"] = "0.9, 0.95"
    elif damage == "amsgrad":
        optimizer.param_groups[0]["amsgrad"] = True
    else:
        optimizer.param_groups[0]["lr"] = float("nan")
    checkpoint.save_sharded(run_dir, 1, model, optimizer, {"x": torch.arange(3)}, {"draws": 1}, keep=10, main=True)
    fresh = small_model(2)
    with pytest.raises(CheckpointError, match="sharded optimiser state: optimizer") as raised:
        checkpoint.load_sharded(ckpt(run_dir, 1), fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    assert "\n" not in str(raised.value)
    good_run, _ = sharded_run(tmp_path / "good", steps=(1,))  # an undamaged one still loads: no false refusal
    intact = small_model(3)
    checkpoint.load_sharded(ckpt(good_run, 1), intact, torch.optim.AdamW(intact.parameters(), lr=1e-3))
