"""Hostile inputs to `keel tokenizer`, `keel import-hf`, and to eval/generate/export-hf on a run whose checkpoints
change under them: each case is a real `keel` command that either refuses in one `keel: error:` line with exit 2,
no traceback, within 10 s, or does its work, and never changes anything outside the directory it was named.

Files larger than memory are sparse (`truncate`: no disk used); a line of 50 million characters is scaled down with
the piece bound lowered to match, so every path the large input takes is taken."""

from __future__ import annotations

import errno
import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

from keel.cli import main
from keel.data import text_stream
from keel.data import tokenizer as tokenizers

TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 40


# ---- what every case must leave alone ------------------------------------------------------------------
def snapshot(root: Path, skip: Path) -> dict:
    """Every entry under `root` but `skip` (the directory the command was named): type, size, mtime, link target.
    An explicit stack: the deep-directory case is deeper than Python's recursion limit."""
    seen, stack = {}, [root]
    while stack:
        here = stack.pop()
        for entry in os.scandir(here):
            path = Path(entry.path)
            if path == skip:
                continue
            st = entry.stat(follow_symlinks=False)
            seen[str(path)] = (st.st_mode, st.st_size, st.st_mtime_ns,
                               os.readlink(path) if entry.is_symlink() else None)
            if entry.is_dir(follow_symlinks=False):
                stack.append(path)
    return seen


def deep_dir(root: Path, levels: int) -> Path:
    """`root`/d/d/.../d, `levels` deep, made one level at a time (os.makedirs recurses once per level)."""
    root.mkdir(parents=True)
    fd = os.open(root, os.O_RDONLY)
    try:
        for _ in range(levels):
            os.mkdir("d", dir_fd=fd)
            below = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = below
        with open(os.open("x.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
            f.write(TEXT)
    finally:
        os.close(fd)
    return root


def remove_tree(root: Path) -> None:
    """shutil.rmtree recurses once per level too: pytest could not clean up a tree 1,500 deep."""
    dirs, stack = [], [root]
    while stack:
        dirs.append(here := stack.pop())
        for entry in os.scandir(here):
            if entry.is_dir(follow_symlinks=False):
                stack.append(Path(entry.path))
            else:
                os.unlink(entry.path)
    for directory in reversed(dirs):
        os.rmdir(directory)


def sparse(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def read_only(monkeypatch, directory: Path) -> None:
    """Creating a file in `directory` fails as on a read-only file system (the tests run as root, whom
    permissions do not stop)."""
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and Path(path).absolute().parent == directory:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)
    monkeypatch.setattr(os, "open", open_)


# ---- keel tokenizer ------------------------------------------------------------------------------------
def tok(source, out="out/tok.json", *extra) -> list[str]:
    return ["tokenizer", "--vocab-size", "300", "--out", out, f"data.source={source}", *extra]


def corpus_file(tmp: Path) -> Path:
    (tmp / "in").mkdir(exist_ok=True)
    (tmp / "in" / "corpus.txt").write_text(TEXT)
    return tmp / "in" / "corpus.txt"


def fifo(tmp: Path) -> Path:
    (tmp / "in").mkdir()
    os.mkfifo(tmp / "in" / "corpus.txt")
    return tmp / "in" / "corpus.txt"


def link_loop(tmp: Path) -> Path:
    (tmp / "in").mkdir()
    (tmp / "in" / "a.txt").symlink_to(tmp / "in" / "b.txt")
    (tmp / "in" / "b.txt").symlink_to(tmp / "in" / "a.txt")
    return tmp / "in" / "a.txt"


def out_link(tmp: Path, mp) -> list[str]:
    argv = tok(corpus_file(tmp))
    (tmp / "in" / "victim.json").write_text("{}")
    (tmp / "out").mkdir()
    (tmp / "out" / "tok.json").symlink_to(tmp / "in" / "victim.json")
    return argv


def out_read_only(tmp: Path, mp) -> list[str]:
    (tmp / "out").mkdir()
    read_only(mp, tmp / "out")
    return tok(corpus_file(tmp))


def long_line(tmp: Path, mp) -> list[str]:
    """One line of 3 million characters (letters, digits, spaces, marks in runs), the trainer's piece bound
    lowered so that the line is 48 pieces, as a 50-million-character line is at the real bound."""
    mp.setattr(tokenizers, "PIECE_CHARS", 1 << 16)
    (tmp / "in").mkdir()
    line = ("a" * 400_000 + " " * 100_000 + "word " * 100_000 + "7" * 300_000 + "=" * 200_000) * 2
    (tmp / "in" / "line.txt").write_text(line + "\n")
    return tok(tmp / "in" / "line.txt")


def sparse_in_directory(tmp: Path, mp) -> list[str]:
    """A 3 GB file of NUL bytes among the text files of a directory: left out (as any binary file), not read."""
    sparse(tmp / "in" / "big.txt", 3 << 30)
    corpus_file(tmp)
    return tok(tmp / "in")


TOKENIZER_CASES = {
    "3 GB sparse file": (lambda tmp, mp: tok(sparse(tmp / "in" / "big.txt", 3 << 30)), "not a UTF-8 text file"),
    "8 GB sparse file": (lambda tmp, mp: tok(sparse(tmp / "in" / "big.txt", 8 << 30)), "not a UTF-8 text file"),
    "FIFO as data.source": (lambda tmp, mp: tok(fifo(tmp)), "not a regular file"),
    "device as data.source": (lambda tmp, mp: tok("/dev/zero"), "not a regular file"),
    "link loop as data.source": (lambda tmp, mp: tok(link_loop(tmp)), "a link to nothing"),
    "--out in /proc": (lambda tmp, mp: tok(corpus_file(tmp), "/proc/self/tok.json"), "--out"),
    "--out under a file": (lambda tmp, mp: tok(corpus_file(tmp), str(tmp / "in" / "corpus.txt" / "tok.json")), "--out"),
    "--out a link": (out_link, "symbolic link"),
    "--out read-only": (out_read_only, "Read-only file system"),
    "--vocab-size 10**20": (lambda tmp, mp: tok(corpus_file(tmp))[:2] + ["10" + "0" * 20] + tok("x")[3:5]
                            + [f"data.source={corpus_file(tmp)}"], "--vocab-size"),
}
TOKENIZER_WORKS = {
    "directory 1,500 levels deep": lambda tmp, mp: tok(deep_dir(tmp / "in", 1500)),  # slow (2 CPU s)
    "a line of millions of characters": long_line,
    "3 GB sparse file in a directory": sparse_in_directory,
}


# ---- keel import-hf ------------------------------------------------------------------------------------
LLAMA = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "intermediate_size": 176}


def hf_dir(tmp: Path, weight_map: dict) -> Path:
    hf = tmp / "in" / "llama"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps(LLAMA))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return hf


IMPORT_CASES = {
    "weight_map with a NUL byte": (
        lambda tmp, mp: ["import-hf", hf_dir(tmp, {"lm_head.weight": "model\0.safetensors"}), tmp / "out" / "run"],
        "NUL byte"),
    "output under a file": (
        lambda tmp, mp: ["import-hf", hf_dir(tmp, {"lm_head.weight": "model.safetensors"}),
                         tmp / "in" / "llama" / "config.json" / "run"], "is not a directory"),
}


# ---- what else an attack found -------------------------------------------------------------------------
def fifo_task(tmp: Path, mp) -> list[str]:
    (tmp / "in").mkdir()
    os.mkfifo(tmp / "in" / "task.yaml")
    return ["train", "--preset", "tiny", f"data.source={corpus_file(tmp)}", f"data.cache_dir={tmp / 'out' / 'cache'}",
            f"run.out_dir={tmp / 'out'}", f"run.eval_tasks=[lm_eval:{tmp / 'in' / 'task.yaml'}]"]


OTHER_CASES = {
    "run.eval_tasks naming a FIFO": (fifo_task, "task file"),
    "summary model.n_blocks=10**20": (lambda tmp, mp: ["summary", f"model.n_blocks={10**20}"], "n_blocks"),
}

REFUSED = {**TOKENIZER_CASES, **IMPORT_CASES, **OTHER_CASES}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_in_one_line(case, tmp_path, monkeypatch, capsys):
    setup, needle = REFUSED[case]
    monkeypatch.chdir(tmp_path)
    argv = [str(a) for a in setup(tmp_path, monkeypatch)]
    (tmp_path / "out").mkdir(exist_ok=True)
    before = snapshot(tmp_path, tmp_path / "out")
    start = time.monotonic()
    code = main(argv)
    seconds = time.monotonic() - start
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("keel: error:") and needle in lines[0], err
    assert seconds < 10, f"{case}: {seconds:.1f} s before refusing"
    assert snapshot(tmp_path, tmp_path / "out") == before


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if "1,500" in c else c
                                  for c in TOKENIZER_WORKS])
def test_tokenizer_reads_what_it_can_in_bounded_memory(case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    try:
        argv = [str(a) for a in TOKENIZER_WORKS[case](tmp_path, monkeypatch)]
        before = snapshot(tmp_path, tmp_path / "out")
        (tmp_path / "out").mkdir(exist_ok=True)
        start = time.monotonic()
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 0 and "Traceback" not in err, err
        assert time.monotonic() - start < 10
        assert json.loads((tmp_path / "out" / "tok.json").read_text())["model"]["type"] == "BPE"
        assert snapshot(tmp_path, tmp_path / "out") == before
    finally:
        remove_tree(tmp_path / "in")


# ---- the trainer's pieces ------------------------------------------------------------------------------
def train_whole(text: str, vocab: int) -> str:
    """A byte-level BPE trained by `tokenizers` on `text` in one string, as keel configures it: the reference."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return t.to_str(pretty=True)


def test_pieces_train_the_same_bpe_as_the_whole_text(corpus, tmp_path, monkeypatch):
    """Pieces end only where GPT-2's pre-tokenizer splits anyway, so the BPE is the one the whole text trains,
    byte for byte, whether the text comes whole or in blocks cut anywhere (here mid-line, every 777 characters)."""
    text = corpus.read_text()
    monkeypatch.setattr(tokenizers, "PIECE_CHARS", 3000)
    blocks = [text[i:i + 777] for i in range(0, len(text), 777)]
    pieces = list(tokenizers.bounded_pieces(blocks))
    assert len(pieces) > 10 and max(map(len, pieces)) <= 3000 and "".join(pieces) == text
    tokenizers.train_bpe([iter(blocks)], 1000, tmp_path / "tok.json")
    assert (tmp_path / "tok.json").read_text() == train_whole(text, 1000)


def test_pieces_are_bounded_and_lose_only_space_runs(monkeypatch):
    monkeypatch.setattr(tokenizers, "PIECE_CHARS", 1 << 14)
    line = "x" * 100_000 + " " * 5_000 + "ab cd " * 10_000 + "+-" * 3_000 + "\n" * 300 + "é" * 70_000
    pieces = list(tokenizers.bounded_pieces([line[i:i + 9999] for i in range(0, len(line), 9999)]))
    assert max(map(len, pieces)) <= 1 << 14
    runs = tokenizers._LONG_RUN.pattern.replace(str(tokenizers.WORD_CHARS), str(tokenizers.WORD_CHARS + 1))
    assert not any(re.search(runs, p) for p in pieces)  # no run longer than WORD_CHARS
    assert re.sub(r"\s", "", "".join(pieces)) == re.sub(r"\s", "", line)  # every other character, in order


# ---- the text file read in blocks ----------------------------------------------------------------------
@pytest.mark.parametrize("val_fraction", [0.0, 0.1, 0.5])
def test_a_text_file_streamed_in_blocks_is_its_documents(tmp_path, monkeypatch, val_fraction):
    """The streamed split (blocks of 7 bytes, so multi-byte characters straddle them) is the one `documents`
    reads whole: the same characters, the byte-order mark dropped, the cut at the same line end."""
    from keel.data.corpus import DataConfig, build_corpus

    monkeypatch.setattr(text_stream, "BLOCK", 7)
    path = tmp_path / "t.txt"
    path.write_bytes(text_stream.BOM + ("naïve café ☕ line\n" * 30 + "no end: €€€").encode())
    corpus = build_corpus(DataConfig(source=str(path), val_fraction=val_fraction))
    for split in ("train", "val"):
        whole = list(corpus.documents(split))
        streamed = ["".join(s) for s in corpus.document_streams(split)]
        assert streamed == whole or (not whole and not "".join(streamed).strip())


def test_a_directory_streams_the_documents_it_reads_whole(tmp_path, monkeypatch):
    from keel.data.corpus import DataConfig, build_corpus

    monkeypatch.setattr(text_stream, "BLOCK", 5)
    for i in range(12):
        (tmp_path / "c" / f"d{i}").mkdir(parents=True)
        (tmp_path / "c" / f"d{i}" / "a.txt").write_text(f"document {i}: ünïcode\n" * (i + 1))
    (tmp_path / "c" / "binary.txt").write_bytes(b"text\0more")
    corpus = build_corpus(DataConfig(source=str(tmp_path / "c"), val_fraction=0.3))
    for split in ("train", "val"):
        assert ["".join(s) for s in corpus.document_streams(split)] == list(corpus.documents(split))
    assert corpus.skipped == {"binary.txt"}


def test_the_walk_lists_what_os_walk_lists(tmp_path):
    """The stack-based walk against os.walk (which recurses) on a tree it can still walk."""
    for rel in ["a/b/c.txt", "a/.hidden/x.txt", "a/z.py", "b.md", "a/b/d/e.txt", "skip/f.txt", "a/B.TXT"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    (tmp_path / "a" / "up").symlink_to(tmp_path)  # a cycle, not followed
    expected = []
    for dirpath, dirnames, filenames in os.walk(tmp_path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "skip")
        expected += [Path(dirpath, f).relative_to(tmp_path).as_posix() for f in sorted(filenames)
                     if not f.startswith(".") and Path(f).suffix.lower() in {".txt", ".md"}]
    assert [rel for rel, _, _ in text_stream.walk(tmp_path, {".txt", ".md"}, {"skip"})] == expected


# ---- eval, generate and export-hf on a run that changes under them ---------------------------------------
@pytest.fixture
def two_checkpoints(make_run, tmp_path) -> Path:
    """A run (config, tokenizer, checkpoints at steps 7 and 8) reading a corpus inside it."""
    from keel.config import load_config
    from keel.runs import checkpoint

    run = tmp_path / "run"
    model = make_run(run)
    checkpoint.save(run, 8, model, {}, {}, keep=2)
    (run / "corpus.txt").write_text(TEXT * 20)
    text = (run / "config.yaml").read_text()
    config = load_config([], str(run / "config.yaml"))
    (run / "config.yaml").write_text(text.replace(f"source: {config.data.source}", f"source: {run / 'corpus.txt'}"))
    return run


def damage_state(ckpt: Path) -> None:
    from damage import rechecksum

    torch.save({"sampler": "not a sampler"}, ckpt / "state.pt")
    rechecksum(ckpt)


COMMANDS = {
    "eval": ["eval", "RUN", "--batches", "1", "--device", "cpu", "--json"],
    "generate": ["generate", "RUN", "--max-new-tokens", "2"],
    "export-hf": ["export-hf", "RUN", "OUT"],
}


def keel(command: str, run: Path, out: Path, capsys) -> tuple[int, str, str]:
    if command == "export-hf":
        pytest.importorskip("transformers")
    code = main([str(out) if a == "OUT" else str(run) if a == "RUN" else a for a in COMMANDS[command]])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out, captured.err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_damaged_newest_checkpoint_falls_back_to_the_older(command, two_checkpoints, tmp_path, capsys):
    """state.pt damaged and re-checksummed: the checksums pass, the content does not; as a resume does, the
    next older checkpoint is used and the skip said in one line."""
    run = two_checkpoints
    damage_state(run / "checkpoints" / "step_00000008")
    code, out, err = keel(command, run, tmp_path / "export", capsys)
    assert code == 0, err
    assert "step_00000008" in err and "trying an older one" in err
    if command == "eval":
        assert json.loads(out)["checkpoint"].endswith("step_00000007")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_damaged_checkpoint_named_with_checkpoint_is_one_line(command, two_checkpoints, tmp_path, capsys):
    run = two_checkpoints
    damage_state(run / "checkpoints" / "step_00000008")
    if command == "export-hf":
        pytest.importorskip("transformers")
    argv = [str(tmp_path / "export") if a == "OUT" else str(run) if a == "RUN" else a for a in COMMANDS[command]]
    code = main([*argv, "--checkpoint", str(run / "checkpoints" / "step_00000008")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("keel: error:") == 1 and "sampler" in err, err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_checkpoint_pruned_mid_read_is_read_again_from_the_newest(command, two_checkpoints, tmp_path,
                                                                    monkeypatch, capsys):
    """The trainer writes step 9 and is part-way through deleting step 8 (its directory still there, its weights
    gone) while the command reads step 8: was a FileNotFoundError traceback. Step 9 is read instead."""
    import shutil

    from keel.runs import checkpoint

    run, real_load, calls = two_checkpoints, checkpoint.load, []

    def pruned_while_read(path, model):
        calls.append(Path(path).name)
        if len(calls) == 1:
            shutil.copytree(path, run / "checkpoints" / "step_00000009")
            (Path(path) / "model.safetensors").unlink()
        return real_load(path, model)
    monkeypatch.setattr(checkpoint, "load", pruned_while_read)
    code, out, err = keel(command, run, tmp_path / "export", capsys)
    assert code == 0, err
    assert calls == ["step_00000008", "step_00000009"]
    if command == "eval":
        assert json.loads(out)["checkpoint"].endswith("step_00000009")


def test_a_checkpoint_whose_weights_vanish_after_their_checksum_is_damaged_not_a_traceback(two_checkpoints,
                                                                                          monkeypatch):
    from keel.runs import checkpoint, untrusted

    def vanished(*args, **kwargs):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")
    monkeypatch.setattr(untrusted, "safe_open", vanished)
    assert "model.safetensors cannot be read" in checkpoint.verify(two_checkpoints / "checkpoints" / "step_00000008")
