"""Corpora, the train/val split, the token cache (a shard directory), tokenizers and batch samplers.

Expectations are computed independently of keel.data: files are found with pathlib, the split rule is
written out below, and shard contents are compared with the files' own bytes."""

import hashlib
import inspect
import io
import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import keel.data.loader
import keel.data.tokenizer
from keel.data import DataConfig, DataError, WindowSampler, build_corpus, eval_batches, prepare
from keel.data.tokenizer import ByteTokenizer, HFTokenizer, load_saved_tokenizer, load_tokenizer


def in_val(identity, fraction: float) -> bool:
    """The documented split rule: the first 8 bytes of SHA-256(str(identity)) over 2**64, below the fraction."""
    return int.from_bytes(hashlib.sha256(str(identity).encode()).digest()[:8], "big") / 2**64 < fraction


@pytest.fixture
def config(tmp_path):
    def make(source, **kw):
        return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **kw)
    return make


FILES = {"a.txt": "alpha line one\nalpha line two\n", "b.md": "# Bravo\n\nsome *markdown* — with ünïcode\n",
         "sub/c.py": "def charlie():\n    return 3\n"}


@pytest.fixture
def small_dir(tmp_path) -> Path:
    """Three text files, plus what a directory source must leave out or skip."""
    root = tmp_path / "corpus"
    for rel, text in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / ".hidden.txt").write_text("hidden file\n")
    (root / ".git").mkdir()
    (root / ".git" / "x.txt").write_text("in a hidden directory\n")
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))  # not a text suffix
    (root / "notes.txt").write_bytes(b"looks like text\x00but has a NUL")  # text suffix, binary content
    (root / "empty.txt").write_text("")
    return root


@pytest.fixture(scope="module")
def source_texts() -> list[str]:
    """About 200 KB of real text: the source of a few standard-library modules."""
    import argparse
    import json.decoder
    import string
    import textwrap

    return [inspect.getsource(m) for m in (argparse, json.decoder, string, textwrap)]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---- tokenizers -----------------------------------------------------------------------------------

def test_byte_tokenizer_is_utf8_and_round_trips():
    tok = ByteTokenizer()
    text = "def f(x):\n\treturn 'héllo' + '日本' + '🙂'\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < tok.vocab_size == 256
    assert tok.decode(ids) == text
    np.testing.assert_array_equal(tok.encode_to_array(text), ids)
    assert tok.decode([104, 0xE6, 0x97]) == "h\ufffd"  # a cut multi-byte character decodes, replaced
    assert tok.eos_id is None and tok.name == "bytes"


def test_bpe_round_trips_is_cached_and_reloads_from_a_run_directory(tmp_path, source_texts, monkeypatch):
    root = tmp_path / "src"
    root.mkdir()
    for i, text in enumerate(source_texts):
        (root / f"m{i}.py").write_text(text)
    corpus = build_corpus(DataConfig(source=str(root), val_fraction=0.3))
    tok = load_tokenizer("bpe:300", tmp_path / "cache", corpus)
    added = json.loads(tok.path.read_text())["added_tokens"]
    assert tok.vocab_size == 300 and tok.eos_id == next(t["id"] for t in added if t["content"] == "<|endoftext|>")
    for s in ["def parse_args(self, args=None):\n    return x", "  leading spaces\n\n\ttabs", "naïve café 日本語 🙂",
              "never seen: zqxj\u00a0\u2028"]:
        assert tok.decode(tok.encode(s)) == s
    assert len(tok.encode(source_texts[0])) < 0.7 * len(source_texts[0].encode())  # it learnt merges

    def no_training(*args, **kwargs):
        raise AssertionError("retrained although a cached tokenizer exists")

    monkeypatch.setattr(keel.data.tokenizer, "train_bpe", no_training)
    again = load_tokenizer("bpe:300", tmp_path / "cache", build_corpus(DataConfig(source=str(root), val_fraction=0.3)))
    assert again.name == tok.name and again.encode(source_texts[1]) == tok.encode(source_texts[1])

    tok.save(tmp_path / "run" / "tokenizer")
    saved = load_saved_tokenizer(tmp_path / "run" / "tokenizer")
    assert isinstance(saved, HFTokenizer) and saved.name == tok.name and saved.eos_id == tok.eos_id
    assert load_tokenizer(str(tmp_path / "run" / "tokenizer"), tmp_path / "cache").name == tok.name  # a directory
    ByteTokenizer().save(tmp_path / "run2" / "tokenizer")
    assert isinstance(load_saved_tokenizer(tmp_path / "run2" / "tokenizer"), ByteTokenizer)


def test_bpe_shards_are_the_encoded_documents_each_followed_by_eos(config, source_texts, tmp_path):
    path = tmp_path / "docs.jsonl"
    write_jsonl(path, [{"text": t} for t in source_texts])
    data = prepare(config(path, tokenizer="bpe:300", val_fraction=0.3))
    tok, corpus = data.tokenizer, build_corpus(config(path, val_fraction=0.3))
    for split, tokens in (("train", data.train), ("val", data.val)):
        expected = [i for doc in corpus.documents(split) for i in [*tok.encode(doc), tok.eos_id]]
        assert tokens.dtype == np.uint16 and np.asarray(tokens).tolist() == expected and expected
    bytes_data = prepare(config(path, val_fraction=0.3))
    assert bytes_data.cache_path != data.cache_path  # the tokenizer is part of the cache key


# ---- corpora and the split ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stdlib_files() -> dict[str, Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not ({"site-packages", "dist-packages"} & set(rel.parts)) and not any(p.startswith(".") for p in rel.parts):
            found[rel.as_posix()] = path
    return found


@pytest.fixture(scope="module")
def stdlib_data(tmp_path_factory):
    return prepare(DataConfig(cache_dir=str(tmp_path_factory.mktemp("cache"))))


def text_or_none(path: Path) -> str | None:
    raw = path.read_bytes()
    try:
        return None if b"\0" in raw else raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None


@pytest.mark.slow  # over a second in tests/durations.json
def test_stdlib_corpus_is_found_and_split_deterministically_and_disjointly(stdlib_files, stdlib_data):
    assert "os.py" in stdlib_files and "json/__init__.py" in stdlib_files and len(stdlib_files) > 500
    texts = {rel: text_or_none(p) for rel, p in stdlib_files.items()}
    val = {rel for rel, t in texts.items() if t and in_val(rel, 0.02)}
    train = {rel for rel, t in texts.items() if t} - val
    assert val and train and not val & train

    corpus = build_corpus(DataConfig())
    info = stdlib_data.corpus_info
    assert info["files"] == len(stdlib_files) and info["fingerprint"] == corpus.fingerprint
    assert (info["train_documents"], info["val_documents"]) == (len(train), len(val))
    assert info["skipped_files"] == sum(t is None for t in texts.values())
    val_docs = list(corpus.documents("val"))
    assert sorted(val_docs) == sorted(texts[rel] for rel in val)
    assert list(build_corpus(DataConfig()).documents("val")) == val_docs  # same order on every call
    # byte tokens: the shards are the documents' UTF-8, back to back
    want = np.frombuffer("".join(val_docs).encode(), np.uint8).astype(np.uint16)
    assert np.asarray(stdlib_data.val).tobytes() == want.tobytes()
    assert len(stdlib_data.train) == sum(len(texts[rel].encode()) for rel in train)


def test_directory_source_reads_text_files_and_skips_the_rest(config, small_dir):
    fraction = 0.5
    expected_val = [rel for rel in FILES if in_val(rel, fraction)]
    assert 0 < len(expected_val) < len(FILES), "pick a fraction that splits these three files"
    data = prepare(config(small_dir, val_fraction=fraction))
    for split, tokens in (("train", data.train), ("val", data.val)):
        rels = [rel for rel in FILES if (rel in expected_val) == (split == "val")]  # FILES is in walk order
        assert np.asarray(tokens).tobytes() == np.frombuffer("".join(FILES[r] for r in rels).encode(),
                                                             np.uint8).astype(np.uint16).tobytes()
    info = data.corpus_info
    assert info["files"] == 5 and info["skipped_files"] == 1 and info["skipped"] == ["notes.txt"]
    assert info["train_documents"] + info["val_documents"] == 3


def test_single_text_file_holds_out_its_tail_at_a_line_end(config, tmp_path):
    path = tmp_path / "book.txt"
    text = "".join(f"line {i}: {'x' * (i % 7)}\n" for i in range(200))
    path.write_text(text)
    corpus = build_corpus(config(path, val_fraction=0.1))
    (train,), (val,) = corpus.documents("train"), corpus.documents("val")
    assert train + val == text and train.endswith("\n") and val.startswith("line ")
    assert 0.09 < len(val) / len(text) < 0.11


def test_jsonl_records_are_split_by_record_index(config, tmp_path):
    texts = [f"record {i} " * (i % 5 + 1) for i in range(60)]
    texts[7] = ""  # an empty document: counted as a record, never yielded
    path = write_jsonl(tmp_path / "data.jsonl", [{"id": i, "content": t} for i, t in enumerate(texts)])
    path.write_text(path.read_text().replace("\n", "\n\n", 3))  # blank lines are not records
    corpus = build_corpus(config(path, text_field="content", val_fraction=0.1))
    expected_val = [t for i, t in enumerate(texts) if t and in_val(i, 0.1)]
    assert expected_val and list(corpus.documents("val")) == expected_val
    assert list(corpus.documents("train")) == [t for i, t in enumerate(texts) if t and not in_val(i, 0.1)]
    assert corpus.describe()["records"] == 60


def test_a_small_corpus_still_gets_one_validation_document(config, tmp_path):
    path = write_jsonl(tmp_path / "three.jsonl", [{"text": f"doc {i}\n"} for i in range(3)])
    assert not any(in_val(i, 0.02) for i in range(3))
    lowest = min(range(3), key=lambda i: hashlib.sha256(str(i).encode()).digest())
    corpus = build_corpus(config(path))
    assert list(corpus.documents("val")) == [f"doc {lowest}\n"]
    assert len(list(corpus.documents("train"))) == 2


def test_parquet_source(config, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"row {i}\n" for i in range(50)]
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"id": list(range(50)), "text": texts}), path, row_group_size=16)
    corpus = build_corpus(config(path, val_fraction=0.2))
    assert list(corpus.documents("val")) == [t for i, t in enumerate(texts) if in_val(i, 0.2)]
    assert len(list(corpus.documents("train"))) + len(list(corpus.documents("val"))) == 50
    with pytest.raises(DataError, match=r"data\.parquet.*'body'"):
        build_corpus(config(path, text_field="body"))


def test_hugging_face_dataset_saved_to_disk(config, tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = [f"example {i}\n" for i in range(40)]
    datasets.Dataset.from_dict({"text": texts, "label": list(range(40))}).save_to_disk(tmp_path / "ds")
    cfg = config(f"hf:{tmp_path / 'ds'}", val_fraction=0.2)
    corpus = build_corpus(cfg)
    assert list(corpus.documents("val")) == [t for i, t in enumerate(texts) if in_val(i, 0.2)]
    assert build_corpus(cfg).fingerprint == corpus.fingerprint
    datasets.Dataset.from_dict({"text": texts[::-1]}).save_to_disk(tmp_path / "ds2")
    assert build_corpus(config(f"hf:{tmp_path / 'ds2'}", val_fraction=0.2)).fingerprint != corpus.fingerprint
    with pytest.raises(DataError, match="'body'"):
        build_corpus(config(f"hf:{tmp_path / 'ds'}", text_field="body"))


def test_data_config_is_an_omegaconf_structured_config():
    merged = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.from_dotlist(["val_fraction=0.1"]))
    assert OmegaConf.to_object(merged) == DataConfig(val_fraction=0.1)


# ---- the token cache ------------------------------------------------------------------------------

def test_cache_is_reused_and_a_changed_file_changes_the_fingerprint(config, small_dir, monkeypatch):
    first = prepare(config(small_dir))

    def no_rebuild(*args):
        raise AssertionError("re-tokenised although the cache was valid")

    with monkeypatch.context() as m:
        m.setattr(keel.data.loader, "write_shards", no_rebuild)
        again = prepare(config(small_dir))
    assert again.cache_path == first.cache_path and np.array_equal(np.asarray(again.train), np.asarray(first.train))
    assert again.corpus_info == first.corpus_info

    fingerprint = build_corpus(config(small_dir)).fingerprint
    with open(small_dir / "a.txt", "a") as f:
        f.write("alpha line three\n")
    assert build_corpus(config(small_dir)).fingerprint != fingerprint
    changed = prepare(config(small_dir))
    assert changed.cache_path != first.cache_path
    assert len(changed.train) + len(changed.val) == len(first.train) + len(first.val) + len("alpha line three\n")
    st = os.stat(small_dir / "b.md")
    os.utime(small_dir / "b.md", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, content unchanged
    assert build_corpus(config(small_dir)).fingerprint != changed.corpus_info["fingerprint"]


def test_an_interrupted_or_damaged_cache_is_never_used(config, small_dir, monkeypatch):
    tokens_dir = Path(config(small_dir).cache_dir) / "shards"

    def interrupted(self, texts):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(ByteTokenizer, "encode_batch", interrupted)
        with pytest.raises(KeyboardInterrupt):
            prepare(config(small_dir))
    assert list(tokens_dir.iterdir()) == []  # the half-built directory was removed

    whole = prepare(config(small_dir))
    expected = np.asarray(whole.train).tobytes()
    (whole.cache_path / "train-000000.bin").write_bytes(expected[:10])  # cut short after the fact
    rebuilt = prepare(config(small_dir))
    assert rebuilt.cache_path == whole.cache_path and np.asarray(rebuilt.train).tobytes() == expected

    (whole.cache_path / "val-000000.bin").write_bytes(bytes(len(np.asarray(whole.val).tobytes())))  # same size
    with pytest.raises(DataError, match=f"val-000000.bin: its SHA-256 .* delete {whole.cache_path} to rebuild"):
        prepare(config(small_dir))


def test_a_cache_in_the_older_layout_is_named_kept_and_made_again(config, small_dir, capsys):
    """A token cache keel wrote before its cache was a shard directory (cache_dir/tokens/<key>/train.bin, val.bin,
    meta.json) is never read: one line names it, the corpus is tokenised again beside it, and it is left as it was
    (an older keel sharing the cache may still read it)."""
    cfg = config(small_dir, val_fraction=0.5)
    key = hashlib.sha256((build_corpus(cfg).fingerprint + "bytes").encode()).hexdigest()[:16]  # the documented key
    old = Path(cfg.cache_dir) / "tokens" / key
    old.mkdir(parents=True)
    planted = {"train.bin": bytes(range(200)) * 4, "val.bin": b"\xff" * 64, "meta.json": b'{"format": "keel-tokens-1"}'}
    for name, data in planted.items():
        (old / name).write_bytes(data)
    data = prepare(cfg)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and str(old) in lines[0] and "older keel" in lines[0] and str(data.cache_path) in lines[0]
    assert data.cache_path == Path(cfg.cache_dir) / "shards" / key
    val = [rel for rel in FILES if in_val(rel, 0.5)]
    assert np.asarray(data.val).tobytes() == np.frombuffer("".join(FILES[r] for r in val).encode(), np.uint8).astype(
        np.uint16).tobytes()
    assert {p.name: p.read_bytes() for p in old.iterdir()} == planted  # untouched
    prepare(cfg)
    assert capsys.readouterr().err == ""  # the new cache is read from now on


# The first batches a seeded sampler draws from the cache of `book_text()` (bytes), as keel drew them when its cache
# was one train.bin and one val.bin per corpus: the SHA-256 of the int64 x and y of 3 batches of 4 x 32 (one
# process, then rank 0 and 1 of 2 in turn, each its half of the global batch), and of 2 validation batches.
BOOK_TOKENS = (1_432_386, 29_277)
BOOK_BATCHES = ("cdacafb6913f4a738cf1d25a0a24796651aed964e9df3a69b0da6b1b159e6de2",
                "c04a414ebbd833bb0fb685ffca4cc3fff95abe115bab51080a6fbeeca1751781",
                "588ee24b50d7509b7669b8ecfd98a67589d2e32db5e44efc4a172224e10a7ba2")


def book_text() -> str:
    """1.26 million characters in 36,000 lines, more than one piece (PIECE_CHARS) of a document."""
    import random

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "über", "naïve", "日本", "x", "seventeen", "the", "of", "and", "🙂"]
    return "".join(" ".join(rng.choice(words) for _ in range(rng.randint(1, 14))) + "\n" for _ in range(36_000))


@pytest.mark.slow
def test_a_text_file_gives_the_tokens_and_seeded_batches_it_always_gave(config, tmp_path):
    from keel.data.tokenizer import PIECE_CHARS, train_bpe

    text = book_text()
    path = tmp_path / "book.txt"
    path.write_text(text)
    assert len(text) > PIECE_CHARS
    data = prepare(config(path))
    cut = text.index("\n", int(len(text) * 0.98)) + 1  # the documented cut: the line end after 98% of the text
    assert np.asarray(data.train).astype(np.uint8).tobytes() == text[:cut].encode()
    assert np.asarray(data.val).astype(np.uint8).tobytes() == text[cut:].encode()
    assert (len(data.train), len(data.val)) == BOOK_TOKENS
    sampler = WindowSampler(data.train, 32, 4, seed=0)
    ranks = [WindowSampler(data.train, 32, 2, seed=0, rank=r, world_size=2) for r in range(2)]
    drawn = [b"".join(t.numpy().tobytes() for _ in range(3) for t in sampler.next_batch()),
             b"".join(t.numpy().tobytes() for _ in range(3) for s in ranks for t in s.next_batch()),
             b"".join(t.numpy().tobytes() for batch in eval_batches(data.val, 32, 4, 2) for t in batch)]
    assert tuple(hashlib.sha256(d).hexdigest() for d in drawn) == BOOK_BATCHES

    # a BPE given as a file: each split is the whole of its text encoded at once, then eos
    tok = train_bpe([text[:20_000]], 300, tmp_path / "bpe.json")
    data = prepare(config(path, tokenizer=str(tmp_path / "bpe.json")))
    assert np.asarray(data.train).tolist() == [*tok.encode(text[:cut]), tok.eos_id]
    assert np.asarray(data.val).tolist() == [*tok.encode(text[cut:]), tok.eos_id]


def test_cache_dir_defaults_to_keel_cache(small_dir, tmp_path):
    data = prepare(DataConfig(source=str(small_dir)))
    assert data.cache_path.parent.parent == tmp_path / "env-cache"


# ---- samplers -------------------------------------------------------------------------------------

def test_sampler_windows_are_slices_of_the_tokens_and_reach_both_ends(config, small_dir):
    data = prepare(config(small_dir, val_fraction=0))
    train_bytes = np.asarray(data.train).astype(np.uint8).tobytes()
    sampler = WindowSampler(data.train, seq_len=8, batch_size=4, seed=0)
    for _ in range(5):
        x, y = sampler.next_batch()
        assert x.shape == y.shape == (4, 8) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row_x, row_y in zip(x, y):
            assert bytes(row_x.tolist()) in train_bytes and bytes([int(row_x[0]), *row_y.tolist()]) in train_bytes

    tokens = np.arange(50, dtype=np.uint16)
    sampler = WindowSampler(tokens, seq_len=8, batch_size=4, seed=1)
    starts = set()
    for _ in range(200):
        x, y = sampler.next_batch()
        assert torch.equal(x, x[:, :1] + torch.arange(8)) and torch.equal(y, x + 1)
        starts |= set(x[:, 0].tolist())
    assert starts == set(range(50 - 8))  # every window start, and none past the end


def test_resumed_sampler_draws_what_the_uninterrupted_one_would(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint16)
    straight = WindowSampler(tokens, 16, 4, seed=7)
    expected = [straight.next_batch() for _ in range(7)]

    first = WindowSampler(tokens, 16, 4, seed=7)
    for _ in range(3):
        first.next_batch()
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # as a checkpoint stores it
    buffer.seek(0)
    resumed = WindowSampler(tokens, 16, 4, seed=12345)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for x_expected, _ in expected[3:]:
        x, _ = resumed.next_batch()
        assert torch.equal(x, x_expected)
    assert resumed.step == 7
    assert not torch.equal(WindowSampler(tokens, 16, 4, seed=8).next_batch()[0], expected[0][0])


def test_global_batch_is_the_same_for_any_world_size():
    tokens = np.random.default_rng(1).integers(0, 256, 3000).astype(np.uint16)
    whole = WindowSampler(tokens, 12, 6, seed=3)
    ranks = [WindowSampler(tokens, 12, 3, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        x, y = whole.next_batch()
        parts = [s.next_batch() for s in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)


def test_eval_batches_are_fixed_evenly_spaced_and_non_overlapping():
    tokens = np.arange(1000, dtype=np.uint16)
    batches = list(eval_batches(tokens, seq_len=10, batch_size=4, max_batches=3))
    assert [len(x) for x, _ in batches] == [4, 4, 4]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert torch.equal(y, x + 1)
    starts = x[:, 0]
    gaps = starts.diff()
    assert starts[0] == 0 and y[-1, -1] == 999  # from the first token to the last
    assert gaps.min() >= 10 and gaps.max() - gaps.min() <= 1  # non-overlapping, evenly spaced
    again = list(eval_batches(tokens, seq_len=10, batch_size=4, max_batches=3))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))

    few = list(eval_batches(np.arange(45), seq_len=10, batch_size=4, max_batches=5))  # 4 windows fit
    assert len(few) == 1 and few[0][0][:, 0].tolist() == [0, 10, 20, 30]
    assert list(eval_batches(np.arange(5), seq_len=10, batch_size=4, max_batches=5)) == []


# ---- bad input ------------------------------------------------------------------------------------

def _junk_dir(tmp: Path) -> Path:
    (tmp / "junk").mkdir()
    (tmp / "junk" / "a.txt").write_bytes(b"\xff\xfe\x00binary")
    (tmp / "junk" / "b.txt").write_text("   ")  # whitespace is text, but nothing else is there
    (tmp / "junk" / "c.txt").write_text("")
    return tmp / "junk"


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


BAD_INPUT = [
    ("missing path", lambda tmp: {"source": tmp / "missing.txt"}, "missing.txt"),
    ("empty file", lambda tmp: {"source": _write(tmp / "empty.txt", b"")}, "empty.txt"),
    ("binary file", lambda tmp: {"source": _write(tmp / "blob.bin", bytes(range(256)) * 50)}, "blob.bin"),
    ("latin-1 file", lambda tmp: {"source": _write(tmp / "latin.txt", "café".encode("latin-1"))}, "latin.txt"),
    ("directory of junk", lambda tmp: {"source": _junk_dir(tmp), "val_fraction": 0.0}, "junk"),
    ("directory without text files", lambda tmp: {"source": (tmp / "pics").mkdir() or tmp / "pics"}, "pics"),
    ("JSONL not JSON", lambda tmp: {"source": _write(tmp / "data.jsonl", b'{"text": "ok"}\n{"text": oops}\n')},
     "data.jsonl:2"),
    ("JSONL without the field", lambda tmp: {"source": write_jsonl(tmp / "data.jsonl", [{"body": "x"}])},
     "data.jsonl:1: no field 'text'"),
    ("JSONL field not text", lambda tmp: {"source": write_jsonl(tmp / "data.jsonl", [{"text": 3}])}, "data.jsonl:1"),
    ("unknown tokenizer", lambda tmp: {"tokenizer": "gpt2"}, "gpt2"),
    ("missing tokenizer.json", lambda tmp: {"tokenizer": str(tmp / "nope" / "tokenizer.json")}, "tokenizer.json"),
    ("invalid tokenizer.json", lambda tmp: {"tokenizer": str(_write(tmp / "bad.json", b"{not json"))}, "bad.json"),
    ("BPE without a size", lambda tmp: {"tokenizer": "bpe:big"}, "data.tokenizer"),
    ("BPE too small", lambda tmp: {"tokenizer": "bpe:100"}, "data.tokenizer"),
    ("val_fraction out of range", lambda tmp: {"val_fraction": 1.5}, "data.val_fraction"),
    ("a single document, val wanted", lambda tmp: {"source": write_jsonl(tmp / "one.jsonl", [{"text": "x"}])},
     "one.jsonl"),
]


@pytest.mark.parametrize("make,needle", [b[1:] for b in BAD_INPUT], ids=[b[0] for b in BAD_INPUT])
def test_bad_input_is_a_data_error_naming_the_file_or_field(make, needle, tmp_path, small_dir):
    cfg = {"source": small_dir, **make(tmp_path)}
    with pytest.raises(DataError) as err:
        prepare(DataConfig(**{**cfg, "source": str(cfg["source"])}, cache_dir=str(tmp_path / "cache")))
    message = str(err.value)
    assert needle in message and "\n" not in message and isinstance(err.value, ValueError)


@pytest.mark.parametrize("inside_directory", [False, True])
def test_an_unreadable_file_is_named(inside_directory, config, small_dir, monkeypatch):
    target = small_dir / "a.txt"
    real_open = os.open

    def denied(path, *args, **kwargs):
        if Path(path) == target:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)  # chmod would not stop root
    with pytest.raises(DataError, match="a.txt: cannot read"):
        prepare(config(small_dir if inside_directory else target))


def test_a_split_shorter_than_one_window_is_named():
    with pytest.raises(DataError, match="val split: 5 tokens"):
        WindowSampler(np.arange(5), seq_len=8, batch_size=2, seed=0, split="val")


def test_bits_per_byte_counts_bytes_of_byte_level_tokens(tmp_path):
    from keel.data.tokenizer import train_bpe
    from keel.train.evaluate import bytes_per_token

    tok = train_bpe(["café naïve résumé " * 50, "plain ascii text " * 50], 300, tmp_path / "tok.json")
    text = "café résumé"
    ids = tok.encode(text)
    assert int(bytes_per_token(tok)[ids].sum()) == len(text.encode("utf-8"))
    assert bytes_per_token(tok)[tok.eos_id] == 0
