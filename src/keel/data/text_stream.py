"""Reading text from disk in bounded memory: directory walks without recursion, and text files read in blocks
(docs/internals.md#keeldatatext_stream)."""

from __future__ import annotations

import codecs
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from keel import safe_io
from keel.errors import DataError

BLOCK = 1 << 20  # bytes read at a time
BOM = codecs.BOM_UTF8  # a byte-order mark is not part of the text


@dataclass(frozen=True)
class Block:
    chars: int  # index of its first character in the file's text
    start: int  # byte offset of that character
    end: int  # byte offset after its last whole character


class NotText(Exception):
    """The file is not UTF-8 text (undecodable, or holding NUL bytes), or not a regular file."""


def walk(root: Path, suffixes, prune=()) -> list[tuple[str, int, int]]:
    """(path relative to `root`, size, mtime_ns) of every regular file under `root` whose suffix is in `suffixes`,
    in os.walk's order, hidden entries and `prune` names left out, without recursion (see
    docs/internals.md#keeldatatext_streamwalk)."""
    found, stack = [], [root]
    while stack:
        here = stack.pop()
        try:
            with os.scandir(here) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as err:
            raise DataError(f"{err.filename or here}: cannot read directory ({err.strerror})") from None
        below = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if is_dir:
                if entry.name not in prune and not entry.is_symlink():
                    below.append(Path(entry.path))
                continue
            if Path(entry.name).suffix.lower() not in suffixes:
                continue
            try:
                st = os.stat(entry.path)  # a link to a file counts as the file; a dangling one or a loop does not
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):  # a FIFO or a device among the files is left out, never opened
                found.append((Path(entry.path).relative_to(root).as_posix(), st.st_size, st.st_mtime_ns))
        stack.extend(reversed(below))
    return found


def open_file(path: Path):
    """`path` opened for reading if it is a regular file (a FIFO is not waited on; a device is refused)."""
    try:
        return safe_io.open_regular(path, follow_links=True)
    except DataError:
        raise NotText("not a regular file") from None
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror})") from None


def scan(path: Path) -> list[Block]:
    """Check that `path` is UTF-8 text without NUL bytes, reading a block at a time; return its blocks and,
    last, an empty one at the end (whose `chars` is the text's length). Raises NotText at the first block
    that is not text (an 8 GB sparse file: at its first)."""
    blocks, chars, offset = [], 0, 0
    decoder = codecs.getincrementaldecoder("utf-8")()
    with open_file(path) as f:
        while data := f.read(BLOCK):
            if b"\0" in data:
                raise NotText("holds NUL bytes")
            if offset == 0 and data.startswith(BOM):
                data, offset = data[len(BOM):], len(BOM)
            start = offset - len(decoder.getstate()[0])
            try:
                text = decoder.decode(data)
            except UnicodeDecodeError:
                raise NotText("not UTF-8") from None
            offset += len(data)
            if text:
                blocks.append(Block(chars, start, offset - len(decoder.getstate()[0])))
                chars += len(text)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise NotText("not UTF-8 (ends inside a character)") from None
    return [*blocks, Block(chars, offset, offset)]  # the end: its `chars` is the text's length


def _read(path: Path, block: Block) -> str:
    with open_file(path) as f:
        f.seek(block.start)
        data = f.read(block.end - block.start)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: changed while being read; run again") from None


def stream(path: Path, blocks: list[Block], lo: int = 0, hi: int | None = None) -> Iterator[str]:
    """Characters [lo, hi) of the file that `scan` returned `blocks` for, one block at a time."""
    hi = blocks[-1].chars if hi is None else hi
    for block, after in zip(blocks, blocks[1:]):
        if after.chars <= lo:
            continue
        if block.chars >= hi:
            return
        yield _read(path, block)[max(0, lo - block.chars):hi - block.chars]


class Text:
    """Characters [lo, hi) of a file that `scan` checked, as a document that can be read more than once: each
    iteration streams it again a block at a time, so a document larger than memory is never held whole."""

    def __init__(self, path: Path, blocks: list[Block], lo: int = 0, hi: int | None = None):
        self.path, self.blocks, self.lo, self.hi = path, blocks, lo, hi

    def __iter__(self) -> Iterator[str]:
        return stream(self.path, self.blocks, self.lo, self.hi)

    def has_text(self) -> bool:
        """Whether any character is not whitespace (read up to the first block that has one)."""
        return any(not piece.isspace() for piece in self)


def find(path: Path, blocks: list[Block], char: str, start: int) -> int:
    """Index of the first `char` at or after `start` in the file's text, -1 if none."""
    for block, after in zip(blocks, blocks[1:]):
        if after.chars <= start:
            continue
        at = _read(path, block).find(char, max(0, start - block.chars))
        if at != -1:
            return block.chars + at
    return -1
