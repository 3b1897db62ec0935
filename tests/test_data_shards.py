"""Token shards: `keel data prepare` (workers, rerun, resume, append, BPE sample), training from them (memory maps,
bit-exact resume, two gloo ranks), nanoGPT-style `.bin` files, and bad input.

Expectations are computed without keel.data: documents are read from the JSONL with `json`, the split rule is
written out, shard bytes are compared with the documents' own UTF-8 bytes and checksums with hashlib."""

import errno
import hashlib
import inspect
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import keel.data.shard_writer as shard_writer
from keel.cli import main
from keel.data import DataConfig, DataError, WindowSampler, eval_batches, prepare
from keel.data.shards import TokenShards
from keel.data.tokenizer import train_bpe

pytestmark = pytest.mark.usefixtures("no_curves")  # none of these checks curves.png: each in-process run skips its plot

VAL_FRACTION = 0.1
SHARD_TOKENS = 4000


def in_val(index: int) -> bool:
    """The documented split rule: the first 8 bytes of SHA-256(str(record index)) over 2**64, below the fraction."""
    return int.from_bytes(hashlib.sha256(str(index).encode()).digest()[:8], "big") / 2**64 < VAL_FRACTION


def paragraphs(*modules) -> list[str]:
    return [p for m in modules for p in inspect.getsource(m).split("\n\n") if p.strip()]


def write_jsonl(path: Path, texts: list[str], mode: str = "w") -> Path:
    with open(path, mode) as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return path


def split_texts(path: Path) -> dict[str, list[str]]:
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    return {"train": [t for i, t in enumerate(texts) if not in_val(i)],
            "val": [t for i, t in enumerate(texts) if in_val(i)]}


@pytest.fixture
def jsonl(tmp_path) -> Path:
    """About 60 KB in ~250 records: a dozen train shards of SHARD_TOKENS bytes."""
    import argparse

    return write_jsonl(tmp_path / "corpus.jsonl", paragraphs(argparse)[:250])


def prepare_cli(out: Path, source: Path, *extra: str, workers: int = 2, tokenizer: str = "bytes") -> int:
    return main(["data", "prepare", "--out", str(out), "--workers", str(workers), "--shard-tokens", str(SHARD_TOKENS),
                 f"data.source={source}", f"data.tokenizer={tokenizer}", f"data.val_fraction={VAL_FRACTION}", *extra])


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and modification time."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def contents(directory: Path) -> dict[str, bytes]:
    return {name: data for name, (data, _) in snapshot(directory).items()}


def split_ids(directory: Path, split: str) -> np.ndarray:
    files = sorted(directory.glob(f"{split}-*.bin"))
    return np.concatenate([np.fromfile(f, dtype="<u2") for f in files])


# ---- prepare ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_prepare_writes_the_documents_as_shards_with_a_checked_manifest(jsonl, tmp_path, capsys):
    out = tmp_path / "shards"
    assert prepare_cli(out, jsonl) == 0
    assert "train:" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["name"] == "bytes"
    for split, texts in split_texts(jsonl).items():
        want = b"".join(t.encode() for t in texts)  # bytes tokenizer, no eos: the documents back to back
        assert split_ids(out, split).astype(np.uint8).tobytes() == want
        shards = manifest["splits"][split]["shards"]
        assert [s["tokens"] for s in shards[:-1]] == [SHARD_TOKENS] * (len(shards) - 1)  # fixed size but the last
        assert manifest["splits"][split]["documents"] == len(texts) == sum(s["documents"] for s in shards)
        starts = np.cumsum([0] + [len(t.encode()) for t in texts[:-1]])  # document boundaries, whole split
        got = np.concatenate([np.fromfile(out / s["index"], dtype="<u4") + i * SHARD_TOKENS
                              for i, s in enumerate(shards)])
        assert got.tolist() == starts.tolist()
        for s in shards:
            assert hashlib.sha256((out / s["file"]).read_bytes()).hexdigest() == s["sha256"]
            assert hashlib.sha256((out / s["index"]).read_bytes()).hexdigest() == s["index_sha256"]
    assert len(manifest["splits"]["train"]["shards"]) >= 10


@pytest.mark.slow
def test_the_same_command_again_changes_no_file(jsonl, tmp_path, capsys):
    out = tmp_path / "shards"
    assert prepare_cli(out, jsonl) == 0
    before = snapshot(out)
    assert prepare_cli(out, jsonl) == 0
    assert "up to date, nothing written" in capsys.readouterr().out
    assert snapshot(out) == before  # bytes and modification times


@pytest.mark.slow
def test_one_worker_and_two_write_the_same_bytes(jsonl, tmp_path):
    assert prepare_cli(tmp_path / "one", jsonl, workers=1) == 0
    assert prepare_cli(tmp_path / "two", jsonl, workers=2) == 0
    assert contents(tmp_path / "one") == contents(tmp_path / "two")


class Killed(Exception):
    """Stands for the process dying: nothing after it runs."""


@pytest.mark.slow
def test_a_killed_prepare_resumes_to_the_bytes_of_an_uninterrupted_one(jsonl, tmp_path, monkeypatch):
    assert prepare_cli(tmp_path / "straight", jsonl) == 0
    straight = contents(tmp_path / "straight")

    out = tmp_path / "killed"
    publish, published = shard_writer._publish, []

    def dies_after_three(*args):
        if len(published) == 3:
            raise Killed
        published.append(args)
        publish(*args)

    monkeypatch.setattr(shard_writer, "_publish", dies_after_three)
    with pytest.raises(Killed):
        prepare_cli(out, jsonl)
    monkeypatch.setattr(shard_writer, "_publish", publish)
    (out / ".train-000003.bin.tmp-999-abcd1234").write_bytes(b"half a shard")  # what a SIGKILL leaves
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["splits"]["train"]["shards"]) == 3 and not manifest["splits"]["train"]["complete"]
    kept = snapshot(out)
    assert prepare_cli(out, jsonl) == 0
    assert contents(out) == straight
    assert all(snapshot(out)[f"train-00000{k}.bin"] == kept[f"train-00000{k}.bin"] for k in range(3))  # kept

    # shards deleted at the end (a kill between renaming a shard and rewriting the manifest): made again
    n, v = (len(json.loads((out / "manifest.json").read_text())["splits"][s]["shards"]) for s in ("train", "val"))
    for name in (f"train-{n - 3:06d}.bin", f"train-{n - 2:06d}.idx", f"train-{n - 1:06d}.bin", f"val-{v - 1:06d}.idx"):
        (out / name).unlink()
    assert prepare_cli(out, jsonl, workers=1) == 0
    assert contents(out) == straight


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_the_same_command_then_resumes(jsonl, tmp_path, monkeypatch, capsys):
    assert prepare_cli(tmp_path / "straight", jsonl) == 0
    write, writes = shard_writer._Shard.write, []

    def fills_up(self, ids):
        writes.append(len(ids))
        if sum(writes) > 5 * SHARD_TOKENS:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, ids)

    monkeypatch.setattr(shard_writer._Shard, "write", fills_up)
    out = tmp_path / "full"
    assert prepare_cli(out, jsonl) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "run the command again" in err and len(err.splitlines()) == 1
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # the half-written shard removed
    monkeypatch.setattr(shard_writer._Shard, "write", write)
    assert prepare_cli(out, jsonl) == 0
    assert contents(out) == contents(tmp_path / "straight")


FULL = [  # (the file whose write finds the disk full, which write of it, data.tokenizer)
    ("manifest.json", 1, "bytes"), ("manifest.json", 4, "bytes"), ("train-000002.idx", 1, "bytes"),
    ("tokenizer.json", 1, "FILE"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,nth,tokenizer", FULL, ids=[f"{n} {k}" for n, k, _ in FULL])
def test_a_disk_full_at_the_manifest_an_index_or_the_tokenizer_says_to_resume(name, nth, tokenizer, jsonl, tmp_path,
                                                                               monkeypatch, capsys):
    """keel.safe_io writes these files; a full disk there is the same one line as during a shard (free space, run
    the command again), and the same command then ends with the bytes of an uninterrupted prepare."""
    import keel.safe_io as safe_io

    if tokenizer == "FILE":
        tokenizer = str(train_bpe([jsonl.read_text()], 300, tmp_path / "bpe" / "tokenizer.json").path)
    assert prepare_cli(tmp_path / "straight", jsonl, tokenizer=tokenizer, workers=1) == 0
    temporary, seen = safe_io.temporary, []

    def fills_up(path):
        seen.extend([path.name] if path.name == name else [])
        if seen.count(name) == nth:
            raise OSError(errno.ENOSPC, "No space left on device")
        return temporary(path)

    monkeypatch.setattr(safe_io, "temporary", fills_up)
    out = tmp_path / "full"
    capsys.readouterr()
    assert prepare_cli(out, jsonl, tokenizer=tokenizer, workers=1) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{out / name}: cannot write: no space left" in err, err
    assert err.rstrip().endswith("free space and run the command again to resume"), err
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    monkeypatch.undo()
    assert prepare_cli(out, jsonl, tokenizer=tokenizer, workers=1) == 0
    assert contents(out) == contents(tmp_path / "straight")


@pytest.mark.slow
def test_appended_documents_go_into_new_shards_and_the_old_ones_stay(jsonl, tmp_path):
    import pathlib

    out = tmp_path / "shards"
    assert prepare_cli(out, jsonl) == 0
    old = snapshot(out)
    old_manifest = json.loads((out / "manifest.json").read_text())
    write_jsonl(jsonl, paragraphs(pathlib)[:80], mode="a")
    assert prepare_cli(out, jsonl) == 0
    now = snapshot(out)
    assert all(now[name] == old[name] for name in old if name != "manifest.json")  # bytes and mtimes
    manifest = json.loads((out / "manifest.json").read_text())
    for split, texts in split_texts(jsonl).items():
        before = old_manifest["splits"][split]["shards"]
        assert manifest["splits"][split]["shards"][:len(before)] == before
        assert split_ids(out, split).astype(np.uint8).tobytes() == b"".join(t.encode() for t in texts)
    assert len(manifest["splits"]["train"]["shards"]) > len(old_manifest["splits"]["train"]["shards"])
    before = snapshot(out)
    assert prepare_cli(out, jsonl) == 0
    assert snapshot(out) == before


@pytest.mark.slow
def test_a_bpe_is_trained_on_the_seeded_sample_and_kept(jsonl, tmp_path):
    out = tmp_path / "shards"
    assert prepare_cli(out, jsonl, "--bpe-sample", "30", tokenizer="bpe:300") == 0
    # the documented sample: 30 train records drawn by random.Random(0).sample from the train indices, in order
    texts = [json.loads(line)["text"] for line in jsonl.read_text().splitlines()]
    train = [i for i in range(len(texts)) if not in_val(i)]
    chosen = set(random.Random(0).sample(train, 30))
    alone = train_bpe([t for i, t in enumerate(texts) if i in chosen], 300, tmp_path / "alone.json")
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "alone.json").read_bytes()
    want = [i for t in split_texts(jsonl)["train"] for i in [*alone.encode(t), alone.eos_id]]  # eos after each
    assert split_ids(out, "train").tolist() == want
    before = snapshot(out)
    assert prepare_cli(out, jsonl, tokenizer="bpe:300") == 0  # the BPE is not trained again
    assert snapshot(out) == before


def test_a_bpe_of_another_size_than_data_tokenizer_names_is_refused_before_tokenising(tmp_path, monkeypatch,
                                                                                       capsys):
    """data.tokenizer=bpe asks for the default 4,096 tokens and bpe:512 for 512: a directory whose BPE has 300 is
    one line naming the field and the file, exit 2, and neither tokenises nor writes anything; so is a BPE named
    over shards of bytes."""
    import argparse

    source = write_jsonl(tmp_path / "corpus.jsonl", paragraphs(argparse)[:40])
    out = tmp_path / "shards"
    assert prepare_cli(out, source, "--bpe-sample", "20", tokenizer="bpe:300", workers=1) == 0
    before = snapshot(out)

    def tokenises(*args, **kwargs):
        raise AssertionError("tokenised before refusing")

    monkeypatch.setattr(shard_writer, "_fill", tokenises)
    capsys.readouterr()
    for spec, names in (("bpe", "4,096"), ("bpe:512", "512")):
        assert prepare_cli(out, source, tokenizer=spec, workers=1) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and f"data.tokenizer: {spec} names {names} tokens" in err, err
        assert str(out / "tokenizer.json") in err and "has 300" in err, err
        assert snapshot(out) == before
    plain = tmp_path / "bytes"  # shards of bytes hold no BPE: one is not trained and written beside them
    monkeypatch.undo()
    assert prepare_cli(plain, source, workers=1) == 0
    kept = snapshot(plain)
    monkeypatch.setattr(shard_writer, "_fill", tokenises)
    assert prepare_cli(plain, source, tokenizer="bpe", workers=1) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "data.tokenizer: bpe names the BPE in" in err and "'bytes'" in err
    assert snapshot(plain) == kept
    monkeypatch.undo()
    assert prepare_cli(out, source, tokenizer="bpe:300", workers=1) == 0 and snapshot(out) == before


@pytest.mark.slow
def test_a_bpe_that_came_out_smaller_than_asked_takes_the_same_command_again(tmp_path, capsys):
    """On a sample too small for the 4,096 tokens data.tokenizer=bpe asks, the trainer stops short; the identical
    command then checks, resumes and appends, and another size is refused in one line. A manifest from before the
    size asked was recorded takes a BPE of at most the size named."""
    import argparse
    import pathlib

    from tokenizers import Tokenizer

    source = write_jsonl(tmp_path / "corpus.jsonl", paragraphs(argparse)[:120])
    out, again = tmp_path / "shards", ("--bpe-sample", "20")
    assert prepare_cli(out, source, *again, tokenizer="bpe", workers=1) == 0
    bpe = Tokenizer.from_file(str(out / "tokenizer.json"))
    size, eos = bpe.get_vocab_size(), bpe.token_to_id("<|endoftext|>")
    assert 300 < size < 4096 and len(list(out.glob("train-*.bin"))) > 1
    before = snapshot(out)
    assert prepare_cli(out, source, *again, tokenizer="bpe", workers=1) == 0
    assert snapshot(out) == before  # checked, nothing written
    last = sorted(out.glob("train-*.bin"))[-1]
    last.unlink()  # as a prepare killed before its last shard leaves it
    assert prepare_cli(out, source, *again, tokenizer="bpe", workers=1) == 0
    assert contents(out) == contents_of(before)
    before = snapshot(out)
    write_jsonl(source, paragraphs(pathlib)[:20], mode="a")
    assert prepare_cli(out, source, *again, tokenizer="bpe", workers=1) == 0
    assert all(snapshot(out)[n] == before[n] for n in before if n != "manifest.json")  # bytes and mtimes
    for split, texts in split_texts(source).items():  # the appended documents too, by the BPE's own encoding
        assert split_ids(out, split).tolist() == [i for t in texts for i in [*bpe.encode(t).ids, eos]]
    now = snapshot(out)
    capsys.readouterr()
    assert prepare_cli(out, source, tokenizer="bpe:512", workers=1) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "data.tokenizer: bpe:512 names 512 tokens" in err, err
    assert f"has {size:,} (trained for 4,096); name data.tokenizer=bpe:4096" in err, err
    assert snapshot(out) == now

    # an older keel's manifest, without the size asked: bpe (4,096) holds this BPE, bpe:512 does not
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["bpe_sample"]["vocab_size"]
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    now = snapshot(out)
    assert prepare_cli(out, source, tokenizer="bpe", workers=1) == 0 and snapshot(out) == now
    assert prepare_cli(out, source, tokenizer="bpe:512", workers=1) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"has {size:,}; name data.tokenizer=bpe:{size}" in err, err
    assert snapshot(out) == now


def contents_of(snap: dict[str, tuple[bytes, int]]) -> dict[str, bytes]:
    return {name: data for name, (data, _) in snap.items()}


def _sources(tmp_path: Path, texts: list[str]) -> dict[str, Path]:
    """The same documents as each kind of source prepare reads (a text file: all of them as one)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "dir").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "dir" / f"{i:03d}.txt").write_text(text)
    (tmp_path / "one.txt").write_text("\n\n".join(texts))
    pq.write_table(pa.table({"text": texts}), tmp_path / "data.parquet")
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(tmp_path / "saved")
    return {"text file": tmp_path / "one.txt", "directory": tmp_path / "dir", "parquet": tmp_path / "data.parquet",
            "hf": f"hf:{tmp_path / 'saved'}"}


@pytest.mark.slow
def test_prepare_reads_every_source_keel_train_reads(tmp_path):
    """Shards of a text file, a directory, Parquet and a saved Hugging Face dataset hold the train split's
    documents, as keel train's own corpus reader yields them (tests/test_data.py checks that reader)."""
    import argparse

    from keel.data import build_corpus

    pytest.importorskip("datasets")
    texts = paragraphs(argparse)[:40]
    for name, source in _sources(tmp_path, texts).items():
        out = tmp_path / f"shards-{name}"
        cfg = DataConfig(source=str(source), tokenizer="bytes", val_fraction=VAL_FRACTION)
        shard_writer.prepare_shards(cfg, out, workers=1, shard_tokens=SHARD_TOKENS, progress=False)
        want = b"".join(t.encode() for t in build_corpus(cfg).documents("train"))
        assert split_ids(out, "train").astype(np.uint8).tobytes() == want, name
    with pytest.raises(DataError, match="data.hf_config"):
        build_corpus(DataConfig(source=f"hf:{tmp_path / 'saved'}", hf_config="sample-10BT"))


@pytest.mark.slow
def test_a_document_longer_than_a_piece_has_the_ids_of_the_whole(tmp_path, monkeypatch):
    """A text file cut into pieces of at most PIECE_CHARS (made small here) for encoding: its shards hold the ids
    the BPE gives the whole text at once, with one eos at its end, and a kill mid-document resumes to the same
    bytes."""
    import argparse

    import keel.data.tokenizer as tokenizer

    text = "\n\n".join(paragraphs(argparse)[:120])
    (tmp_path / "one.txt").write_text(text)
    bpe = train_bpe([text], 400, tmp_path / "bpe.json")
    cfg = DataConfig(source=str(tmp_path / "one.txt"), tokenizer=str(tmp_path / "bpe.json"), val_fraction=0)
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", 1000)
    assert len(list(tokenizer.text_pieces([text]))) > 20
    assert "".join(tokenizer.text_pieces([text[i:i + 77] for i in range(0, len(text), 77)])) == text
    shard_writer.prepare_shards(cfg, tmp_path / "whole", workers=2, shard_tokens=SHARD_TOKENS, progress=False)
    assert split_ids(tmp_path / "whole", "train").tolist() == [*bpe.encode(text), bpe.eos_id]
    index = np.fromfile(tmp_path / "whole" / "train-000000.idx", dtype="<u4")
    assert index.tolist() == [0] and not (tmp_path / "whole" / "train-000001.idx").read_bytes()  # one document

    publish, published = shard_writer._publish, []

    def dies_after_two(*args):
        if len(published) == 2:
            raise Killed
        published.append(args)
        publish(*args)

    monkeypatch.setattr(shard_writer, "_publish", dies_after_two)
    with pytest.raises(Killed):
        shard_writer.prepare_shards(cfg, tmp_path / "killed", workers=1, shard_tokens=SHARD_TOKENS, progress=False)
    monkeypatch.setattr(shard_writer, "_publish", publish)
    manifest = json.loads((tmp_path / "killed" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["shards"][-1]["end"]["offset"] == 2 * SHARD_TOKENS  # inside the document
    shard_writer.prepare_shards(cfg, tmp_path / "killed", workers=1, progress=False)
    assert contents(tmp_path / "killed") == contents(tmp_path / "whole")


def _bos_eos_tokenizer(text: str, path: Path):
    """A byte-level BPE whose post-processor puts [BOS] before and [EOS] after every text it encodes, saved to
    `path`; built here with `tokenizers` alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "[BOS]", "[EOS]"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A [EOS]", special_tokens=[
        ("[BOS]", tok.token_to_id("[BOS]")), ("[EOS]", tok.token_to_id("[EOS]"))])
    tok.save(str(path))
    return tok


def test_a_document_in_pieces_gets_the_tokenizers_bos_and_eos_once(tmp_path, monkeypatch):
    """A tokenizer that adds [BOS] and [EOS] to what it encodes, and a document cut into pieces for encoding
    (PIECE_CHARS made small): the shards of `keel data prepare` and of the token cache hold the tokenizer's own
    encoding of each whole document, then the end-of-text id."""
    import argparse

    import keel.data.tokenizer as tokenizer

    texts = paragraphs(argparse)[:40]
    long, short = "\n\n".join(texts[:30]), texts[30]
    whole = _bos_eos_tokenizer(long, tmp_path / "tok.json")
    eos = whole.token_to_id("<|endoftext|>")
    want = [i for doc in (long, short) for i in [*whole.encode(doc).ids, eos]]
    assert want.count(whole.token_to_id("[BOS]")) == 2
    write_jsonl(tmp_path / "docs.jsonl", [long, short])
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", 1000)
    assert len(list(tokenizer.text_pieces([long]))) > 5
    cfg = DataConfig(source=str(tmp_path / "docs.jsonl"), tokenizer=str(tmp_path / "tok.json"), val_fraction=0,
                     cache_dir=str(tmp_path / "cache"))
    shard_writer.prepare_shards(cfg, tmp_path / "shards", workers=1, shard_tokens=SHARD_TOKENS, progress=False)
    assert split_ids(tmp_path / "shards", "train").tolist() == want
    assert np.asarray(prepare(cfg).train).tolist() == want


def test_a_tokenizer_that_ends_each_text_with_its_eos_gets_it_once_a_document(tmp_path, monkeypatch):
    """A Llama-style post-processor ("<s> $A </s>") already ends every text with the end-of-text id keel puts after a
    document: the shards, the token cache and a stream hold each document's own encoding with that id once, and the
    manifest records the rule, so shards made by a keel that doubled it are not appended to."""
    import argparse

    from tokenizers import Tokenizer, processors

    import keel.data.tokenizer as tokenizer
    from keel.data.streaming import TokenStream

    texts = paragraphs(argparse)[:40]
    long, short = "\n\n".join(texts[:30]), texts[30]
    built = _bos_eos_tokenizer(long, tmp_path / "built.json")
    bos, eos = built.token_to_id("[BOS]"), built.token_to_id("<|endoftext|>")
    built.post_processor = processors.TemplateProcessing(single="[BOS] $A <|endoftext|>", special_tokens=[
        ("[BOS]", bos), ("<|endoftext|>", eos)])
    built.save(str(tmp_path / "tok.json"))
    whole = Tokenizer.from_file(str(tmp_path / "tok.json"))
    want = [i for doc in (long, short) for i in whole.encode(doc).ids]
    assert want.count(eos) == 2 and want[-1] == eos and want.count(bos) == 2
    write_jsonl(tmp_path / "docs.jsonl", [long, short])
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", 1000)
    cfg = DataConfig(source=str(tmp_path / "docs.jsonl"), tokenizer=str(tmp_path / "tok.json"), val_fraction=0,
                     cache_dir=str(tmp_path / "cache"))
    shard_writer.prepare_shards(cfg, tmp_path / "shards", workers=1, shard_tokens=SHARD_TOKENS, progress=False)
    assert split_ids(tmp_path / "shards", "train").tolist() == want
    assert np.asarray(prepare(cfg).train).tolist() == want
    loaded = tokenizer.HFTokenizer(tmp_path / "tok.json")
    assert TokenStream([], loaded, "text", "docs").encode([long, short]).tolist() == want
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["tokenizer"]["piece_rule"] == tokenizer.EOS_ONCE
    manifest["tokenizer"]["piece_rule"] = tokenizer.PIECE_RULE  # as a keel that doubled the id recorded it
    (tmp_path / "shards" / "manifest.json").write_text(json.dumps(manifest))
    write_jsonl(tmp_path / "docs.jsonl", texts[31:33], mode="a")
    with pytest.raises(DataError, match="put the end-of-text id twice after each document"):
        shard_writer.prepare_shards(cfg, tmp_path / "shards", workers=1, shard_tokens=SHARD_TOKENS, progress=False)


def _strip_piece_rule(manifest_path: Path) -> None:
    """The manifest as an older keel wrote it, which gave a post-processor's BOS/EOS to every piece of a long
    document and recorded nothing of it."""
    manifest = json.loads(manifest_path.read_text())
    assert manifest["tokenizer"].pop("piece_rule") == "post-processor-once-per-document"
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")


@pytest.mark.slow
def test_shards_an_older_keel_made_with_a_bos_eos_tokenizer_are_not_added_to(tmp_path, capsys):
    """The manifest of shards made with a tokenizer whose post-processor adds ids records how a long document's
    pieces got them; without that record (an older keel) an unchanged corpus is still checked, but resuming or
    appending is one line saying to prepare into a new --out, and nothing is written. Bytes and a BPE keel trains
    (no post-processor) write the tokenizer record as before: name, vocab_size, eos_id."""
    import argparse

    texts = paragraphs(argparse)[:80]
    _bos_eos_tokenizer("\n\n".join(texts), tmp_path / "tok.json")
    source, out = write_jsonl(tmp_path / "docs.jsonl", texts[:60]), tmp_path / "shards"
    assert prepare_cli(out, source, tokenizer=str(tmp_path / "tok.json"), workers=1) == 0
    _strip_piece_rule(out / "manifest.json")
    before = snapshot(out)
    assert prepare_cli(out, source, tokenizer=str(tmp_path / "tok.json"), workers=1) == 0
    assert snapshot(out) == before
    last = sorted(out.glob("train-*.idx"))[-1]
    for change in ("append", "resume"):
        if change == "append":
            write_jsonl(source, texts[60:], mode="a")
        else:
            write_jsonl(source, texts[:60])
            last.unlink()  # as a prepare killed before its last shard leaves it
        capsys.readouterr()
        assert prepare_cli(out, source, tokenizer=str(tmp_path / "tok.json"), workers=1) == 2, change
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and str(out / "manifest.json") in err, err
        assert "older keel" in err and err.rstrip().endswith("prepare into a new --out"), err
        assert snapshot(out) == {k: v for k, v in before.items() if change == "append" or k != last.name}
    for tokenizer in ("bytes", "bpe:300"):
        made = tmp_path / tokenizer.replace(":", "")
        assert prepare_cli(made, source, "--bpe-sample", "20", tokenizer=tokenizer, workers=1) == 0
        assert set(json.loads((made / "manifest.json").read_text())["tokenizer"]) == {"name", "vocab_size", "eos_id"}


@pytest.mark.slow
def test_a_token_cache_an_older_keel_made_with_a_bos_eos_tokenizer_is_made_again_beside_it(tmp_path, capsys,
                                                                                           monkeypatch):
    """A tokenizer whose post-processor adds ids gets a token cache of its own key: the cache an older keel made
    under the key of corpus and tokenizer alone (a long document's pieces each with BOS/EOS) is named in one line,
    left as it is, and not read. Bytes and a BPE keel trains keep that key: SHA-256(fingerprint + name)."""
    import argparse

    import keel.data.tokenizer as tokenizer
    from keel.data import build_corpus

    texts = paragraphs(argparse)[:40]
    long = "\n\n".join(texts[:30])
    whole = _bos_eos_tokenizer(long, tmp_path / "tok.json")
    eos = whole.token_to_id("<|endoftext|>")
    write_jsonl(tmp_path / "docs.jsonl", [long, texts[30]])
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", 1000)

    def cfg(cache, tok=str(tmp_path / "tok.json")):
        return DataConfig(source=str(tmp_path / "docs.jsonl"), tokenizer=tok, val_fraction=0,
                          cache_dir=str(tmp_path / cache))

    fingerprint = build_corpus(cfg("a")).fingerprint
    first = prepare(cfg("a"))
    plain = hashlib.sha256((fingerprint + first.tokenizer.name).encode()).hexdigest()[:16]  # the older keel's key
    assert first.cache_path.name != plain
    old = tmp_path / "b" / "shards" / plain
    shutil.copytree(first.cache_path, old)
    _strip_piece_rule(old / "manifest.json")
    kept = contents(old)
    capsys.readouterr()
    data = prepare(cfg("b"))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and str(old) in lines[0] and "older keel" in lines[0] and str(data.cache_path) in lines[0]
    assert data.cache_path == tmp_path / "b" / "shards" / first.cache_path.name != old
    assert np.asarray(data.train).tolist() == [i for doc in (long, texts[30]) for i in [*whole.encode(doc).ids, eos]]
    assert contents(old) == kept
    prepare(cfg("b"))
    assert capsys.readouterr().err == ""
    for tok in ("bytes", "bpe:300"):  # no post-processor: the key and manifest every existing cache has
        data = prepare(cfg("c", tok))
        assert data.cache_path.name == hashlib.sha256((fingerprint + data.tokenizer.name).encode()).hexdigest()[:16]
        assert set(json.loads((data.cache_path / "manifest.json").read_text())["tokenizer"]) == {
            "name", "vocab_size", "eos_id"}


PREPARE_RSS_SCRIPT = textwrap.dedent("""
    import sys
    from keel.data.corpus import DataConfig
    from keel.data.shard_writer import prepare_shards
    def mb(field):
        line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
        return int(line.split()[1]) / 1024
    base = mb("VmRSS")
    cfg = DataConfig(source=sys.argv[1], tokenizer="bytes", val_fraction=0.01)
    done = prepare_shards(cfg, sys.argv[2], workers=1, progress=False)
    print(base, mb("VmHWM"), done["splits"]["train"]["tokens"])
""")


@pytest.mark.slow
def test_preparing_a_large_text_file_keeps_memory_bounded(tmp_path):
    """A 64 MB text file (one document) into shards: resident memory grows by < 64 MB (reading it whole, with its
    ids, took over 300), and the shards hold its bytes up to the validation cut."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "über", "naïve", "x", "seventeen", "the", "of", "and"]
    block = "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(16000)) + "\n"
    path = tmp_path / "big.txt"
    with open(path, "w") as f:
        for _ in range((64 << 20) // len(block.encode()) + 1):
            f.write(block)
    done = subprocess.run([sys.executable, "-c", PREPARE_RSS_SCRIPT, str(path), str(tmp_path / "shards")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    base, peak, tokens = map(float, done.stdout.split())
    assert peak - base < 64, done.stdout
    text = path.read_text()
    cut = text.index("\n", int(len(text) * 0.99)) + 1  # the documented cut: the line end after 99% of the text
    want = text[:cut].encode()
    assert tokens == len(want) and split_ids(tmp_path / "shards", "train").astype(np.uint8).tobytes() == want


# ---- training from shards -----------------------------------------------------------------------------

def test_windows_over_shards_are_the_windows_of_one_array(tmp_path):
    """Rows that cross shard boundaries, and the sampler and validation windows, as from the concatenation."""
    rng = np.random.default_rng(0)
    counts = [7, 1, 30, 5, 64]
    paths, arrays = [], []
    for k, n in enumerate(counts):
        arrays.append(rng.integers(0, 500, n).astype("<u2"))
        paths.append(tmp_path / f"train-{k:06d}.bin")
        arrays[-1].tofile(paths[-1])
    whole = np.concatenate(arrays)
    shards = TokenShards(paths, counts, "<u2", "test")
    starts = np.arange(len(whole) - 9)
    assert np.array_equal(shards.windows(starts, 10), whole[starts[:, None] + np.arange(10)])
    with pytest.raises(IndexError):
        shards.windows([len(whole) - 9], 10)
    a, b = (WindowSampler(t, 8, 4, seed=3, vocab_size=500) for t in (shards, whole))
    for _ in range(5):
        for x, y in zip(a.next_batch(), b.next_batch()):
            assert torch.equal(x, y)
    for (xa, ya), (xb, yb) in zip(eval_batches(shards, 8, 3, 4), eval_batches(whole, 8, 3, 4)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # a slice (the experiments' halves of the validation split) reads the same files as the array's slice
    assert np.array_equal(np.asarray(shards), whole) and np.asarray(shards).dtype == np.uint16
    for part, want in ((shards[5:40], whole[5:40]), (shards[5:40][3:], whole[5:40][3:]), (shards[-9:], whole[-9:]),
                       (shards[60:30], whole[60:30])):
        assert len(part) == len(want) and np.array_equal(np.asarray(part), want)
    part, want = shards[:len(whole) // 2], whole[:len(whole) // 2]
    starts = np.arange(len(want) - 9)
    assert np.array_equal(part.windows(starts, 10), want[starts[:, None] + np.arange(10)])
    with pytest.raises(IndexError):
        part.windows([len(want) - 9], 10)


def test_counting_ids_a_chunk_at_a_time_is_bincount_of_the_whole(tmp_path, monkeypatch):
    """The train split's id counts and the unigram loss built on them, read at most COUNT_CHUNK ids at a time over
    shards (chunks crossing shard boundaries, ids past 255): the numbers of the whole array, to the last bit."""
    import keel.data.shards as shards
    from keel.experiments.common import fixed_batches, unigram_loss

    rng, counts, paths = np.random.default_rng(1), [50, 3, 120, 1, 77], []
    arrays = [rng.integers(0, 300 if k == 2 else 200, n).astype("<u2") for k, n in enumerate(counts)]
    for k, ids in enumerate(arrays):
        paths.append(tmp_path / f"train-{k:06d}.bin")
        ids.tofile(paths[-1])
    whole, split = np.concatenate(arrays), TokenShards(paths, counts, "<u2", "test")
    monkeypatch.setattr(shards, "COUNT_CHUNK", 16)
    read = TokenShards.__array__

    def bounded(self, *args, **kwargs):
        assert len(self) <= 16, f"{len(self)} ids read at once"
        return read(self, *args, **kwargs)

    monkeypatch.setattr(TokenShards, "__array__", bounded)
    want = np.bincount(whole, minlength=256)
    got = shards.token_counts(split, minlength=256)
    assert got.dtype == want.dtype and np.array_equal(got, want) and len(got) == whole.max() + 1 > 256
    assert np.array_equal(shards.token_counts(split[:40], minlength=256), np.bincount(whole[:40], minlength=256))
    batches = fixed_batches(whole[::-1].copy(), 8, 4, 2)
    logp = np.log((want.astype(np.float64) + 1.0) / (want.astype(np.float64) + 1.0).sum())
    targets = np.concatenate([y.numpy().ravel() for _, y in batches])
    assert unigram_loss(split, batches) == float(-logp[targets].mean())


@pytest.fixture
def shard_dir(jsonl, tmp_path) -> Path:
    out = tmp_path / "shards"
    assert prepare_cli(out, jsonl) == 0
    return out


def losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r and "event" not in r]


@pytest.mark.slow
def test_train_reads_the_shards_and_resumes_bit_exact(shard_dir, trainer_for):
    extra = (f"data.source={shard_dir}", "data.tokenizer=bytes", "run.ckpt_every=5")
    straight = trainer_for(*extra, name="straight")
    assert isinstance(straight.data.train, TokenShards)
    assert len(straight.data.train) == len(split_ids(shard_dir, "train"))
    straight.run()

    def kill(trainer, step):
        if step == 13:
            raise Killed

    killed = trainer_for(*extra, name="killed", callbacks=[kill])
    with pytest.raises(Killed):
        killed.run()
    assert main(["train", f"resume={killed.run_dir}", "run.progress=false"]) == 0
    assert losses(killed.run_dir) == losses(straight.run_dir)  # every logged loss, bit for bit
    assert len(losses(straight.run_dir)) == 20
    run = json.loads((straight.run_dir / "run.json").read_text())
    assert run["data"]["shards"] == str(shard_dir) and run["data"]["fingerprint"]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_gloo_ranks_train_from_shards_as_one_process_and_resume_bit_exact(shard_dir, tmp_path, torchrun):
    common = [f"data.source={shard_dir}", "data.tokenizer=bytes", f"data.cache_dir={tmp_path / 'cache'}",
              f"run.out_dir={tmp_path / 'runs'}", "run.steps=8", "run.ckpt_every=4", "run.eval_every=0",
              "run.curves=false"]
    runs = tmp_path / "runs"
    torchrun("keel.cli", "train", "--preset", "tiny", *common, "run.batch_size=2", "run.name=ranks", timeout=300)
    two = losses(runs / "ranks")
    assert len(two) == 8
    part = shutil.copytree(runs / "ranks", runs / "part")
    shutil.rmtree(part / "checkpoints" / "step_00000008")
    torchrun("keel.cli", "train", f"resume={part}", timeout=300)
    assert losses(part) == two  # bit for bit
    assert main(["train", "--preset", "tiny", *common, "run.batch_size=4", "run.name=one", "run.progress=false"]) == 0
    assert [s for s, _ in losses(runs / "one")] == [s for s, _ in two]
    assert [v for _, v in losses(runs / "one")] == pytest.approx([v for _, v in two], rel=1e-5)


def test_a_nanogpt_bin_trains_with_its_tokenizer_named(tmp_path):
    text = inspect.getsource(json.decoder).encode()
    ids = np.frombuffer(text, dtype=np.uint8).astype("<u2")
    ids[:9000].tofile(tmp_path / "train.bin")
    ids[9000:].tofile(tmp_path / "val.bin")
    data = prepare(DataConfig(source=str(tmp_path / "train.bin"), tokenizer="bytes", cache_dir=str(tmp_path)))
    assert len(data.train) == 9000 and len(data.val) == len(ids) - 9000
    x, y = next(eval_batches(data.val, 16, 1, 1))
    assert bytes(x[0].tolist()) == text[9000:9016] and bytes(y[0].tolist()) == text[9001:9017]
    # modded-nanogpt's header (magic, version, count in 256 int32), and no val file: the last val_fraction
    header = np.zeros(256, dtype="<i4")
    header[:3] = 20240520, 1, len(ids)
    with open(tmp_path / "fineweb_000001.bin", "wb") as f:
        f.write(header.tobytes() + ids.tobytes())
    data = prepare(DataConfig(source=str(tmp_path / "fineweb_000001.bin"), tokenizer="bytes", val_fraction=0.5))
    assert len(data.train) + len(data.val) == len(ids) and len(data.val) == len(ids) // 2
    x, _ = next(eval_batches(data.val, 16, 1, 1))
    assert bytes(x[0].tolist()) == text[len(ids) - len(ids) // 2:][:16]
    with pytest.raises(DataError, match="name the tokenizer"):
        prepare(DataConfig(source=str(tmp_path / "train.bin"), tokenizer="bpe"))


# ---- bad input: one line, exit 2, nothing lost ----------------------------------------------------------

def _wrong_checksum(out: Path) -> None:
    path = out / "train-000001.bin"
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    path.write_bytes(bytes(data))


def _edit_manifest(change):
    def edit(out: Path) -> None:
        manifest = json.loads((out / "manifest.json").read_text())
        change(manifest)
        (out / "manifest.json").write_text(json.dumps(manifest))
    return edit


def _big_tokenizer(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models

    path = tmp_path / "big.json"
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(70_000)}, unk_token="t0")).save(str(path))
    return path


BAD = [  # (id, damage to the directory, tokenizer for training, what the line says)
    ("wrong checksum", _wrong_checksum, "bytes", "train-000001.bin: its SHA-256 is not the one manifest.json"),
    ("a file outside", _edit_manifest(lambda m: m["splits"]["train"]["shards"][0].update(file="../corpus.jsonl")),
     "bytes", "is not a shard file of this directory"),
    ("vocabulary larger than the dtype", _edit_manifest(lambda m: m["tokenizer"].update(vocab_size=70_000)),
     "bytes", "does not fit its uint16 shards"),
    ("another tokenizer", lambda out: None, "BIG", "differs from 'bytes'"),
]


@pytest.mark.slow
@pytest.mark.parametrize("damage,tokenizer,says", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_shards_are_one_line_exit_2_and_nothing_is_lost(damage, tokenizer, says, shard_dir, jsonl, tmp_path,
                                                            capsys):
    damage(shard_dir)
    tokenizer = str(_big_tokenizer(tmp_path)) if tokenizer == "BIG" else tokenizer
    before = snapshot(shard_dir)
    capsys.readouterr()
    for argv in (["train", "--preset", "tiny", f"data.source={shard_dir}", f"data.tokenizer={tokenizer}",
                  "model.vocab_size=70000", f"run.out_dir={tmp_path / 'runs'}"],
                 ["data", "prepare", "--out", str(shard_dir), f"data.source={jsonl}", f"data.tokenizer={tokenizer}",
                  f"data.val_fraction={VAL_FRACTION}"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("keel: error:") and len(err.strip().splitlines()) == 1 and says in err, err
        assert snapshot(shard_dir) == before  # not a byte or a timestamp changed
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_bin_whose_vocabulary_does_not_fit_uint16_is_refused(tmp_path):
    np.arange(100, dtype="<u2").tofile(tmp_path / "train.bin")
    with pytest.raises(DataError, match="does not fit") as err:
        prepare(DataConfig(source=str(tmp_path / "train.bin"), tokenizer=str(_big_tokenizer(tmp_path))))
    assert "\n" not in str(err.value)


def test_prepare_refuses_a_directory_it_did_not_write(jsonl, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert prepare_cli(out, jsonl) == 2
    assert "no manifest.json" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def _outside(tmp_path: Path) -> Path:
    (tmp_path / "outside").mkdir()
    (path := tmp_path / "outside" / "keep.bin").write_bytes(b"not keel's")
    return path


def test_a_link_planted_at_the_tokenizer_file_is_refused(jsonl, tmp_path, capsys):
    keep, out = _outside(tmp_path), tmp_path / "shards"
    train_bpe([jsonl.read_text()], 300, tmp_path / "bpe" / "tokenizer.json")
    out.mkdir()
    (out / "tokenizer.json").symlink_to(keep)
    assert prepare_cli(out, jsonl, tokenizer=str(tmp_path / "bpe"), workers=1) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "tokenizer.json: is a symbolic link" in err, err
    assert keep.read_bytes() == b"not keel's" and [p.name for p in out.iterdir()] == ["tokenizer.json"]


@pytest.mark.parametrize("suffix", ["bin", "idx"])
def test_a_link_planted_at_the_next_shard_is_refused(suffix, jsonl, tmp_path, capsys, monkeypatch):
    keep, out, publish = _outside(tmp_path), tmp_path / "shards", shard_writer._publish

    def dies_after_one(*args):
        publish(*args)
        raise Killed

    monkeypatch.setattr(shard_writer, "_publish", dies_after_one)
    with pytest.raises(Killed):
        prepare_cli(out, jsonl, workers=1)
    monkeypatch.undo()
    (out / f"train-000001.{suffix}").symlink_to(keep)
    assert prepare_cli(out, jsonl, workers=1) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"train-000001.{suffix}: is a symbolic link" in err, err
    assert keep.read_bytes() == b"not keel's" and not [p for p in out.iterdir() if p.name.startswith(".")]


# ---- memory -------------------------------------------------------------------------------------------

# VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's peak (Linux carries it over fork and exec)
RSS_SCRIPT = textwrap.dedent("""
    import sys
    from keel.data import DataConfig, WindowSampler, eval_batches, prepare
    def mb(field):
        line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
        return int(line.split()[1]) / 1024
    base = mb("VmRSS")
    data = prepare(DataConfig(source=sys.argv[1], tokenizer="bytes", cache_dir=sys.argv[2]))
    sampler = WindowSampler(data.train, 1024, 16, seed=0, vocab_size=256)
    for _ in range(200):
        sampler.next_batch()
    for _ in eval_batches(data.val, 1024, 16, 20, vocab_size=256):
        pass
    print(base, mb("VmRSS"), mb("VmHWM"), len(data.train))
""")


@pytest.mark.slow
def test_reading_a_1gb_shard_set_keeps_memory_bounded(tmp_path):
    """Checksums, sampling and validation windows over 1 GB of shards: resident memory grows by < 200 MB."""
    out, rng, chunk = tmp_path / "big", np.random.default_rng(0), 64 << 20  # ids per shard: 128 MB of uint16
    out.mkdir()
    splits = {"train": [], "val": []}
    # one shard's random ids, written to each of the 8 files (what is read, checked and resident is the same as
    # with 8 different draws; drawing and hashing 128 MB once, not 8 times)
    ids = rng.integers(0, 256, chunk, dtype=np.uint16)
    sha = lambda data: hashlib.sha256(data).hexdigest()  # noqa: E731
    ids_sha, index_sha = sha(ids.tobytes()), sha(np.zeros(1, "<u4").tobytes())
    for k in range(8):
        split, index = ("train", k) if k < 7 else ("val", 0)
        name = f"{split}-{index:06d}"
        ids.tofile(out / f"{name}.bin")
        np.zeros(1, "<u4").tofile(out / f"{name}.idx")
        splits[split].append({"file": f"{name}.bin", "tokens": chunk, "sha256": ids_sha,
                              "index": f"{name}.idx", "index_sha256": index_sha, "documents": 1,
                              "end": {"document": 1, "offset": 0, "digest": "0" * 64}})
    del ids
    manifest = {"format": "keel-shards-1", "dtype": "uint16", "shard_tokens": chunk,
                "tokenizer": {"name": "bytes", "vocab_size": 256, "eos_id": None}, "bpe_sample": None,
                "corpus": {"source": "random", "kind": "test", "fingerprint": "0" * 64},
                "splits": {s: {"complete": True, "documents": len(v), "tokens": chunk * len(v), "shards": v}
                           for s, v in splits.items()}}
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert sum(f.stat().st_size for f in out.iterdir()) > 2**30
    done = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(out), str(tmp_path / "cache")], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    base, now, peak, n = map(float, done.stdout.split())
    assert n == 7 * chunk
    assert peak - base < 200 and now - base < 200, done.stdout
