"""Token ids ready for training (`prepare`: the token cache, a shard directory, or a `.bin` of ids), and the samplers
that read batches from them (docs/internals.md#keeldataloader)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from keel.data import shards
from keel.data.corpus import SPLITS, Corpus, DataConfig, build_corpus, cache_root
from keel.data.shard_writer import directory_bpe, write_shards
from keel.data.tokenizer import EOS_ONCE, PIECE_RULE, is_bpe, load_tokenizer
from keel.errors import DataError

CACHE = "shards"  # cache_dir/shards/<key>: the token cache, a shard directory
OLD_CACHE = "tokens"  # cache_dir/tokens/<key>: train.bin, val.bin and meta.json, as keel cached a corpus before


# ---- token ids ------------------------------------------------------------------------------------------

@dataclass
class Prepared:
    """Both splits as memory-mapped token ids (keel.data.shards.TokenShards; with data.streaming the train split is
    a keel.data.streaming.TokenStream and val an array in memory), the tokenizer that made them, and what the
    corpus was."""

    train: shards.TokenShards
    val: shards.TokenShards
    tokenizer: object
    corpus_info: dict
    cache_path: Path


def prepare(cfg: DataConfig, tokenizer=None) -> Prepared:
    """Tokenise the corpus `cfg` names into the token cache (on the first call only) and read it; `tokenizer` (a run's
    saved one) in place of the one data.tokenizer names (docs/internals.md#keeldataloaderprepare)."""
    if cfg.streaming:  # nothing cached: documents are tokenised as training reads them
        from keel.data.streaming import open_stream

        stream, val, tokenizer, info = open_stream(cfg, tokenizer)
        return Prepared(stream, val, tokenizer, info, cache_root(cfg))
    if (ready := _prepared_elsewhere(cfg, tokenizer)) is not None:
        return ready
    root = cache_root(cfg)
    corpus = build_corpus(cfg)
    tokenizer = tokenizer or load_tokenizer(cfg.tokenizer, root, corpus)
    plain = hashlib.sha256((corpus.fingerprint + tokenizer.name).encode()).hexdigest()[:16]  # also an older keel's
    ruled = lambda rule: hashlib.sha256(f"{corpus.fingerprint}{tokenizer.name}\0{rule}".encode()).hexdigest()[:16]
    key = plain if tokenizer.piece_rule is None else ruled(tokenizer.piece_rule)
    path = root / CACHE / key
    if _whole(path) is None:
        _note_older(root, plain, path, ruled(PIECE_RULE) if tokenizer.piece_rule == EOS_ONCE else None)
        _build(corpus, tokenizer, path)
    return _open_shards(path, tokenizer, root, f"the token cache is damaged: delete {path} to rebuild it")


def _prepared_elsewhere(cfg: DataConfig, tokenizer=None) -> Prepared | None:
    """The token ids data.source names when they were made before keel trains: a shard directory (its files
    checked against the manifest, its tokenizer against the one named) or a `.bin` of uint16 ids (the tokenizer
    must then be named, bytes or a tokenizer.json). None for a corpus of text."""
    if cfg.source == "stdlib" or cfg.source.startswith("hf:"):
        return None
    path = Path(cfg.source).expanduser()
    if os.path.lexists(path / shards.MANIFEST):
        tokenizer = tokenizer or (directory_bpe(cfg.tokenizer, path, shards.read_manifest(path))
                                  if is_bpe(cfg.tokenizer) else load_tokenizer(cfg.tokenizer, path))
        ready = _open_shards(path, tokenizer, cache_root(cfg))
        ready.corpus_info["shards"] = str(path)
        return ready
    if path.suffix == ".bin" and path.is_file():
        if tokenizer is None and is_bpe(cfg.tokenizer):
            raise DataError(f"data.tokenizer: {path} holds token ids: name the tokenizer that made them (bytes or "
                            "a tokenizer.json), not a BPE to train")
        tokenizer = tokenizer or load_tokenizer(cfg.tokenizer, cache_root(cfg))
        train, val = shards.open_bin(path, tokenizer.vocab_size, cfg.val_fraction)
        st = path.stat()
        fingerprint = hashlib.sha256(json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns,
                                                 cfg.val_fraction]).encode()).hexdigest()
        info = {"source": cfg.source, "kind": "token-ids", "bytes": st.st_size, "fingerprint": fingerprint,
                "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "train_tokens": len(train),
                "val_tokens": len(val)}
        return Prepared(train, val, tokenizer, info, path.parent)
    return None


def _open_shards(path: Path, tokenizer, root: Path, remedy: str = shards.REMEDY) -> Prepared:
    """The shard directory `path`, checked against its manifest (files re-hashed only when changed since the check
    stamped under `root`) and against `tokenizer`."""
    manifest = shards.read_manifest(path, remedy)
    shards.check_tokenizer(manifest, tokenizer, path)
    key = hashlib.sha256(f"{path.resolve()}\0{json.dumps(manifest, sort_keys=True)}".encode()).hexdigest()[:16]
    shards.check_files(path, manifest, stamp=root / "shards-checked" / f"{key}.json", remedy=remedy)
    splits = manifest["splits"]
    counts = {f"{s}_{n}": splits[s][n] for s in SPLITS for n in ("tokens", "documents")}
    info = manifest["corpus"] | {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size} | counts
    return Prepared(shards.open_split(path, manifest, "train"), shards.open_split(path, manifest, "val"),
                    tokenizer, info, path)


def _whole(path: Path) -> dict | None:
    """The manifest of the finished cache at `path`; None when there is none, or a file is missing or cut short
    (a cache interrupted or damaged: built again)."""
    try:
        manifest = shards.read_manifest(path)
        shards.check_sizes(path, manifest)
    except DataError:
        return None
    return manifest if all(manifest["splits"][s]["complete"] for s in SPLITS) else None


def _note_older(root: Path, plain: str, final: Path, doubled: str | None = None) -> None:
    """One line naming the token cache an older keel made of this corpus and tokenizer, which is never read (and
    left as it is: that keel may still read it): one in its layout (train.bin, val.bin), or, where the tokenizer's
    post-processor adds ids (`piece_rule`), one whose long documents got them on every piece, or (`doubled`, its
    key) one whose documents ended with the end-of-text id twice."""
    if os.path.lexists(root / OLD_CACHE / plain / "meta.json"):
        old, how = root / OLD_CACHE / plain, "in the layout of an older keel (train.bin, val.bin)"
    elif doubled and _whole(root / CACHE / doubled) is not None:
        old, how = root / CACHE / doubled, "an older keel made, which put the end-of-text id twice after each document"
    elif final.name != plain and _whole(root / CACHE / plain) is not None:
        old, how = root / CACHE / plain, "an older keel made, whose long documents got the BOS/EOS on every piece"
    else:
        return
    print(f"keel: note: {old} is a token cache {how}; tokenising the corpus again into {final} (delete the old one "
          "once no older keel reads it)", file=sys.stderr)


def _build(corpus: Corpus, tokenizer, final: Path) -> None:
    """The token cache of `corpus` at `final`, built whole under a temporary name and renamed into place."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", suffix=".tmp", dir=final.parent))
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    except OSError as err:
        raise DataError(f"{final.parent}: cannot create the token cache (data.cache_dir): {err.strerror}") from None
    try:
        write_shards(corpus, tokenizer, tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # the name is taken: another process finished first, or a damaged cache is there
            if _whole(final) is not None:
                return
            shutil.rmtree(final)
            os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename


# ---- batches ---------------------------------------------------------------------------------------

class WindowSampler:
    """Random windows of `seq_len + 1` tokens: `next_batch()` returns (x, y), int64 (batch_size, seq_len); the global
    batch is the same whatever the world size, and `load_state_dict` resumes it exactly. Given a stream it is a
    keel.data.streaming.StreamSampler (docs/internals.md#keeldataloaderwindowsampler)."""

    def __new__(cls, tokens, *args, **kwargs):
        from keel.data.streaming import TokenStream

        if isinstance(tokens, TokenStream):
            return tokens.sampler(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1, split: str = "train", vocab_size: int | None = None, source=None):
        if len(tokens) < seq_len + 1:
            raise DataError(f"{split} split: {len(tokens)} tokens, fewer than run.seq_len + 1 = {seq_len + 1}; "
                            "use more text or a shorter run.seq_len")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.vocab_size, self.source = vocab_size, source or f"the {split} split"
        self.rank, self.world_size = rank, world_size
        self.generator = torch.Generator().manual_seed(seed)
        self.step = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        n_starts = len(self.tokens) - self.seq_len  # a window starting at s ends at s + seq_len + 1 <= len
        starts = torch.randint(n_starts, (self.batch_size * self.world_size,), generator=self.generator)
        mine = starts[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        self.step += 1
        return shards.batch_of_windows(self.tokens, mine.numpy(), self.seq_len, self.vocab_size, self.source)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.step = int(state["step"])


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int, max_batches: int, vocab_size: int | None = None,
                 source=None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """At most `max_batches` batches of evenly spaced, non-overlapping windows over `tokens`: all of them
    from the start when there are few enough, else spread from the first token to the last. The same
    windows every call, so validation losses are comparable; the last batch may be smaller. `vocab_size` and
    `source` as for WindowSampler."""
    n_windows = (len(tokens) - 1) // seq_len
    count = min(n_windows, batch_size * max_batches)
    if count <= 0:
        return
    if count == n_windows:
        starts = np.arange(count) * seq_len
    else:  # spacing (len - seq_len - 1) / (count - 1) > seq_len, because n_windows > count
        starts = np.linspace(0, len(tokens) - seq_len - 1, count).astype(np.int64)
    for i in range(0, count, batch_size):
        yield shards.batch_of_windows(tokens, starts[i:i + batch_size], seq_len, vocab_size, source or "a batch")
