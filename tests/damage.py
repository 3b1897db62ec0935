"""Helpers for tests that damage a run directory or a checkpoint on purpose, and the one-line refusal they expect."""

import hashlib
import json
import shutil
from pathlib import Path

import torch
from torch import nn

from keel.cli import main
from keel.runs import checkpoint


def refused(capsys, name: str, *argv) -> str:
    """The `keel` command `argv` exits 2 with exactly one `keel: error:` line, naming `name`, and no traceback."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("keel: error:")]
    assert code == 2 and len(lines) == 1 and name in lines[0], err
    return lines[0]


def tiny_run(root: Path, corpus: Path, *overrides: str, evaluate: bool = False) -> Path:
    """`keel train --preset tiny` on `corpus` as the run `base` under `root` (its token cache there too), with
    `overrides`; with `evaluate`, then `keel eval` on one batch (an eval result beside the checkpoints)."""
    run = root / "runs" / "base"
    assert main(["train", "--preset", "tiny", f"data.source={corpus}", f"data.cache_dir={root / 'cache'}",
                 f"run.out_dir={root / 'runs'}", "run.name=base", "run.progress=false", *overrides]) == 0
    if evaluate:
        assert main(["eval", str(run), "--batches", "1", "--device", "cpu"]) == 0
    return run


def victim(trained: Path, tmp_path: Path) -> Path:
    """A copy of the run `trained` to damage (links copied as links), its lock released."""
    copy = tmp_path / "runs" / "victim"
    shutil.copytree(trained, copy, symlinks=True)
    (copy / ".lock").unlink(missing_ok=True)
    return copy


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rehash(ckpt: Path, *names: str) -> None:
    """Make the manifest agree with the files `names`, changed on purpose, so that only their content is wrong."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest.update({name: sha(ckpt / name) for name in names})
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def rechecksum(ckpt: Path) -> None:
    """Rewrite a checkpoint's manifest to match its (edited) files, so damage reaches the loader's content checks
    instead of stopping at the checksum."""
    rehash(ckpt, *[name for name in json.loads((ckpt / "manifest.json").read_text()) if name != "format"])


# ---- small checkpoints written by keel.runs.checkpoint, without a training run ---------------------------------
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

