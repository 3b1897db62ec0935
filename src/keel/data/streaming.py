"""Streaming (data.streaming=true): documents tokenised as training reads them, each rank reading its own part of
the stream, its position in every checkpoint (docs/data.md, "Streaming"; docs/internals.md#keeldatastreaming)."""

from __future__ import annotations

import copy
import hashlib
import os
import re
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np
import torch

from keel.data.corpus import (
    JSONL_SUFFIXES,
    DataConfig,
    _as_text,
    _first_line,
    _has_text,
    cache_root,
    load_saved,
    need_column,
)
from keel.data.hub import unreachable
from keel.data.shards import batch_of_windows, is_count, shard_dtype
from keel.data.tokenizer import is_bpe, load_tokenizer
from keel.errors import DataError, optional

VAL_TOKENS = 1 << 20  # ids of the held-out head: the eval windows of a small run, not of paper-512's
DOC_BATCH = 64  # documents tokenised together
HUB_TIMEOUT_S = 5.0  # to connect to the hub before the first read: `datasets` retries for ~25 s otherwise
LOCAL_SHARDS = 64  # a saved dataset's rows cut into this many shards, so that ranks can take whole ones


def open_stream(cfg: DataConfig, tokenizer=None) -> tuple[TokenStream, np.ndarray, object, dict]:
    """The training stream `cfg` names, its held-out validation ids, the tokenizer (`tokenizer`, a run's saved
    one, else data.tokenizer's), and what the stream is, as a run records it."""
    datasets = optional("datasets", "data", f"data.source {cfg.source!r}", DataError)
    if tokenizer is None:
        if is_bpe(cfg.tokenizer):
            raise DataError(f"data.tokenizer: {cfg.tokenizer} trains a BPE on the corpus, which a stream never "
                            "holds whole; with data.streaming=true name bytes or a tokenizer.json (keel tokenizer "
                            "--out tok.json trains one on a sample)")
        tokenizer = load_tokenizer(cfg.tokenizer, cache_root(cfg))
    dataset = _open(cfg, datasets)
    stream = TokenStream(dataset, tokenizer, cfg.text_field, cfg.source)
    val, held_out, docs = stream.hold_out(cfg.val_fraction)
    stream.held_out = held_out
    info = {"source": cfg.source, "kind": "stream", "hf_config": cfg.hf_config, "hf_split": cfg.hf_split,
            "text_field": cfg.text_field, "val_documents": docs, "val_tokens": len(val),
            "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
            "fingerprint": hashlib.sha256(val.tobytes() + tokenizer.name.encode()).hexdigest()}
    return stream, val, tokenizer, info


# ---- opening ----------------------------------------------------------------------------------------------

def _open(cfg: DataConfig, datasets):
    """The `datasets.IterableDataset` that data.source names, its text column checked when its columns are known."""
    if cfg.source.startswith("hf:"):
        name = cfg.source.removeprefix("hf:")
        local = Path(name).expanduser()
        if local.is_dir() and any((local / f).is_file() for f in ("state.json", "dataset_dict.json")):  # save_to_disk
            ds = load_saved(cfg, local, datasets)
            ds = ds.to_iterable_dataset(num_shards=max(1, min(LOCAL_SHARDS, len(ds))))
        else:
            if not local.exists() and name.startswith(("/", ".", "~")):
                raise DataError(f"{local}: no such directory (data.source {cfg.source!r}: a path, not a hub name)")
            if not local.exists():
                check_hub(name)
            ds = _load(cfg, datasets, str(local) if local.exists() else name, cfg.hf_config or None, cfg.hf_split)
    else:
        path = Path(cfg.source).expanduser()
        builder = "parquet" if path.suffix.lower() == ".parquet" else "json" if path.suffix.lower() in JSONL_SUFFIXES \
            else None
        if builder is None or not path.is_file():
            what = "a directory" if path.is_dir() else "no such file" if not path.exists() else "a text file" \
                if builder is None else "not a regular file"
            raise DataError(f"data.streaming: streams an hf: dataset, a JSONL or a Parquet file; data.source "
                            f"{cfg.source!r} is {what} (leave data.streaming out: a local corpus is read in bounded "
                            "memory already, or keel data prepare makes shards of it)")
        ds = _load(cfg, datasets, builder, None, "train", data_files=[str(path)])
    if ds.column_names is None:  # not known before reading
        return ds
    need_column(cfg.source, cfg.text_field, ds.column_names)
    return ds.select_columns([cfg.text_field])


def _load(cfg: DataConfig, datasets, path: str, config, split: str, **kwargs):
    """`datasets.load_dataset(..., streaming=True)`, its errors as one line naming the field."""
    try:
        return datasets.load_dataset(path, config, split=split, streaming=True, **kwargs)
    except Exception as err:  # from the file system, the network, the dataset's card
        why, full = _first_line(err), str(err)
    if m := re.search(r"BuilderConfig '(.*)' not found\. Available: \[(.*)\]", why):
        raise DataError(f"data.hf_config: {m[1]!r} is not a config (subset) of {cfg.source}; configs: "
                        f"{m[2].replace(chr(39), '')}")
    if why.startswith("Config name is missing"):
        raise DataError(f"data.hf_config: {cfg.source} has several configs (subsets); name one ({_listed(full)})")
    if m := re.search(r"Bad split: (.*)\. Available splits: \[(.*)\]", why):
        raise DataError(f"data.hf_split: {m[1]!r} is not a split of {cfg.source}; splits: {m[2].replace(chr(39), '')}")
    raise DataError(f"{cfg.source}: cannot stream the dataset ({why})")


def _listed(message: str) -> str:
    m = re.search(r"\[(.*?)\]", message)
    return f"configs: {m[1].replace(chr(39), '')}" if m else "see the dataset's card"


def check_hub(name: str) -> None:
    """DataError at once, in one line, when the Hugging Face hub cannot be reached: offline mode is set, or it does
    not answer within HUB_TIMEOUT_S. A stream reads the hub as training goes, so no cache can stand in."""
    offline = [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
               if os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")]
    if offline:
        raise DataError(f"data.source: hf:{name} streams from the Hugging Face hub, but {offline[0]} is set "
                        "(offline); unset it, or make shards where the hub can be reached (keel data prepare)")
    if (why := unreachable(HUB_TIMEOUT_S)) is not None:
        raise DataError(f"data.source: hf:{name} streams from the Hugging Face hub, but it cannot be reached ({why}); "
                        "connect, or make shards where it can (keel data prepare)")


# ---- the stream -------------------------------------------------------------------------------------------

class TokenStream:
    """The training documents of a stream, unsplit; `WindowSampler(stream, ...)` reads a rank's part of it as a
    StreamSampler. It has no length: the train split of a stream is not a set of windows to evaluate."""

    def __init__(self, dataset, tokenizer, text_field: str, source: str):
        self.dataset, self.tokenizer, self.text_field, self.filename = dataset, tokenizer, text_field, source
        self.dtype = shard_dtype(tokenizer.vocab_size)
        self.held_out: frozenset[bytes] = frozenset()

    def __len__(self) -> int:
        raise DataError(f"{self.filename}: the train split is a stream (data.streaming=true), read once in order; "
                        "evaluate the val split")

    def __bool__(self) -> bool:
        return True

    def texts(self, documents, train: bool = True) -> Iterator[str]:
        """The text of each record of `documents` (an iterator over the dataset) with text in it; with `train`,
        those not held out."""
        for i, record in enumerate(documents):
            if self.text_field not in record:
                raise DataError(f"{self.filename} record {i}: no field {self.text_field!r} (data.text_field)")
            text = _as_text(record[self.text_field], f"{self.filename} record {i}", self.text_field)
            if _has_text(text) and not (train and _digest(text) in self.held_out):
                yield text

    def encode(self, texts: list[str]) -> np.ndarray:
        """The ids of `texts`, each followed by the tokenizer's document end (`doc_end`) if any, as one array."""
        eos = self.tokenizer.doc_end
        parts = [ids if eos is None else np.append(ids, eos) for ids in self.tokenizer.encode_batch(texts)]
        return np.concatenate(parts).astype(self.dtype) if parts else np.empty(0, self.dtype)

    def hold_out(self, fraction: float) -> tuple[np.ndarray, frozenset[bytes], int]:
        """Validation: every k-th document of the head until VAL_TOKENS ids; its ids, digests and count."""
        if fraction <= 0:
            return np.empty(0, self.dtype), frozenset(), 0
        k, ids, digests, n = max(1, round(1 / fraction)), [], set(), 0
        for i, text in enumerate(self.texts(iter(self.dataset), train=False)):
            if i % k or _digest(text) in digests:
                continue
            digests.add(_digest(text))
            ids.append(self.encode([text]))
            n += len(ids[-1])
            if n >= VAL_TOKENS:
                break
        return (np.concatenate(ids) if ids else np.empty(0, self.dtype)), frozenset(digests), len(digests)

    def sampler(self, seq_len: int, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                split: str = "train", vocab_size: int | None = None, source=None) -> StreamSampler:
        return StreamSampler(self, seq_len, batch_size, seed, rank, world_size, vocab_size, source)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


class StreamSampler:
    """Consecutive rows of one rank's part of a stream, as WindowSampler's `next_batch()`, `state_dict()` and
    `load_state_dict()`.

    A checkpoint holds every rank's position: under torch.distributed, `state_dict()` gathers them (a collective:
    every rank calls it at the same steps, as the trainer does) and `load_state_dict` takes its own."""

    def __init__(self, stream: TokenStream, seq_len: int, batch_size: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1, vocab_size: int | None = None, source=None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.stream, self.seq_len, self.batch_size = stream, seq_len, batch_size
        self.rank, self.world_size, self.vocab_size = rank, world_size, vocab_size
        self.source = source or stream.filename
        self.step, self.version, self.gathered = 0, 0, None
        self.generator = torch.Generator().manual_seed(seed)
        self._open(0)

    def _open(self, epoch: int, state: dict | None = None, used: int = 0) -> None:
        """Start this rank's part at `state` (None: its beginning) in `epoch`, `used` ids of its next batch used."""
        from datasets.distributed import split_dataset_by_node

        self.ds = split_dataset_by_node(self.stream.dataset, self.rank, self.world_size)
        if state is not None:
            self.ds.load_state_dict(state)
        self.texts, self.epoch, self.any = self.stream.texts(iter(self.ds)), epoch, False
        self.ids, self.last = np.empty(0, self.stream.dtype), None
        if state is not None or used:
            self._read(state)
            self.ids = self.ids[used:]

    def _read(self, state: dict | None = None) -> None:
        """Tokenise the next DOC_BATCH documents of this rank's part onto the ids not yet used; at the end of its
        part, its part again from the start."""
        state = self.ds.state_dict() if state is None else state
        texts = list(islice(self.texts, DOC_BATCH))
        if not texts:
            if not self.any:
                raise DataError(f"{self.source}: rank {self.rank} of {self.world_size}'s part of the stream holds no "
                                "training documents (data.source is too small, or all of it is held out)")
            ids = self.ids
            self._open(self.epoch + 1)
            self.ids = ids
            return self._read()
        self.any = True
        new = self.stream.encode(texts)
        self.ids = np.concatenate([self.ids, new])
        self.last = {"epoch": self.epoch, "state": state, "ids": len(new)}

    def next_batch(self):
        need = self.batch_size * self.seq_len + 1
        while len(self.ids) < need:
            self._read()
        rows, self.ids = self.ids[:need], self.ids[need - 1:]  # the last id begins the next batch
        self.step, self.version = self.step + 1, self.version + 1
        return batch_of_windows(rows, np.arange(self.batch_size) * self.seq_len, self.seq_len, self.vocab_size,
                                self.source)

    def state_dict(self) -> dict:
        # the ids left are the end of the last batch read (a batch is read only when fewer than a row's are left)
        mine = {"epoch": self.epoch, "state": None, "used": 0} if self.last is None else \
            {"epoch": self.last["epoch"], "state": self.last["state"], "used": self.last["ids"] - len(self.ids)}
        # `generator` and `step` as in every sampler's state (what a resume checks a checkpoint for): a stream
        # draws nothing at random, so its generator is the seed's, never advanced
        return {"generator": self.generator.get_state(), "step": self.step, "ranks": self._gather(mine)}

    def _gather(self, mine: dict) -> list[dict]:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [mine]
        if self.gathered is None or self.gathered[0] != self.version:  # every rank draws the same batches
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
            self.gathered = (self.version, ranks)
        return copy.deepcopy(self.gathered[1])

    def load_state_dict(self, state: dict) -> None:
        import torch.distributed as dist

        ranks = state.get("ranks")
        if not (isinstance(ranks, list) and all(isinstance(r, dict) and is_count(r.get("epoch"))
                                                and is_count(r.get("used")) and isinstance(r.get("state"), dict | None)
                                                for r in ranks)):
            raise DataError(f"{self.source}: the checkpoint holds no stream position (was it written with "
                            "data.streaming=true?), or a damaged one")
        me, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if len(ranks) != world:
            raise DataError(f"resume: the stream's position was saved by {len(ranks)} process(es), not {world}; with "
                            "data.streaming=true resume with as many (each reads its own part of the stream)")
        mine = ranks[me]
        try:
            self._open(mine["epoch"], mine["state"], mine["used"])
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:  # a state `datasets` rejects
            raise DataError(f"{self.source}: the stream position in the checkpoint does not fit this stream "
                            f"({type(err).__name__}: {_first_line(err)}); was the dataset or data.* changed?") from None
        self.step, self.version = int(state["step"]), self.version + 1
        self.gathered = (self.version, copy.deepcopy(ranks))
