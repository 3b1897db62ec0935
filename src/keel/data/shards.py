"""Token shards on disk, as `keel data prepare` writes them (keel.data.shard_writer) and training reads them; the
layout and manifest: docs/internals.md#keeldatashards. Needs no torch: `keel data prepare`'s workers import it."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from keel import safe_io
from keel.data.corpus import SPLITS
from keel.errors import DataError

FORMAT = "keel-shards-1"
MANIFEST = "manifest.json"
REMEDY = "prepare the corpus again into a new --out"  # what a message about a damaged directory advises
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
INDEX_DTYPE = np.dtype("<u4")  # document starts within a shard: shard_tokens < 2**32
MAX_SHARD_TOKENS = 2**32 - 1
SHARD_NAME = re.compile(r"(train|val)-\d{6}\.(bin|idx)")
NANOGPT_MAGIC, NANOGPT_HEADER = 20240520, 256  # modded-nanogpt: 256 int32 (magic, version, token count, ...)


def shard_dtype(vocab_size: int) -> np.dtype:
    return DTYPES["uint16"] if vocab_size <= 2**16 else DTYPES["uint32"]


def shard_name(split: str, k: int, suffix: str) -> str:
    return f"{split}-{k:06d}.{suffix}"


def sha256_file(path: Path) -> str:
    """The SHA-256 of a regular file, never read through a symlink (hashlib reads it in chunks, off the GIL)."""
    try:
        with safe_io.open_regular(path) as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror})") from None


# ---- the manifest --------------------------------------------------------------------------------------

def read_manifest(directory: Path, remedy: str = REMEDY) -> dict:
    """`directory`'s manifest, its structure checked; DataError (one line naming the field, then `remedy`)
    otherwise."""
    path = directory / MANIFEST
    try:
        raw = safe_io.read_bytes(directory, path, safe_io.CAP_TOKENIZER)
        manifest = safe_io.loads_json(raw) if raw is not None else None
    except ValueError as err:
        raise DataError(f"{path}: not valid JSON ({err})") from None
    if manifest is None:
        raise DataError(f"{directory}: no {MANIFEST}; not a directory `keel data prepare` wrote")
    _check_manifest(manifest, directory, remedy)
    return manifest


def _check_manifest(m, directory: Path, remedy: str) -> None:
    where = directory / MANIFEST

    def need(ok: bool, what: str):
        if not ok:
            raise DataError(f"{where}: {what}; the manifest is damaged ({remedy})")

    need(isinstance(m, dict) and m.get("format") == FORMAT, f"format is not {FORMAT!r}")
    need(m.get("dtype") in DTYPES, f"dtype is not one of {', '.join(DTYPES)}")
    tok = m.get("tokenizer")
    need(isinstance(tok, dict) and isinstance(tok.get("name"), str) and is_count(tok.get("vocab_size")),
         "tokenizer is not {name, vocab_size}")
    need(is_count(m.get("shard_tokens")) and 0 < m["shard_tokens"] <= MAX_SHARD_TOKENS, "shard_tokens is not a size")
    need(isinstance(m.get("splits"), dict) and set(m["splits"]) == set(SPLITS), "splits is not {train, val}")
    if tok["vocab_size"] > np.iinfo(DTYPES[m["dtype"]]).max + 1:
        raise DataError(f"{where}: the tokenizer's vocabulary of {tok['vocab_size']:,} does not fit its "
                        f"{m['dtype']} shards (ids up to {np.iinfo(DTYPES[m['dtype']]).max:,}); refused")
    for split, state in m["splits"].items():
        need(isinstance(state, dict) and isinstance(state.get("shards"), list)
             and isinstance(state.get("complete"), bool), f"splits.{split} is not {{complete, shards}}")
        for i, shard in enumerate(state["shards"]):
            need(isinstance(shard, dict), f"splits.{split}.shards[{i}] is not an object")
            for key in ("file", "index"):
                name = shard.get(key)
                if not (isinstance(name, str) and SHARD_NAME.fullmatch(name) and name.startswith(split)):
                    raise DataError(f"{where}: splits.{split}.shards[{i}].{key} = {json.dumps(name)[:80]} is not a "
                                    f"shard file of this directory ({split}-NNNNNN.bin/.idx); refused")
            end = shard.get("end")
            need(is_count(shard.get("tokens")) and 0 < shard["tokens"] <= m["shard_tokens"]
                 and is_count(shard.get("documents")) and _hex(shard.get("sha256")) and _hex(shard.get("index_sha256"))
                 and isinstance(end, dict) and is_count(end.get("document")) and is_count(end.get("offset"))
                 and _hex(end.get("digest")), f"splits.{split}.shards[{i}] lacks a field or has a wrong type")


def is_count(v) -> bool:
    """Whether `v` is an int >= 0 (a bool is not): a size or an index read from JSON."""
    return type(v) is int and v >= 0


def _hex(v) -> bool:
    return isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None


def check_tokenizer(manifest: dict, tokenizer, directory: Path, field: str = "data.tokenizer") -> None:
    """DataError unless `tokenizer` is the one the shards were made with (its name is a hash of its file)."""
    made = manifest["tokenizer"]
    if tokenizer.name != made["name"]:
        raise DataError(f"{field}: tokenizer {tokenizer.name!r} ({tokenizer.vocab_size:,} tokens) differs from "
                        f"{made['name']!r} ({made['vocab_size']:,} tokens) that made the shards in {directory}; name "
                        "that one (the BPE keel trained is in the directory: data.tokenizer=bpe)")


# ---- checking files against it -------------------------------------------------------------------------

def check_files(directory: Path, manifest: dict, stamp: Path | None = None, remedy: str = REMEDY) -> None:
    """Every shard present, inside `directory`, of its size, with its SHA-256. With `stamp` (a file keel writes),
    files whose size, modification time and inode match the stamp of the last check that passed are not hashed
    again: at 250B tokens hashing is minutes at every start."""
    files = _files(directory, manifest)
    stats = {str(path): _stat(directory, path, size, remedy) for path, size, _ in files}
    if stamp is not None and _read_stamp(stamp) == stats:
        return
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for (path, _, want), got in zip(files, pool.map(lambda f: sha256_file(f[0]), files)):
            if got != want:
                raise DataError(f"{path}: its SHA-256 is not the one {MANIFEST} records; the shard is damaged "
                                f"({remedy})")
    if stamp is not None:
        try:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            safe_io.write_text(stamp.parent, stamp, json.dumps(stats))
        except (OSError, DataError):  # a read-only cache: the next start hashes again
            pass


def check_sizes(directory: Path, manifest: dict) -> None:
    """Every shard present, inside `directory` and of its size (no file read): DataError otherwise."""
    for path, size, _ in _files(directory, manifest):
        _stat(directory, path, size, REMEDY)


def _files(directory: Path, manifest: dict) -> list[tuple[Path, int | None, str]]:
    """(path, bytes or None, SHA-256) of every file the manifest lists."""
    dtype, files = DTYPES[manifest["dtype"]], []
    for split in SPLITS:
        for s in manifest["splits"][split]["shards"]:
            files += [(directory / s["file"], s["tokens"] * dtype.itemsize, s["sha256"]),
                      (directory / s["index"], None, s["index_sha256"])]
    return files


def _stat(directory: Path, path: Path, size: int | None, remedy: str) -> list[int]:
    if not path.resolve().is_relative_to(directory.resolve()):
        raise DataError(f"{path}: resolves outside {directory}; refused")
    try:
        st = path.stat()
    except OSError as err:
        raise DataError(f"{path}: listed in {directory / MANIFEST} but cannot be read ({err.strerror})") from None
    if size is not None and st.st_size != size:
        raise DataError(f"{path}: {st.st_size:,} bytes where {MANIFEST} says {size:,}; the shard is damaged or "
                        f"truncated ({remedy})")
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _read_stamp(stamp: Path) -> dict | None:
    try:
        return safe_io.loads_json(stamp.read_bytes())
    except (OSError, ValueError):
        return None


# ---- reading -------------------------------------------------------------------------------------------

class TokenShards:
    """Shard files read as one sequence of token ids: `len()`, `windows(starts, length)`, slices and `np.asarray`; each
    call maps and unmaps the shards it reads (why: docs/internals.md#keeldatashardstokenshards)."""

    def __init__(self, paths: Sequence[Path], counts: Sequence[int], dtype, filename: str, offset: int = 0):
        self.paths, self.dtype, self.filename, self.offset = list(paths), np.dtype(dtype), filename, offset
        self.bounds = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))])
        self.start, self.stop = 0, int(self.bounds[-1])  # the ids of the files this sequence is

    def _map(self, k: int) -> np.ndarray:
        # `offset`: bytes before the ids (modded-nanogpt's header); mode "r": the file is never written
        return np.memmap(self.paths[k], dtype=self.dtype, mode="r", offset=self.offset,
                         shape=(int(self.bounds[k + 1] - self.bounds[k]),))

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key: slice) -> TokenShards:
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("token shards are sliced with step 1 only")
        part = copy.copy(self)
        part.start, part.stop = self.start + start, self.start + max(start, stop)
        return part

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        ids = self.windows([0], len(self))[0]
        return ids if dtype is None else ids.astype(dtype)

    def sampled_max(self, sample: int = 1 << 20) -> int:
        """The largest id among about `sample` spread over each shard (all of a small one)."""
        sizes = np.diff(self.bounds).tolist()
        return max((int(self._map(k)[::max(1, n // sample)].max()) for k, n in enumerate(sizes) if n), default=0)

    def windows(self, starts, length: int) -> np.ndarray:
        """Rows of `length` ids beginning at each of `starts` (positions in this sequence), (B, length)."""
        out, maps = np.empty((len(starts), length), dtype=self.dtype), {}
        for row, start in enumerate(np.asarray(starts, dtype=np.int64).tolist()):
            if not 0 <= start <= len(self) - length:
                raise IndexError(f"window [{start}, {start + length}) outside the {len(self)} tokens of "
                                 f"{self.filename}")
            done = 0
            while done < length:  # a window may run on into the next shard
                pos = self.start + start + done
                k = int(np.searchsorted(self.bounds, pos, side="right")) - 1
                take = min(length - done, int(self.bounds[k + 1]) - pos)
                if k not in maps:
                    maps[k] = self._map(k)
                out[row, done:done + take] = maps[k][pos - int(self.bounds[k]):][:take]
                done += take
        return out


COUNT_CHUNK = 1 << 22  # ids counted at a time: 32 MiB once np.bincount widens them to int64


def token_counts(tokens, minlength: int = 0) -> np.ndarray:
    """`np.bincount(np.asarray(tokens), minlength=minlength)` (int64), read COUNT_CHUNK ids at a time: a split of
    billions of ids in shards is never in memory whole."""
    counts = np.zeros(minlength, dtype=np.int64)
    for start in range(0, len(tokens), COUNT_CHUNK):
        part = np.bincount(np.asarray(tokens[start:start + COUNT_CHUNK]), minlength=len(counts))
        counts = np.pad(counts, (0, len(part) - len(counts))) + part
    return counts


def open_split(directory: Path, manifest: dict, split: str) -> TokenShards:
    shards = manifest["splits"][split]["shards"]
    return TokenShards([directory / s["file"] for s in shards], [s["tokens"] for s in shards],
                       DTYPES[manifest["dtype"]], f"{directory}/{split}-*.bin")


def open_bin(path: Path, vocab_size: int, val_fraction: float) -> tuple[TokenShards, TokenShards]:
    """A nanoGPT-style file of uint16 ids: its train and val splits. The val split is the file whose name has
    "val" for "train" beside it (nanoGPT's train.bin / val.bin, modded-nanogpt's fineweb_train_* / fineweb_val_*),
    else the file's last `val_fraction` of ids."""
    if vocab_size > 2**16:
        raise DataError(f"data.tokenizer: a vocabulary of {vocab_size:,} does not fit {path}'s uint16 ids; "
                        "refused")
    train = _bin(path, vocab_size)
    sibling = path.with_name(path.name.replace("train", "val"))
    if "train" in path.name and sibling.is_file():
        return train, _bin(sibling, vocab_size)
    cut = len(train) - int(len(train) * val_fraction)
    return train[:cut], train[cut:]


def _bin(path: Path, vocab_size: int) -> TokenShards:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = np.frombuffer(f.read(3 * 4), dtype="<i4")
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror})") from None
    offset = 0
    if len(head) == 3 and head[0] == NANOGPT_MAGIC:  # modded-nanogpt: magic, version, token count
        offset = NANOGPT_HEADER * 4
        if size < offset + 2 * int(head[2]):
            raise DataError(f"{path}: its header names {int(head[2]):,} tokens, more than the file holds")
        size = offset + 2 * int(head[2])
    elif size % 2:
        raise DataError(f"{path}: {size:,} bytes, not a whole number of uint16 token ids")
    ids = TokenShards([path], [(size - offset) // 2], "<u2", str(path), offset)
    if (top := ids.sampled_max()) >= vocab_size:
        raise DataError(f"{path}: holds id {top:,}, outside the {vocab_size:,} of the tokenizer named; not token ids "
                        "of data.tokenizer")
    return ids


def batch_of_windows(tokens, starts: np.ndarray, seq_len: int, vocab_size: int | None = None, source=None) -> tuple:
    """The (inputs, targets) batch of the windows of `seq_len + 1` ids at `starts`, each id checked against the
    model's vocabulary."""
    import torch  # noqa: PLC0415 (reading shards and their manifest needs no torch; batches do)

    if isinstance(tokens, TokenShards):  # only these rows are read, from whichever shards hold them
        rows = tokens.windows(starts, seq_len + 1)
    else:
        rows = tokens[starts[:, None] + np.arange(seq_len + 1)]
    rows = torch.from_numpy(rows.astype(np.int64))  # (B, T + 1)
    # one reduction over a batch already in memory: an id past the embedding (shards altered after their check, or
    # planted with a manifest to match) would otherwise be an IndexError, or on a GPU a device-side assert
    if vocab_size is not None and len(rows) and not 0 <= int(rows.min()) <= int(rows.max()) < vocab_size:
        bad = int(rows.max()) if int(rows.max()) >= vocab_size else int(rows.min())
        raise DataError(f"{source}: token id {bad} is outside the model's vocabulary of {vocab_size} "
                        "(model.vocab_size); the token cache is damaged: delete it to rebuild it")
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
