"""Containment (issue 25): every command reads, writes and deletes only inside the run directory it is given.

The walk: each entry of a small trained run directory in turn (every file and directory in it, and a few that a
hostile one could add) is replaced by a symlink into an outside canary tree, which holds a working copy of the
entry (so following the link would succeed and show), and every command runs on the result. Each must exit 0 or
2 without a traceback, and the canary tree must stay as it was (bytes, mtimes, listing), must not be opened
(an audit hook sees every file Python opens), and must not be copied into an output (its files carry a marker).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from damage import tiny_run
from keel.cli import main

MARK = "CANARY-7f3a"
STEP = "step_00000002"
CKPT = f"checkpoints/{STEP}"
# every entry the trained run holds (test_the_walk_covers_every_entry checks), then ones a hostile run adds
ENTRIES = [".lock", "config.yaml", ".config.sig", "run.json", "metrics.jsonl", "telemetry.jsonl", "summary.json",
           "curves.png", f"eval-{STEP}-val.json", "tokenizer", "tokenizer/tokenizer_config.json", "checkpoints", CKPT,
           f"{CKPT}/model.safetensors", f"{CKPT}/state.pt", f"{CKPT}/meta.json", f"{CKPT}/manifest.json"]
ADDED = ["diverged.json", "tokenizer/tokenizer.json", "checkpoints/step_00000009", "checkpoints/.tmp-step_00000009-1",
         "checkpoints/.old-step_00000009-1", "tensorboard"]


def commands(run: Path, out: Path) -> dict[str, list]:
    return {"runs": ["runs", run.parent, "--json"], "plot": ["plot", run], "summary": ["summary", run],
            "eval": ["eval", run, "--batches", "1", "--device", "cpu"],
            "generate": ["generate", run, "--max-new-tokens", "3"],
            "export-hf": ["export-hf", run, out / "export"],
            "resume": ["train", f"resume={run}", "run.steps=3", "run.progress=false"]}


COMMANDS = list(commands(Path("r"), Path("o")))
FAST = {"runs", "summary"}  # the rest train, evaluate or draw: the slow tier


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """A tiny run trained for 2 steps with telemetry, then evaluated: every kind of file a run holds."""
    return tiny_run(tmp_path_factory.mktemp("trained"), corpus, "run.steps=2", "run.ckpt_every=2", "run.eval_every=2",
                    "run.telemetry_every=1", evaluate=True)


def _mark(path: Path) -> None:
    """Make a canary file distinguishable from the run's own copy, keeping it valid."""
    if path.name == "config.yaml":
        path.write_text(path.read_text() + f"# {MARK}\n")
    elif path.name == "metrics.jsonl":
        path.write_text(path.read_text() + json.dumps({"step": 0, "event": MARK}) + "\n")
    elif path.suffix == ".json" and path.name != "manifest.json":
        value = json.loads(path.read_text())
        value["canary"] = MARK
        if isinstance(value.get("data"), dict):  # run.json: what a model card shows
            value["data"]["kind"] = MARK
        path.write_text(json.dumps(value, indent=1))


@pytest.fixture
def canary(trained, tmp_path) -> Path:
    """An outside tree: a marked, working copy of the trained run (checksums made to match), plus targets for
    the entries a hostile run adds."""
    from keel.hf.export import byte_tokenizer

    root = tmp_path / "canary"
    shutil.copytree(trained, root)
    for path in root.rglob("*"):
        if path.is_file():
            _mark(path)
    ckpt = root / CKPT
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest.update({name: hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
                     for name in manifest if name != "format"})
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    (root / "diverged.json").write_text(json.dumps({"reason": MARK}))
    tokenizer = json.loads(byte_tokenizer().to_str())
    tokenizer["normalizer"] = {"type": "Replace", "pattern": {"String": MARK}, "content": "x"}  # valid, marked
    (root / "tokenizer" / "tokenizer.json").write_text(json.dumps(tokenizer))
    shutil.copytree(ckpt, root / "checkpoints" / "step_00000009")
    shutil.copytree(ckpt, root / "checkpoints" / ".tmp-step_00000009-1")
    shutil.copytree(ckpt, root / "checkpoints" / ".old-step_00000009-1")  # what a resume would put back
    (root / "tensorboard").mkdir()
    return root


def snapshot(root: Path) -> dict:
    """Every entry under `root`: a file's bytes and mtime, a directory's listing."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_symlink():
            out[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            out[rel] = ("dir", sorted(p.name for p in path.iterdir()))
        else:
            out[rel] = ("file", path.read_bytes(), path.stat().st_mtime_ns)
    return out


class Opens:
    """Every path Python opens (builtins.open, os.open, ...) while `active`, seen through an audit hook (which
    cannot be removed, so one is installed per process and switched on and off). Files that native code
    opens itself (safetensors, tokenizers) are not seen: the snapshot and the copy check cover those."""

    active: list | None = None

    @classmethod
    def hook(cls, event, args):
        if cls.active is None or event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path, flags = os.fsdecode(args[0]), args[2] if isinstance(args[2], int) else 0
        if flags & os.O_NOFOLLOW:  # the link itself is not followed: only the directories above it count
            resolved = Path(os.path.realpath(os.path.dirname(path) or ".")) / os.path.basename(path)
        else:
            resolved = Path(os.path.realpath(path))
        cls.active.append(resolved)


if not hasattr(sys, "_keel_containment_hook"):
    sys.addaudithook(Opens.hook)
    sys._keel_containment_hook = True


def run_command(argv: list, canary: Path, capsys) -> tuple[int, str, str]:
    """`keel argv` in this process; returns (exit code, stdout, stderr) and asserts no file under `canary` was
    opened."""
    Opens.active = []
    try:
        code = main([str(a) for a in argv])
    finally:
        opened, Opens.active = Opens.active, None
    out, err = capsys.readouterr()
    inside = [p for p in opened if p.is_relative_to(canary.resolve())]
    assert not inside, f"opened outside the run directory: {inside[:3]}\n{err}"
    return code, out, err


@pytest.fixture
def victim(trained, tmp_path) -> Path:
    copy = tmp_path / "runs" / "victim"
    shutil.copytree(trained, copy, symlinks=True)
    return copy


def replace_by_link(run: Path, entry: str, canary: Path) -> None:
    path = run / entry
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.symlink_to(canary / entry, target_is_directory=(canary / entry).is_dir())


def test_the_walk_covers_every_entry(trained):
    present = {str(p.relative_to(trained)) for p in trained.rglob("*")}
    assert present <= set(ENTRIES), sorted(present - set(ENTRIES))
    assert set(ENTRIES) <= present  # a name that no run holds would walk nothing


@pytest.mark.parametrize("command", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in COMMANDS])
def test_every_command_succeeds_on_the_run_before_any_link(command, victim, canary, tmp_path, capsys):
    """The control for the walk below: on the untouched copy every command does its job (exit 0), so an exit 2 there
    is the command refusing the link, not a command that fails on any run."""
    code, out, err = run_command(commands(victim, tmp_path)[command], canary, capsys)
    assert code == 0, err


def _walk(entry: str, command: str, victim: Path, canary: Path, tmp_path: Path, capsys) -> None:
    replace_by_link(victim, entry, canary)
    before = snapshot(canary)
    unique = {p.read_bytes() for p in canary.rglob("*") if p.is_file() and not p.is_symlink()}
    unique -= {p.read_bytes() for p in victim.rglob("*") if p.is_file() and not p.is_symlink()}
    code, out, err = run_command(commands(victim, tmp_path)[command], canary, capsys)
    assert code in (0, 2), err
    assert "Traceback" not in err
    if code == 2:
        assert err.strip().splitlines()[-1].startswith("keel: error: "), err
    assert snapshot(canary) == before, f"{entry}: the canary tree changed"
    assert MARK not in out
    outputs = [p for p in (tmp_path / "export").rglob("*") if p.is_file()] if (tmp_path / "export").exists() else []
    outputs += [p for p in victim.rglob("*") if p.is_file() and not p.is_symlink()]
    for path in outputs:
        data = path.read_bytes()
        assert MARK.encode() not in data and data not in unique, f"{path}: a copy of the canary"


@pytest.mark.parametrize("command", sorted(FAST))
@pytest.mark.parametrize("entry", ENTRIES + ADDED)
def test_each_entry_linked_outside_fast(entry, command, victim, canary, tmp_path, capsys):
    _walk(entry, command, victim, canary, tmp_path, capsys)


@pytest.mark.slow  # real training, evaluation, export and plotting: about a second each
@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in FAST])
@pytest.mark.parametrize("entry", ENTRIES + ADDED)
def test_each_entry_linked_outside(entry, command, victim, canary, tmp_path, capsys):
    if command == "export-hf":
        pytest.importorskip("transformers")
    _walk(entry, command, victim, canary, tmp_path, capsys)
