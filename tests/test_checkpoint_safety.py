"""Invalid checkpoints: every one is reported in one line and the next older intact one used, by
`keel eval`, export, a resume and a rollback alike."""

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from damage import Warnings, ckpt, rehash, same_weights, sharded_run, single_run, small_model
from keel.runs import checkpoint, resume
from keel.runs.checkpoint import CheckpointError

# none of these checks curves.png: a test's own in-process runs skip it (the session's trained_run still draws it)
pytestmark = pytest.mark.usefixtures("no_curves")


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
def test_non_finite_weights_fall_back_in_eval_and_export_unless_named(trained_run, tmp_path, capsys, value):
    """As a resume does, eval, generate and export-hf use the next older checkpoint and say why in one line; the
    same checkpoint named with --checkpoint is refused in one line naming its step."""
    from keel.cli import main

    run_dir = shutil.copytree(trained_run, tmp_path / "run")
    newest = ckpt(run_dir, 6)
    rehash(newest, non_finite(newest, value))
    argvs = [["eval", str(run_dir), "--batches", "1", "--device", "cpu", "--json"],
             ["generate", str(run_dir), "--max-new-tokens", "2"]]
    if pytest.importorskip("transformers"):
        argvs.append(["export-hf", str(run_dir), str(tmp_path / "export")])
    for argv in argvs:
        assert main([*argv, "--checkpoint", str(newest)]) == 2, argv
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("keel: error:")]
        assert "Traceback" not in err and len(lines) == 1, err
        assert "(step 6)" in lines[0] and "NaN or inf" in lines[0] and str(newest) in lines[0]
        assert not (tmp_path / "export").exists()
        assert main(argv) == 0, argv
        out, err = capsys.readouterr()
        assert "Traceback" not in err and err.count("\n") == 1, err
        assert f"checkpoint {newest} (step 6)" in err and "NaN or inf; trying an older one" in err
        if argv[0] == "eval":
            assert json.loads(out)["checkpoint"] == str(ckpt(run_dir, 3))


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



@pytest.mark.slow  # over a second in tests/durations.json
def test_a_rollback_falls_back_past_non_finite_weights_as_a_resume_does(args, capsys):
    """guard.policy=rollback: the newest checkpoint (step 6) verifies but holds NaN weights, so the rollback
    after the blow-up at step 8 goes on to step 3 instead of stopping the run."""
    from keel.config import load_config
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


def test_the_weights_read_are_the_file_checked_not_one_swapped_in_after(tmp_path, monkeypatch):
    """The weights' shapes are read from the file checked to be regular, not from whatever its name holds a moment
    later (a FIFO put there would block the reader for ever; here another weights file stands in, so the test
    fails rather than hangs)."""
    from safetensors.torch import save_file

    from keel.runs import untrusted

    run_dir, models = single_run(tmp_path, steps=(1,))
    save_file({"other": torch.zeros(1)}, tmp_path / "other.safetensors")
    checked = untrusted.open_regular

    def check_then_swap(path):
        file = checked(path)
        if Path(path).name == "model.safetensors":
            os.replace(tmp_path / "other.safetensors", path)
        return file

    monkeypatch.setattr(untrusted, "open_regular", check_then_swap)
    shapes = untrusted.weight_shapes(ckpt(run_dir, 1))
    assert shapes == {name: tuple(p.shape) for name, p in models[1].state_dict().items()}
