"""Tokenizers: raw UTF-8 bytes, or a byte-level BPE from Hugging Face `tokenizers`, trained and cached per corpus
(their common interface: docs/internals.md#keeldatatokenizer)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from functools import cached_property
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from keel import safe_io
from keel.errors import DataError

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>")
DEFAULT_BPE_VOCAB = 4096
PIECE_RULE = "post-processor-once-per-document"  # what encode_pieces does with a post-processor's BOS/EOS
EOS_ONCE = PIECE_RULE + ", its eos-id ending the document"  # ... when that EOS is eos_id: keel adds no second one
SPEC_HELP = "'bytes', 'bpe', 'bpe:<vocab_size>' or a path to a tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes as tokens: 256 ids, no training, nothing unknown."""

    vocab_size = 256
    eos_id = doc_end = None
    name = "bytes"
    piece_rule = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_to_array(self, text: str) -> np.ndarray:
        """The bytes of `text` as a uint8 array, without a Python int per byte."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode_to_array(t) for t in texts]

    def encode_pieces(self, pieces: list[tuple[str, bool, bool]]) -> list[np.ndarray]:
        return self.encode_batch([text for text, _, _ in pieces])

    def save(self, directory) -> None:
        """Record in `directory` that this run used raw bytes, so a run directory is self-contained."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {"tokenizer_class": "ByteTokenizer", "keel_tokenizer": "bytes", "vocab_size": self.vocab_size}
        safe_io.write_text(directory, directory / "tokenizer_config.json", json.dumps(config, indent=1) + "\n")


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` read from a tokenizer.json file."""

    def __init__(self, path, follow_links: bool = True):
        self.path = Path(path)
        try:
            raw = read_capped(self.path, follow_links)
        except FileNotFoundError:
            raise DataError(f"{self.path}: no such tokenizer file; data.tokenizer must be {SPEC_HELP}") from None
        except OSError as err:
            raise DataError(f"{self.path}: cannot read tokenizer file ({err.strerror})") from None
        try:
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as err:  # tokenizers raises a bare Exception for malformed JSON
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DataError(f"{self.path}: not a valid tokenizer.json ({first})") from None
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = next((i for i in map(self._tok.token_to_id, EOS_CANDIDATES) if i is not None), None)
        self.name = "hf-" + hashlib.sha256(raw).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch_fast runs in parallel in Rust and skips the character offsets we never use
        return [np.asarray(e.ids, dtype=np.int64) for e in self._tok.encode_batch_fast(texts)]

    def encode_pieces(self, pieces: list[tuple[str, bool, bool]]) -> list[np.ndarray]:
        """The ids of consecutive pieces of documents, each given as (text, its document's first piece?, its last
        piece?): what the post-processor adds before a text (a BOS) goes on a document's first piece only, and what
        it adds after (an EOS) on its last only, so a document cut where the pre-tokenizer splits anyway
        (`text_pieces`) gets the ids of the whole."""
        texts = [text for text, _, _ in pieces]
        if all(first and last for _, first, last in pieces) or self.piece_rule is None:
            return self.encode_batch(texts)
        before, after = self._around
        bare = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(self._tok.post_process(e).ids if first and last else
                           (before if first else []) + e.ids + (after if last else []), dtype=np.int64)
                for (_, first, last), e in zip(pieces, bare)]

    @cached_property
    def piece_rule(self) -> str | None:
        """None when the post-processor adds no ids, else PIECE_RULE (encode_pieces adds them once a document), or
        EOS_ONCE when they end with eos_id (docs/internals.md#keeldatatokenizerhftokenizerpiece_rule)."""
        post = self._tok.post_processor
        if post is None or post.num_special_tokens_to_add(False) == 0:
            return None
        return PIECE_RULE if self.doc_end is not None or self.eos_id is None else EOS_ONCE

    @cached_property
    def doc_end(self) -> int | None:
        """The id keel puts after each document: eos_id, unless the post-processor already ends every text with it
        (a Llama-style "<s> $A </s>"), which would make it two."""
        after = self._around[1]
        return None if after and after[-1] == self.eos_id else self.eos_id

    @cached_property
    def _around(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after every text it encodes; found from the first token whose
        own text encodes to something (the tokens around it are those of no sequence)."""
        post = self._tok.post_processor
        if post is None or post.num_special_tokens_to_add(False) == 0:
            return [], []
        for i in range(self.vocab_size):
            core = self._tok.encode(self._tok.decode([i]), add_special_tokens=False)
            if core.ids:
                done = self._tok.post_process(core)
                seq = done.sequence_ids
                return done.ids[:seq.index(0)], done.ids[len(seq) - seq[::-1].index(0):]
        raise DataError(f"{self.path}: its post-processor adds tokens around each text and no token's text encodes "
                        "to anything; cannot tell where a long document's pieces join")

    def save(self, directory) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        # never through a link planted at the destination (a run directory from elsewhere)
        safe_io.write_bytes(directory, directory / "tokenizer.json", read_capped(self.path))

    def token_byte_lengths(self) -> np.ndarray | None:
        """UTF-8 bytes each id stands for, for byte-level BPE (one symbol of its alphabet = one byte;
        special tokens 0); None for other tokenizers. Decoding ids one at a time would count a token
        holding half a character as the 3-byte replacement character."""
        if type(self._tok.decoder).__name__ != "ByteLevel":
            return None
        special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        return np.array([0 if i in special else len(self._tok.id_to_token(i) or "")
                         for i in range(self.vocab_size)], dtype=np.int64)


def train_bpe(texts: Iterable, vocab_size: int, out_path) -> HFTokenizer:
    """Train a byte-level BPE on `texts`, write it to `out_path` atomically and return it loaded.

    `texts` are documents, each a string or an iterable of consecutive pieces of one (a file streamed from
    disk: `Corpus.document_streams`); the trainer sees them in bounded pieces (`bounded_pieces`).
    Byte-level means every string round-trips: decode(encode(s)) == s, with no unknown token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise DataError(f"data.tokenizer: BPE vocab_size {vocab_size} is too small; allowed: >= {len(alphabet) + 1} "
                        "(256 bytes + <|endoftext|>)")
    tok = Tokenizer(models.BPE())
    # no prefix space: it would make decode(encode(s)) start with a space that s did not have
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_CANDIDATES[0]],
                                  initial_alphabet=alphabet, show_progress=False)
    pieces = (p for text in texts for p in bounded_pieces((text,) if isinstance(text, str) else text))
    tok.train_from_iterator(pieces, trainer)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # whole and atomic, never through a link planted at the target or its temporary name
    safe_io.write_text(out_path.parent, out_path, tok.to_str(pretty=True))
    return HFTokenizer(out_path)


# The trainer's pre-tokenizer (the GPT-2 regex, in the Onig engine) fails to allocate on a line of 50 million
# characters, and a pre-token (a run of letters, digits, other marks or spaces) costs time quadratic in its length:
# 100,000 letters in a row take 8 s, a million minutes. So the trainer is given pieces of at most PIECE_CHARS,
# cut where the regex would split anyway, and runs longer than WORD_CHARS are cut (no real word is that long).
PIECE_CHARS = 1 << 20
WORD_CHARS = 256
_SPACE_RUN = re.compile(rf"\s{{{WORD_CHARS}}}")
_LONG_RUN = re.compile(rf"[^\W_]{{{WORD_CHARS},}}|(?:[^\w\s]|_){{{WORD_CHARS},}}|\s{{{WORD_CHARS},}}")


def bounded_pieces(chunks: Iterable[str]) -> Iterator[str]:
    """The text of one document, given as consecutive `chunks`, in pieces the BPE trainer can take: at most PIECE_CHARS,
    no run of one kind longer than WORD_CHARS (docs/internals.md#keeldatatokenizerbounded_pieces)."""
    for piece in text_pieces(chunks):
        yield from _short_runs(piece)


def text_pieces(chunks: Iterable[str]) -> Iterator[str]:
    """The text of one document, given as consecutive `chunks`, in pieces of at most PIECE_CHARS that join to exactly
    the text, cut where GPT-2's pre-tokenizer splits anyway (docs/internals.md#keeldatatokenizertext_pieces)."""
    text, start = "", 0
    for chunk in chunks:
        text = text[start:] + chunk
        start = 0
        while len(text) - start > PIECE_CHARS:
            end = _split_point(text, start + PIECE_CHARS // 2, start + PIECE_CHARS)
            yield text[start:end]
            start = end
    if start < len(text):
        yield text[start:]


def _split_point(text: str, lo: int, hi: int, tries: int = 64) -> int:
    """The last place in (lo, hi] where GPT-2's pre-tokenizer splits whatever follows: before a space with
    text on both sides (" word" is one pre-token), or after a line end with text on both sides; else hi."""
    for mark, before, after in ((" ", 1, 1), ("\n", 2, 0)):
        at = hi
        for _ in range(tries):
            at = text.rfind(mark, lo, at)
            if at <= lo:
                break
            cut = at + (mark == "\n")
            if not text[cut - before].isspace() and not text[cut + after].isspace():
                return cut
    return hi


def _short_runs(piece: str) -> Iterator[str]:
    longest = max(map(len, piece.split()), default=0)  # a fast check; the regex only where one may be long
    if longest < WORD_CHARS and not _SPACE_RUN.search(piece):
        if piece and not piece.isspace():
            yield piece
        return
    start = 0
    for run in _LONG_RUN.finditer(piece):
        for cut in range(run.start() + WORD_CHARS, run.end(), WORD_CHARS):
            if not (part := piece[start:cut]).isspace():
                yield part
            start = cut
    if (part := piece[start:]) and not part.isspace():
        yield part


def load_tokenizer(spec: str, cache_dir, corpus=None):
    """The tokenizer named by `spec` (DataConfig.tokenizer).

    "bytes": ByteTokenizer. "bpe" or "bpe:<vocab_size>": a byte-level BPE trained on the train split of
    `corpus` (a `keel.data.Corpus`) and cached under `cache_dir/tokenizers/` by the corpus fingerprint,
    so a second call with unchanged data loads it instead of retraining. Anything else: the path of a
    tokenizer.json, or of a directory holding one.
    """
    if spec == "bytes":
        return ByteTokenizer()
    if is_bpe(spec):
        vocab_size = _bpe_vocab(spec)
        if corpus is None:
            raise DataError(f"data.tokenizer: {spec!r} trains on the corpus, but no corpus was given")
        path = Path(cache_dir) / "tokenizers" / f"{corpus.fingerprint[:16]}-bpe{vocab_size}" / "tokenizer.json"
        if path.is_file():
            return HFTokenizer(path)
        return train_bpe(corpus.document_streams("train"), vocab_size, path)
    path = Path(spec).expanduser()
    try:
        return HFTokenizer(path / "tokenizer.json" if path.is_dir() else path)
    except DataError as err:  # a FIFO, a directory, a damaged file: named as the field that chose it
        raise DataError(str(err) if "data.tokenizer" in str(err) else f"data.tokenizer: {err}") from None


MAX_TOKENIZER_BYTES = safe_io.CAP_TOKENIZER  # a real tokenizer.json is a few MiB; parsing costs ~2x its size


def read_capped(path: Path, follow_links: bool = True) -> bytes:
    """The bytes of a tokenizer file: a regular file (a FIFO is refused, not waited on) of at most
    MAX_TOKENIZER_BYTES, checked before reading. Without `follow_links` a symlink is refused (a run
    directory's files: keel never writes a link there)."""
    try:
        return safe_io.read_regular(path, MAX_TOKENIZER_BYTES, follow_links)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise DataError(f"{path}: is a symbolic link; keel does not follow links inside a run directory") from None
        raise


def load_saved_tokenizer(directory):
    """The tokenizer a run saved with `save(directory)`; its files are read only if regular, not links."""
    directory = Path(directory)
    if os.path.lexists(directory / "tokenizer.json"):
        return HFTokenizer(directory / "tokenizer.json", follow_links=False)
    config = directory / "tokenizer_config.json"
    try:
        kind = safe_io.loads_json(read_capped(config, follow_links=False)).get("keel_tokenizer")
    except (OSError, ValueError, AttributeError):
        kind = None
    if kind == "bytes":
        return ByteTokenizer()
    raise DataError(f"{directory}: no saved tokenizer (tokenizer.json, or tokenizer_config.json naming 'bytes')")


def is_bpe(spec: str) -> bool:
    """Whether data.tokenizer `spec` names a BPE keel trains ("bpe" or "bpe:<vocab_size>")."""
    return spec == "bpe" or spec.startswith("bpe:")


def _bpe_vocab(spec: str) -> int:
    if spec == "bpe":
        return DEFAULT_BPE_VOCAB
    try:
        return int(spec.removeprefix("bpe:"))
    except ValueError:
        raise DataError(f"data.tokenizer: {spec!r} has no integer vocabulary size; allowed: {SPEC_HELP}") from None


def planned_vocab_size(spec: str) -> int | None:
    """The vocabulary a tokenizer spec will have, known before any tokenizer is trained or loaded (None
    for a tokenizer file that cannot be read here: loading it then reports the problem)."""
    if spec == "bytes":
        return 256
    if is_bpe(spec):
        return _bpe_vocab(spec)
    path = Path(spec).expanduser()
    try:  # through read_capped: Tokenizer.from_file would wait forever on a FIFO
        raw = read_capped(path / "tokenizer.json" if path.is_dir() else path)
        return Tokenizer.from_str(raw.decode("utf-8")).get_vocab_size()
    except Exception:
        return None
