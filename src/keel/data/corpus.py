"""Corpora and their train/val split, which hashes each document's identity so it does not move when documents are
added or removed (docs/internals.md#keeldatacorpus)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from pathlib import Path

from keel.data import text_stream
from keel.errors import DataError, optional
from keel.safe_io import loads_json

FORMAT = "keel-tokens-1"  # part of every fingerprint, so of every cache key: change it when the split rule changes
SPLITS = ("train", "val")
TEXT_SUFFIXES = frozenset(".txt .text .md .markdown .rst .py .pyi .tex .c .h .cc .cpp .hpp .rs .go .java .js .ts "
                          ".html .css .sh .toml .yaml .yml .ini .cfg .csv .tsv .xml".split())
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonlines")


@dataclass
class DataConfig:
    """Where the text comes from, how it is split and tokenised, and where the tokens are cached."""

    source: str = "stdlib"  # "stdlib" | a text file | a directory | .jsonl | .parquet | "hf:<path or name>"
    text_field: str = "text"  # the text key/column of JSONL, Parquet and Hugging Face records
    hf_split: str = "train"  # the split of a Hugging Face dataset to read
    hf_config: str = ""  # a Hugging Face dataset's config (subset), e.g. "sample-10BT"; empty: its default
    tokenizer: str = "bytes"  # "bytes" | "bpe" | "bpe:<vocab_size>" | a path to a tokenizer.json
    val_fraction: float = 0.02  # share of documents held out for validation
    cache_dir: str = ""  # empty: $KEEL_CACHE if set, else ~/.cache/keel
    streaming: bool = False  # tokenise an hf: dataset, JSONL or Parquet as training reads it (keel.data.streaming)


def cache_root(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir or os.environ.get("KEEL_CACHE") or "~/.cache/keel").expanduser()


# ---- corpora ---------------------------------------------------------------------------------------

class Corpus:
    """The documents of one source, split deterministically into "train" and "val".

    `documents(split)` yields a split's documents in a fixed order, leaving out empty and all-whitespace
    ones; `fingerprint` is a SHA-256 that changes when the data, the source or the split does;
    `describe()` is what a run records."""

    kind = ""

    def __init__(self, cfg: DataConfig):
        self.spec, self.val_fraction, self.text_field = cfg.source, cfg.val_fraction, cfg.text_field

    def documents(self, split: str) -> Iterator[str]:
        for document in self.document_streams(split):
            yield "".join(document)

    def document_streams(self, split: str) -> Iterator[Iterable[str]]:
        """The documents of `split` (those of `documents`), each as consecutive pieces of its text that can be
        iterated more than once: a file is read a block at a time, never whole, so a file larger than memory can
        be trained on and tokenised (what `keel tokenizer`, a BPE, `keel data prepare` and the token cache read)."""
        if split not in SPLITS:
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        val = _val_keys(self.keys(), self.val_fraction)
        yield from self._streams(lambda key: (key in val) == (split == "val"))

    @cached_property
    def fingerprint(self) -> str:
        state = [FORMAT, self.spec, self.val_fraction, *self.state()]
        return hashlib.sha256(json.dumps(state).encode()).hexdigest()

    def describe(self) -> dict:
        return {"source": self.spec, "kind": self.kind, **self.size(), "fingerprint": self.fingerprint}

    def sample(self, n: int, seed: int = 0) -> Iterator[Iterable[str]]:
        """At most `n` documents of the train split, drawn uniformly with `seed` and yielded in corpus order, each
        a string or its pieces as `document_streams` gives them: what a BPE is trained on, so that its cost does
        not grow with the corpus."""
        return self._streams(set(self._sampled_keys(n, seed)).__contains__)

    def _streams(self, want: Callable) -> Iterator[Iterable[str]]:
        """Each document with text whose identity `want` accepts, as `document_streams` gives it."""
        for _, text in self.records(want):
            if _has_text(text):
                yield (text,)

    def _sampled_keys(self, n: int, seed: int) -> list:
        keys = list(self.keys())
        val = _val_keys(keys, self.val_fraction)
        train = [k for k in keys if k not in val]
        return random.Random(seed).sample(train, min(n, len(train)))

    # each source defines these
    def keys(self) -> Iterable:
        """The identity of every document, in order."""
        raise NotImplementedError

    def records(self, want: Callable) -> Iterator[tuple[object, str | None]]:
        """(identity, text) of each document whose identity `want` accepts (a source of files, read a block at a
        time, defines `_streams` instead)."""
        raise NotImplementedError

    def state(self) -> list:
        """What the fingerprint hashes besides the source spec."""
        raise NotImplementedError

    def size(self) -> dict:
        raise NotImplementedError


class _Files(Corpus):
    """Every text file under a directory, one document each, found in sorted order; files that are not
    UTF-8 text are skipped and listed in `describe()`."""

    def __init__(self, cfg: DataConfig, root: Path, suffixes, prune=(), kind="directory"):
        super().__init__(cfg)
        self.root, self.kind, self.skipped = root, kind, set()
        self.files = text_stream.walk(root, suffixes, prune)  # [(relative path, size, mtime_ns)]
        if not self.files:
            raise DataError(f"{root}: no text files (suffixes {', '.join(sorted(suffixes))}) in this directory")

    def keys(self):
        return [rel for rel, _, _ in self.files]

    def _streams(self, want):
        for rel in self.keys():
            if not want(rel):
                continue
            try:  # the whole file checked before any of it is used: one that is not text is skipped whole
                blocks = text_stream.scan(self.root / rel)
            except text_stream.NotText:
                self.skipped.add(rel)
                continue
            if (text := text_stream.Text(self.root / rel, blocks)).has_text():  # an all-whitespace file is left out
                yield text

    def state(self):
        return [str(self.root.resolve()), self.files]

    def size(self):
        return {"root": str(self.root), "files": len(self.files), "bytes": sum(s for _, s, _ in self.files),
                "skipped_files": len(self.skipped), "skipped": sorted(self.skipped)[:20]}


class _OneFile(Corpus):
    """A source in one file; its fingerprint is the file's path, size and modification time."""

    def __init__(self, cfg: DataConfig, path: Path):
        super().__init__(cfg)
        self.path, self.stat = path, _readable(path)

    def state(self):
        return [str(self.path.resolve()), self.stat.st_size, self.stat.st_mtime_ns]

    def size(self):
        return {"files": 1, "bytes": self.stat.st_size}


class _TextFile(_OneFile):
    kind = "text"

    def sample(self, n: int, seed: int = 0):
        return self.document_streams("train")  # one document: the whole train part, read a block at a time

    def document_streams(self, split: str):
        """The file read twice a block at a time (checked and measured, then streamed)."""
        if split not in SPLITS:
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        try:
            blocks = text_stream.scan(self.path)
        except text_stream.NotText as err:
            raise DataError(f"{self.path}: not a UTF-8 text file ({err}; binary data or another encoding)") from None
        n = blocks[-1].chars
        target = int(n * (1 - self.val_fraction))
        end = text_stream.find(self.path, blocks, "\n", target)
        cut = target if end == -1 or self.val_fraction == 0 else end + 1
        text = text_stream.Text(self.path, blocks, 0, cut) if split == "train" else text_stream.Text(
            self.path, blocks, cut)
        if text.has_text():
            yield text


class _Records(_OneFile):
    """Records in one file; a document is a record's `text_field`, its identity the record's index."""

    count: int

    def keys(self):
        return range(self.count)

    def state(self):
        return [*super().state(), self.text_field]

    def size(self):
        return {**super().size(), "records": self.count}


class _Jsonl(_Records):
    """One JSON object per line; blank lines are not records."""

    kind = "jsonl"

    @cached_property
    def count(self) -> int:
        with open(self.path, "rb") as f:
            return sum(1 for line in f if line.strip())

    def records(self, want):
        index = 0
        with open(self.path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if want(index):
                    where = f"{self.path}:{lineno}"
                    try:  # bounded depth: a record nested 100,000 deep is a RecursionError in json.loads
                        record = loads_json(line, bound_ints=False)
                    except ValueError as err:
                        raise DataError(f"{where}: not valid JSON ({str(err)[:80]})") from None
                    if not isinstance(record, dict) or self.text_field not in record:
                        raise DataError(f"{where}: no field {self.text_field!r} (data.text_field)")
                    yield index, _as_text(record[self.text_field], where, self.text_field)
                index += 1


class _Parquet(_Records):
    kind = "parquet"

    def __init__(self, cfg: DataConfig, path: Path):
        super().__init__(cfg, path)
        pq = optional("pyarrow.parquet", "data", f"data.source {cfg.source!r}", DataError)
        try:
            self.file = pq.ParquetFile(path)
        except Exception as err:  # pyarrow raises ArrowInvalid and friends
            raise DataError(f"{path}: not a readable Parquet file ({_first_line(err)})") from None
        need_column(path, self.text_field, self.file.schema_arrow.names)

    @cached_property
    def count(self) -> int:
        return self.file.metadata.num_rows

    def records(self, want):
        batches = self.file.iter_batches(columns=[self.text_field], batch_size=1024)
        return _wanted((b.column(0).to_pylist() for b in batches), want, f"{self.path} row", self.text_field)


class _HFDataset(Corpus):
    """A Hugging Face dataset: saved with `save_to_disk` when the path exists, else loaded by name
    (which needs the network)."""

    kind = "hf"

    def __init__(self, cfg: DataConfig):
        super().__init__(cfg)
        datasets = optional("datasets", "data", f"data.source {cfg.source!r}", DataError)
        name, local = cfg.source.removeprefix("hf:"), Path(cfg.source.removeprefix("hf:")).expanduser()
        if local.exists():
            ds = load_saved(cfg, local, datasets)
        else:
            try:
                ds = datasets.load_dataset(name, cfg.hf_config or None, split=cfg.hf_split)
            except Exception as err:  # many error types, from the file system to the network
                raise DataError(f"{cfg.source}: cannot load the dataset ({_first_line(err)})") from None
        need_column(cfg.source, self.text_field, ds.column_names)
        # the dataset's own fingerprint follows its content and every transform applied to it
        self.id = getattr(ds, "_fingerprint", None) or f"{name}:{len(ds)}"
        self.split, self.subset, self.ds = cfg.hf_split, cfg.hf_config, ds.select_columns([self.text_field])

    def keys(self):
        return range(len(self.ds))

    def records(self, want):
        batches = self.ds.iter(batch_size=1024)
        return _wanted((b[self.text_field] for b in batches), want, f"{self.spec} record", self.text_field)

    def sample(self, n: int, seed: int = 0) -> Iterator[str]:
        picked = self.ds.select(sorted(self._sampled_keys(n, seed)))  # random access: only these are read
        for i, batch in enumerate(picked.iter(batch_size=1024)):
            for value in batch[self.text_field]:
                if _has_text(text := _as_text(value, f"{self.spec} sample batch {i}", self.text_field)):
                    yield text

    def state(self):
        # the config only when named, so that a corpus's fingerprint (its token cache's key) stays as it was
        return [self.id, self.split, self.text_field, *([self.subset] if self.subset else [])]

    def size(self):
        return {"records": len(self.ds)}


def build_corpus(cfg: DataConfig) -> Corpus:
    """The Corpus that `cfg.source` names."""
    if not 0 <= cfg.val_fraction < 1:
        raise DataError(f"data.val_fraction: got {cfg.val_fraction!r}; allowed: a number in [0, 1)")
    if cfg.source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return _Files(cfg, root, {".py"}, prune={"site-packages", "dist-packages", "__pycache__"}, kind="stdlib")
    if cfg.source.startswith("hf:"):
        return _HFDataset(cfg)
    path = Path(cfg.source).expanduser()
    if path.is_dir():
        return _Files(cfg, path, TEXT_SUFFIXES)
    if not path.exists():
        why = "a link to nothing (a loop or a missing target)" if path.is_symlink() else "no such file or directory"
        raise DataError(f"{path}: {why} (data.source)")
    reader = {".parquet": _Parquet, **dict.fromkeys(JSONL_SUFFIXES, _Jsonl)}.get(path.suffix.lower(), _TextFile)
    return reader(cfg, path)


def load_saved(cfg: DataConfig, path: Path, datasets):
    """Split data.hf_split of the dataset saved at `path` (`save_to_disk`), or the dataset when it has no splits."""
    if cfg.hf_config:
        raise DataError(f"data.hf_config: {cfg.hf_config!r} is for a dataset on the hub; {path} is a saved dataset "
                        "(save_to_disk), read whole")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as err:  # many error types, from the file system to arrow
        raise DataError(f"{cfg.source}: cannot load the dataset ({_first_line(err)})") from None
    if isinstance(ds, datasets.DatasetDict):
        if cfg.hf_split not in ds:
            raise DataError(f"data.hf_split: {cfg.hf_split!r} is not a split of {cfg.source}; splits: {', '.join(ds)}")
        ds = ds[cfg.hf_split]
    return ds


def need_column(source, field: str, columns) -> None:
    """DataError naming the columns there are when `field` (data.text_field) is not one of `columns`."""
    if field not in columns:
        raise DataError(f"{source}: no column {field!r} (data.text_field); columns: {', '.join(columns)}")


def _unit_hash(key) -> float:
    """A document identity mapped to [0, 1): the first 8 bytes of SHA-256(str(key)) over 2**64."""
    return int.from_bytes(hashlib.sha256(str(key).encode()).digest()[:8], "big") / 2**64


def _val_keys(keys: Iterable, fraction: float) -> set:
    """Identities whose hash is below `fraction`. With two or more documents each split gets at least
    one (the lowest hash goes to val, the highest to train), so a small corpus can still be validated on."""
    if fraction <= 0:
        return set()
    val, n, lowest, highest = set(), 0, (2.0, None), (-1.0, None)
    for key in keys:
        h, n = _unit_hash(key), n + 1
        if h < fraction:
            val.add(key)
        if h < lowest[0]:
            lowest = (h, key)
        if h > highest[0]:
            highest = (h, key)
    if n >= 2 and not val:
        val.add(lowest[1])
    elif n >= 2 and len(val) == n:
        val.discard(highest[1])
    return val


def _readable(path: Path) -> os.stat_result:
    """The stat of a regular file that can be read: a FIFO is not waited on, and a device (/dev/zero, which
    never ends) is refused, as is anything else that is not a file of known size."""
    try:
        with text_stream.open_file(path) as f:
            return os.fstat(f.fileno())
    except text_stream.NotText:
        raise DataError(f"{path}: not a regular file (data.source must be a file, a directory, 'stdlib' or "
                        "hf:...)") from None


def _has_text(text: str | None) -> bool:
    """False for None, "" and whitespace only: such documents are left out."""
    return bool(text) and not text.isspace()


def _wanted(columns: Iterable[list], want: Callable, where: str, field: str) -> Iterator[tuple[int, str | None]]:
    """(index, text) of each value, in order, of a text column read in batches (`columns`) whose index `want`
    accepts; a value that is not text is named as `where` and its index."""
    for index, value in enumerate(chain.from_iterable(columns)):
        if want(index):
            yield index, _as_text(value, f"{where} {index}", field)


def _as_text(value, where: str, field: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is {type(value).__name__}, not text (data.text_field)")
    return value


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
