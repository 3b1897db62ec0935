"""Containment: every command reads, writes and deletes only inside the run directory it is given.

The walk: each entry of a small trained run directory in turn (every file and directory in it, and a few that a
hostile one could add) is replaced by a symlink into an outside canary tree, which holds a working copy of the
entry (so following the link would succeed and show), and every command runs on the result. Each must exit 0 or
2 without a traceback, and the canary tree must stay as it was (bytes, mtimes, listing), must not be opened
(an audit hook sees every file Python opens), and must not be copied into an output (its files carry a marker).

The walk is reduced to the cases that differ. Every entry linked under every command (23 x 7 = 161 cases) gave
38 distinct behaviours, a behaviour being (command, exit code, what it says): a command refuses a link it would
read ("does not follow links"), write through ("refused to write through it") or take as its checkpoint ("no
intact checkpoint", or "trying an older one" for the newest), skips or ignores a log it only lists, fails to
find a tokenizer behind a linked config, distrusts a config whose signature is a link; an entry a command never
reads leaves it as on the untouched run. WALK keeps one entry per behaviour (39 cases), chosen so every entry is
linked at least once, and names what each must say; resume keeps both of its leftover directories (.tmp- is
cleaned, .old- would be put back: two paths through the same behaviour). What the reduction gives up: a command
that starts reading an entry it ignores today is caught only where WALK pairs them; when a command starts reading
a new file, run every entry under it again and add the behaviours that differ. A new kind of entry fails
test_the_walk_covers_every_entry until it is walked.
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
# every case needs the trained run (7.6 s to set up, measured at load 4 on 2 cores: tests/durations.json), so the
# walk is in the slow tier; runs and summary are the cheap commands, kept apart should the set-up get cheaper
FAST: set[str] = set()


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


@pytest.mark.slow  # the trained run
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


def _walk(entry: str, command: str, victim: Path, canary: Path, tmp_path: Path, capsys) -> tuple[int, str]:
    """`command` on the victim with `entry` linked into the canary tree: checks the canary; returns (exit, stderr)."""
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
    return code, err


# (command, entry linked outside, exit code, what stderr says; None: nothing about the link, as on the untouched run)
LINK = "does not follow links inside a run directory"
WALK = [
    ("runs", ".lock", 0, None),
    ("runs", "config.yaml", 0, "listed as damaged"),
    ("runs", "metrics.jsonl", 0, f"{LINK}; skipped"),
    ("runs", "summary.json", 0, f"{LINK}; ignored"),
    ("summary", "config.yaml", 2, LINK),
    ("summary", "run.json", 0, None),
    ("plot", f"{CKPT}/manifest.json", 0, None),
    ("plot", "curves.png", 2, "refused to write through it"),
    ("plot", "summary.json", 0, f"{LINK}; ignored"),
    ("plot", "telemetry.jsonl", 0, f"{LINK}; skipped"),
    ("eval", ".config.sig", 2, "lies outside the run directory"),
    ("eval", "checkpoints", 2, "keel does not follow it"),
    ("eval", CKPT, 2, "no intact checkpoint"),
    ("eval", "checkpoints/step_00000009", 0, "trying an older one"),
    ("eval", "diverged.json", 0, None),
    ("eval", f"eval-{STEP}-val.json", 2, "refused to write through it"),
    ("eval", "tokenizer", 2, LINK),
    ("eval", "tokenizer/tokenizer_config.json", 2, "no saved tokenizer"),
    ("generate", "checkpoints", 2, "keel does not follow it"),
    ("generate", f"{CKPT}/model.safetensors", 2, "no intact checkpoint"),
    ("generate", "checkpoints/step_00000009", 0, "trying an older one"),
    ("generate", "tensorboard", 0, None),
    ("generate", "tokenizer/tokenizer.json", 2, LINK),
    ("generate", "tokenizer/tokenizer_config.json", 2, "no saved tokenizer"),
    ("export-hf", "checkpoints", 2, "keel does not follow it"),
    ("export-hf", "checkpoints/.old-step_00000009-1", 0, None),
    ("export-hf", f"{CKPT}/state.pt", 2, "no intact checkpoint"),
    ("export-hf", "checkpoints/step_00000009", 0, "trying an older one"),
    ("export-hf", "run.json", 0, f"{LINK}; ignored"),
    ("export-hf", "tokenizer", 2, LINK),
    ("export-hf", "tokenizer/tokenizer_config.json", 2, "no saved tokenizer"),
    ("resume", ".config.sig", 2, "lies outside the run directory"),
    ("resume", ".lock", 2, LINK),
    ("resume", "checkpoints", 2, "keel does not follow it"),
    ("resume", "checkpoints/.tmp-step_00000009-1", 0, None),
    ("resume", "checkpoints/.old-step_00000009-1", 0, None),
    ("resume", f"{CKPT}/meta.json", 2, "no intact checkpoint"),
    ("resume", "curves.png", 0, "could not draw curves"),
    ("resume", "metrics.jsonl", 2, "refused to write through it"),
]


def test_the_reduced_walk_links_every_entry_and_names_every_command():
    assert {entry for _, entry, _, _ in WALK} == set(ENTRIES + ADDED)
    assert {command for command, *_ in WALK} == set(COMMANDS)
    assert len({(command, entry) for command, entry, _, _ in WALK}) == len(WALK)


@pytest.mark.parametrize("command, entry, code, says", [
    case if case[0] in FAST else pytest.param(*case, marks=pytest.mark.slow)  # real training, evaluation, export
    for case in WALK], ids=[f"{c}-{e}" for c, e, _, _ in WALK])
def test_an_entry_linked_outside(command, entry, code, says, victim, canary, tmp_path, capsys):
    if command == "export-hf":
        pytest.importorskip("transformers")
    got, err = _walk(entry, command, victim, canary, tmp_path, capsys)
    assert got == code, err
    if says is not None:
        assert says in err, err
