"""Documents tokenised in order by worker processes, for keel.data.shard_writer: the same ids whatever the number of
workers (docs/internals.md#keeldataencode_workers)."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

import numpy as np

from keel.data.tokenizer import ByteTokenizer, HFTokenizer, text_pieces

ENCODE_BATCH = 256  # documents (or pieces of one) per worker task
BATCH_CHARS = 1 << 21  # and about this many characters: a batch of long documents stays small


def document_digest(document: Iterable[str]) -> bytes:
    """The SHA-256 of a document's text, given as its consecutive pieces."""
    sha = hashlib.sha256()
    for piece in document:
        sha.update(piece.encode("utf-8"))
    return sha.digest()


def _pieces(docs: Iterable[Iterable[str]]) -> Iterator[tuple[str, bytes | None, bool]]:
    """(piece, the document's digest on its first piece, whether it is its last) for each piece of each document:
    a document longer than PIECE_CHARS goes out in pieces (keel.data.tokenizer.text_pieces), so none is held whole.
    Its digest is taken first, in a pass of its own: a shard that fills before its last piece records it."""
    for doc in docs:
        digest, pieces = document_digest(doc), text_pieces(doc)
        piece = next(pieces, "")
        for after in pieces:
            yield piece, digest, False
            piece, digest = after, None
        yield piece, digest, True


def _batches(units: Iterable[tuple]) -> Iterator[list[tuple]]:
    """At most ENCODE_BATCH pieces, and about BATCH_CHARS characters, a batch."""
    batch, chars = [], 0
    for unit in units:
        batch.append(unit)
        chars += len(unit[0])
        if len(batch) == ENCODE_BATCH or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


_WORKER: dict = {}


def _start_worker(tokenizer: str, dtype: str, quiet: bool = True) -> None:
    if quiet:  # Ctrl-C reaches the whole process group: the parent stops the pool, workers say nothing
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: N workers use N cores
    tok = ByteTokenizer() if tokenizer == "bytes" else HFTokenizer(tokenizer, follow_links=False)
    _WORKER.update(tokenizer=tok, dtype=np.dtype(dtype))


def _encode(pieces: list[tuple[str, bool, bool]]) -> list[np.ndarray]:
    """Each (piece, first piece of its document?, last piece?)'s ids in the shard dtype, a document's last followed
    by the tokenizer's document end (`doc_end`) when it has one."""
    tok, dtype = _WORKER["tokenizer"], _WORKER["dtype"]
    out = []
    for (_, _, last), ids in zip(pieces, tok.encode_pieces(pieces)):
        if last and tok.doc_end is not None:
            ids = np.append(ids, tok.doc_end)
        out.append(ids.astype(dtype))
    return out


@contextmanager
def encoder(tokenizer: str, dtype, workers: int):
    """`encode(documents)`: (piece, the document's digest on its first piece, its last piece?) and its ids for each
    piece of each document (`documents`: each an iterable of its text's consecutive pieces), in order; tokenised by
    `workers` processes loading `tokenizer` (a tokenizer.json, or "bytes") into ids of `dtype`."""
    def work(batch):
        return [(text, digest is not None, last) for text, digest, last in batch]  # a digest: a first piece

    if workers == 1:
        _start_worker(tokenizer, dtype.str, quiet=False)
        yield lambda docs: (pair for batch in _batches(_pieces(docs)) for pair in zip(batch, _encode(work(batch))))
        return
    # spawned, not forked: a forked copy of a process whose tokenizer threads ran can deadlock
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(tokenizer, dtype.str))

    def encode(docs):
        pending = deque()
        for batch in _batches(_pieces(docs)):
            pending.append((batch, pool.submit(_encode, work(batch))))
            if len(pending) >= 2 * workers:  # at most two batches a worker in flight: memory stays bounded
                batch, ids = pending.popleft()
                yield from zip(batch, ids.result())
        while pending:
            batch, ids = pending.popleft()
            yield from zip(batch, ids.result())

    try:
        yield encode
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
