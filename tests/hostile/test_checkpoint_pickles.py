"""Checkpoints that would run code: a planted pickle is never unpickled, whatever the manifest says
and in whichever format (single-process safetensors + state.pt, or a DCP directory).

A planted pickle is one whose unpickling creates a marker file; each test asserts the marker never appears,
and `test_the_planted_pickle_does_run_when_unpickled` shows that it would if anything unpickled it."""

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from damage import Warnings, ckpt, rehash, same_weights, sharded_run, single_run, small_model
from keel.runs import checkpoint, untrusted
from keel.runs.checkpoint import CheckpointError


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


def keel_command() -> list[str]:
    keel = shutil.which("keel", path=os.path.dirname(sys.executable)) or shutil.which("keel")
    return [keel] if keel else [sys.executable, "-m", "keel.cli"]



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

