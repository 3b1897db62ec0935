"""`keel data prepare`: a corpus into token shards, tokenised by worker processes, resumable and extendable
(docs/internals.md#keeldatashard_writer)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from contextlib import contextmanager
from itertools import chain
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from keel import safe_io
from keel.data.corpus import Corpus, DataConfig, build_corpus
from keel.data.encode_workers import document_digest, encoder
from keel.data.shards import (
    FORMAT,
    INDEX_DTYPE,
    MANIFEST,
    MAX_SHARD_TOKENS,
    SHARD_NAME,
    SPLITS,
    check_files,
    check_tokenizer,
    is_count,
    read_manifest,
    shard_dtype,
    shard_name,
)
from keel.data.tokenizer import (
    EOS_ONCE,
    PIECE_RULE,
    HFTokenizer,
    is_bpe,
    load_tokenizer,
    planned_vocab_size,
    read_capped,
    train_bpe,
)
from keel.errors import DataError

DEFAULT_SHARD_TOKENS = 100_000_000  # nanoGPT's and modded-nanogpt's shard: 200 MB of uint16
DEFAULT_BPE_SAMPLE = 100_000  # documents a BPE is trained on (sentencepiece's input_sentence_size, in documents)
BPE_SEED = 0
TOKENIZER_FILE = "tokenizer.json"
RESUME = "free space and run the command again to resume"


def prepare_shards(cfg: DataConfig, out, workers: int = 1, shard_tokens: int | None = None,
                   bpe_sample: int = DEFAULT_BPE_SAMPLE, progress: bool | None = None) -> dict:
    """Tokenise the corpus `cfg` names into shards under `out` with `workers` processes, or resume or extend the
    shards there. A BPE (data.tokenizer=bpe[:N]) is trained on `bpe_sample` train documents drawn with a fixed
    seed and kept as `out/tokenizer.json`; a tokenizer file is copied there. Returns what the directory holds
    and what this call added (`up_to_date`: nothing, no file written)."""
    out = Path(out).expanduser()
    if workers < 1:
        raise DataError(f"--workers: got {workers}; allowed: an integer >= 1")
    if shard_tokens is not None and not 0 < shard_tokens <= MAX_SHARD_TOKENS:
        raise DataError(f"--shard-tokens: got {shard_tokens}; allowed: an integer in [1, {MAX_SHARD_TOKENS:,}]")
    if bpe_sample < 1:
        raise DataError(f"--bpe-sample: got {bpe_sample}; allowed: an integer >= 1 (documents)")
    manifest = _existing(out)
    corpus = build_corpus(cfg)
    with _resumable():
        tokenizer = _tokenizer(cfg.tokenizer, out, manifest, corpus, bpe_sample)
        if manifest is None:  # the size asked is kept: the trainer stops short of it on a small sample
            sample = ({"documents": bpe_sample, "seed": BPE_SEED, "vocab_size": planned_vocab_size(cfg.tokenizer)}
                      if is_bpe(cfg.tokenizer) else None)
            manifest = _new_manifest(tokenizer, shard_tokens, sample, corpus)
            _write_manifest(out, manifest)
        else:
            check_tokenizer(manifest, tokenizer, out)
            if shard_tokens is not None and shard_tokens != manifest["shard_tokens"]:
                raise DataError(f"--shard-tokens: {out} holds shards of {manifest['shard_tokens']:,} tokens, not "
                                f"{shard_tokens:,}; leave the option out, or prepare into a new --out")
    _remove_temporaries(out)
    for split in SPLITS:
        _drop_missing_tail(out, manifest, split)
    if _todo(manifest, corpus):  # before the shards are hashed: nothing to add to them is refused at once
        _check_piece_rule(out, manifest, tokenizer)
    check_files(out, manifest)  # what is kept is whole: a damaged shard is named, never written over
    before = {s: len(manifest["splits"][s]["shards"]) for s in SPLITS}
    up_to_date = _fill(out, manifest, corpus, tokenizer, workers, progress)
    splits = {s: {"shards": len(st["shards"]), "new_shards": len(st["shards"]) - before[s],
                  "documents": st["documents"], "tokens": st["tokens"]} for s, st in manifest["splits"].items()}
    return {"directory": str(out), "up_to_date": up_to_date, "dtype": manifest["dtype"],
            "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "splits": splits}


def write_shards(corpus: Corpus, tokenizer, out: Path) -> None:
    """Tokenise `corpus` with `tokenizer` (loaded already) in this process into `out`, a new empty directory: the
    token cache `keel train` keeps of a corpus (keel.data.loader). Its manifest's corpus is `describe()` once every
    document was read, so it counts the files skipped as not text."""
    tokenizer = _keep(tokenizer, out)
    manifest = _new_manifest(tokenizer, None, None, corpus)
    _fill(out, manifest, corpus, tokenizer, workers=1, progress=False)
    manifest["corpus"] = corpus.describe()
    _write_manifest(out, manifest)


def _new_manifest(tokenizer, shard_tokens: int | None, bpe_sample: dict | None, corpus: Corpus) -> dict:
    made = {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id}
    if tokenizer.piece_rule is not None:  # only then: every other manifest stays as an older keel wrote it
        made["piece_rule"] = tokenizer.piece_rule
    return {"format": FORMAT, "dtype": shard_dtype(tokenizer.vocab_size).name,
            "shard_tokens": shard_tokens or DEFAULT_SHARD_TOKENS, "tokenizer": made,
            "bpe_sample": bpe_sample, "corpus": _corpus_info(corpus),
            "splits": {s: {"complete": False, "documents": 0, "tokens": 0, "shards": []} for s in SPLITS}}


def _fill(out: Path, manifest: dict, corpus: Corpus, tokenizer, workers: int, progress: bool | None) -> bool:
    """Tokenise what `out`'s shards lack of `corpus` (its tokenizer.json, or bytes) and check the splits; True when
    nothing was missing."""
    todo = _todo(manifest, corpus)
    try:
        with _resumable():  # the manifest and the indices, written by safe_io
            if todo:
                with encoder("bytes" if tokenizer.name == "bytes" else str(out / TOKENIZER_FILE),
                             shard_dtype(tokenizer.vocab_size), workers) as encode:
                    for split in todo:
                        _extend(out, manifest, split, corpus, encode, progress)
                manifest["corpus"] = _corpus_info(corpus)
                _write_manifest(out, manifest)  # unchanged bytes (a touched but unchanged file aside): not rewritten
    except OSError as err:  # a full disk: the shards finished so far are kept, and the same command resumes
        raise DataError(f"{out}: cannot write a shard ({err.strerror}); {RESUME}") from None
    _check_splits(manifest, corpus)
    return not todo


def _todo(manifest: dict, corpus: Corpus) -> list[str]:
    """The splits `corpus` may have documents of that the shards lack."""
    same = manifest["corpus"]["fingerprint"] == corpus.fingerprint
    return [s for s in SPLITS if not (same and manifest["splits"][s]["complete"])]  # complete: a dropped tail aside


@contextmanager
def _resumable():
    """A disk that fills up while safe_io writes a file (its refusal keeps the OSError as its cause) is named with
    the resume line, as one that fills up during a shard is."""
    try:
        yield
    except DataError as err:
        if isinstance(err.__cause__, OSError) and err.__cause__.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DataError(f"{err}; {RESUME}") from None
        raise


# ---- the directory and its tokenizer ----------------------------------------------------------------------

def _existing(out: Path) -> dict | None:
    """The manifest of `out` when there is one; None for a new or empty directory (or one holding only what an
    earlier prepare left before its first manifest)."""
    if os.path.lexists(out / MANIFEST):
        return read_manifest(out)
    if os.path.lexists(out) and not out.is_dir():
        raise DataError(f"--out {out}: exists and is not a directory")
    if out.is_dir():
        foreign = sorted(e for e in os.listdir(out) if e != TOKENIZER_FILE and not e.startswith("."))
        if foreign:
            raise DataError(f"--out {out}: holds {foreign[0]!r} and no {MANIFEST}; not a shard directory: choose a "
                            "new or empty one (nothing was written)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(f"--out {out}: cannot create the directory ({err.strerror})") from None
    return None


def _tokenizer(spec: str, out: Path, manifest: dict | None, corpus: Corpus, bpe_sample: int):
    """The tokenizer `spec` names, as the shards use it: a BPE trained here (or the one trained before) in
    `out/tokenizer.json`, a tokenizer file copied there, or bytes."""
    target = out / TOKENIZER_FILE
    if is_bpe(spec) and manifest is None:
        return train_bpe(corpus.sample(bpe_sample, BPE_SEED), planned_vocab_size(spec), target)
    if is_bpe(spec):  # never trained again over shards: checked here, before anything is tokenised or written
        if not os.path.lexists(target):
            raise DataError(f"data.tokenizer: {spec} names the BPE in {target}, but there is none; the shards in "
                            f"{out} were made by {manifest['tokenizer']['name']!r}: name that tokenizer")
        return directory_bpe(spec, out, manifest, exact=True)
    tok = load_tokenizer(spec, out)
    if manifest is not None:  # checked before the copy below could replace the directory's own
        check_tokenizer(manifest, tok, out)
    return _keep(tok, out)


def directory_bpe(spec: str, directory: Path, manifest: dict, exact: bool = False) -> HFTokenizer:
    """The BPE trained in shard directory `directory` (whose manifest is `manifest`), which data.tokenizer `spec`
    names there: bpe:<N> one trained for N tokens, bpe one of any size (training reads the shards), or with `exact`
    one trained for the size bpe trains (prepare adds to them). A BPE has the size it was trained for, or fewer on a
    small sample; a manifest that does not record that size is taken to hold any size up to the one named."""
    tok = HFTokenizer(directory / TOKENIZER_FILE, follow_links=False)
    asked, sample = planned_vocab_size(spec), manifest.get("bpe_sample")
    trained_for = sample.get("vocab_size") if isinstance(sample, dict) else None
    trained_for = trained_for if is_count(trained_for) else None  # not recorded (an older keel), or damaged
    fits = tok.vocab_size <= asked if trained_for is None else asked == trained_for
    if (exact or spec != "bpe") and not (fits or asked == tok.vocab_size):
        raise DataError(f"data.tokenizer: {spec} names {asked:,} tokens, but the BPE in {directory / TOKENIZER_FILE} "
                        f"that made the shards has {tok.vocab_size:,}"
                        + (f" (trained for {trained_for:,})" if trained_for not in (None, tok.vocab_size) else "")
                        + f"; name data.tokenizer=bpe:{trained_for or tok.vocab_size}")
    return tok


def _check_piece_rule(out: Path, manifest: dict, tokenizer) -> None:
    """Refuse to add to shards whose long documents got a post-processor's BOS/EOS on every piece (an older keel):
    new ids would be counted otherwise than those kept."""
    recorded = manifest["tokenizer"].get("piece_rule")
    if recorded != tokenizer.piece_rule:
        how = ("put the end-of-text id twice after each document (the post-processor's and its own)"
               if recorded == PIECE_RULE and tokenizer.piece_rule == EOS_ONCE else
               f"gave each million-character piece of a long document the BOS/EOS {tokenizer.name!r} adds, not each "
               "document once")
        raise DataError(f"{out / MANIFEST}: the shards were made by an older keel, which {how}; prepare into a new "
                        "--out")


def _keep(tok, out: Path):
    """`tok`'s file copied into `out` (the workers load it from there, and the directory is self-contained), and
    loaded from there; bytes as they are."""
    if tok.name == "bytes":
        return tok
    target = out / TOKENIZER_FILE
    raw = read_capped(tok.path)
    if not os.path.lexists(target) or target.is_symlink() or read_capped(target) != raw:  # a link: refused
        safe_io.write_bytes(out, target, raw, fsync=True)
    return HFTokenizer(target, follow_links=False)


def _corpus_info(corpus: Corpus) -> dict:
    # the files skipped as not text are known only after reading them all; a resumed prepare reads only some
    return {k: v for k, v in corpus.describe().items() if k not in ("skipped", "skipped_files")}


def _remove_temporaries(out: Path) -> None:
    """What a killed prepare left half-written (never a file keel did not name so)."""
    for entry in os.listdir(out):
        name = entry.lstrip(".").split(safe_io.TMP)[0]
        if entry.startswith(".") and safe_io.TMP in entry and (SHARD_NAME.fullmatch(name) or name in (MANIFEST,
                                                                                              TOKENIZER_FILE)):
            (out / entry).unlink(missing_ok=True)


def _drop_missing_tail(out: Path, manifest: dict, split: str) -> None:
    """Forget the shards at the end of `split` whose files are gone (a prepare stopped between renaming a shard
    into place and rewriting the manifest, or a user who deleted them): they are made again, the same bytes.
    A shard missing before one that is present is a damaged directory."""
    shards = manifest["splits"][split]["shards"]
    present = [os.path.lexists(out / s["file"]) and os.path.lexists(out / s["index"]) for s in shards]
    keep = len(present)
    while keep and not present[keep - 1]:
        keep -= 1
    if not all(present[:keep]):
        first = shards[present.index(False)]["file"]
        raise DataError(f"{out / first}: listed in {MANIFEST} but missing while later shards exist; the directory "
                        "is damaged (prepare the corpus again into a new --out)")
    if keep < len(shards):
        del shards[keep:]
        manifest["splits"][split]["complete"] = False


def _check_splits(manifest: dict, corpus: Corpus) -> None:
    train, val = (manifest["splits"][s]["documents"] for s in SPLITS)
    if train + val == 0:
        skipped = len(getattr(corpus, "skipped", ()))
        why = f"; {skipped} file(s) skipped as not UTF-8 text" if skipped else ""
        raise DataError(f"{corpus.spec}: empty corpus (no non-empty documents{why})")
    if train == 0:
        raise DataError(f"{corpus.spec}: the training split is empty; lower data.val_fraction or add text")
    if val == 0 and corpus.val_fraction > 0:
        raise DataError(f"{corpus.spec}: the validation split is empty ({train} document(s) in all); add documents "
                        "or set data.val_fraction=0")


# ---- one split ------------------------------------------------------------------------------------------

def _extend(out: Path, manifest: dict, split: str, corpus: Corpus, encode, progress: bool | None) -> None:
    """Tokenise `split`'s documents from where its last shard ended into new shards, checking first that the
    documents before that point are those the shards were made from."""
    state, size = manifest["splits"][split], manifest["shard_tokens"]
    shards = state["shards"]
    end = shards[-1]["end"] if shards else {"document": 0, "offset": 0, "digest": hashlib.sha256().hexdigest()}
    touched = end["document"] + (end["offset"] > 0)  # documents with tokens in the shards kept
    docs, digest = corpus.document_streams(split), hashlib.sha256()  # a file's text read a block at a time
    last = None
    for _ in range(touched):
        last = next(docs, None)
        if last is None:
            break
        digest.update(document_digest(last))
    if (last is None and touched) or digest.hexdigest() != end["digest"]:
        raise DataError(f"{corpus.spec}: the {split} documents already in {out}'s shards have changed (not only new "
                        "documents after them; data.val_fraction and data.text_field count too); prepare into a "
                        "new --out")
    todo = chain([last] if end["offset"] else [], docs)
    # offset: ids of document `index` before this piece; skip: those of its first ids the kept shards hold
    index, offset, skip, shard = end["document"], 0, end["offset"], None
    bar = tqdm(desc=f"{split} documents", unit="doc", initial=index, disable=None if progress is None else not progress)
    try:
        for (_, doc_digest, last_piece), ids in encode(todo):
            if doc_digest is not None and index >= touched:
                digest.update(doc_digest)
            pos = min(skip, len(ids))
            skip -= pos
            while pos < len(ids):
                if shard is None:
                    shard = _Shard(out, split, len(shards))
                if offset + pos == 0:
                    shard.starts.append(shard.tokens)
                take = min(size - shard.tokens, len(ids) - pos)
                shard.write(ids[pos:pos + take])
                pos += take
                if shard.tokens == size:
                    at = (index + 1, 0) if last_piece and pos == len(ids) else (index, offset + pos)
                    _publish(out, manifest, split, shard.finish(*at, digest.hexdigest()))
                    shard = None
            offset += len(ids)
            if last_piece:
                index, offset = index + 1, 0
                bar.update()
        if shard is not None:
            _publish(out, manifest, split, shard.finish(index, 0, digest.hexdigest()))
            shard = None
    finally:
        bar.close()
        if shard is not None:
            shard.abandon()
    state |= {"complete": True, "documents": index, "tokens": sum(s["tokens"] for s in shards)}


def _publish(out: Path, manifest: dict, split: str, entry: dict) -> None:
    """A whole shard, renamed into place, entered in the manifest (rewritten: a resume starts after it)."""
    state = manifest["splits"][split]
    state["shards"].append(entry)
    state |= {"documents": entry["end"]["document"], "tokens": state["tokens"] + entry["tokens"]}
    _write_manifest(out, manifest)


class _Shard:
    """One shard being written: a temporary file until `finish` renames it into place."""

    def __init__(self, out: Path, split: str, k: int):
        self.bin, self.idx = out / shard_name(split, k, "bin"), out / shard_name(split, k, "idx")
        for path in (self.bin, self.idx):  # keel writes no link here: one was planted
            if path.is_symlink():
                raise DataError(f"{path}: is a symbolic link; refused to write through it")
        try:
            self.tmp, self.file = safe_io.temporary(self.bin)
        except OSError as err:
            raise DataError(f"{out}: cannot write ({err.strerror})") from None
        self.sha, self.tokens, self.starts = hashlib.sha256(), 0, []

    def write(self, ids: np.ndarray) -> None:
        data = ids.tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.tokens += len(ids)

    def finish(self, document: int, offset: int, digest: str) -> dict:
        index = np.asarray(self.starts, dtype=INDEX_DTYPE).tobytes()
        safe_io.write_bytes(self.idx.parent, self.idx, index, fsync=True)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.bin)
        return {"file": self.bin.name, "tokens": self.tokens, "sha256": self.sha.hexdigest(), "index": self.idx.name,
                "index_sha256": hashlib.sha256(index).hexdigest(), "documents": len(self.starts),
                "end": {"document": document, "offset": offset, "digest": digest}}

    def abandon(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def _write_manifest(out: Path, manifest: dict) -> None:
    data = (json.dumps(manifest, indent=1) + "\n").encode()
    path = out / MANIFEST
    if path.is_file() and not path.is_symlink() and path.read_bytes() == data:
        return
    safe_io.write_bytes(out, path, data, fsync=True)
