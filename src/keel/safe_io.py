"""Reading and writing files in a run directory that may come from someone else: no link followed, no FIFO waited
on, sizes capped, writes atomic, JSON bounded (the rules: docs/internals.md#keelsafe_io)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from pathlib import Path

from keel.errors import DataError

MiB = 1 << 20
CAP_LOG = 256 * MiB  # metrics.jsonl, telemetry.jsonl
CAP_SMALL = 16 * MiB  # config.yaml, run.json, summary.json, tokenizer_config.json, .lock
CAP_TOKENIZER = 64 * MiB  # tokenizer.json
MAX_INT_DIGITS = 18  # every integer keel writes (steps, counts, sizes) is below 10**18
TMP = ".tmp-"  # in every temporary file's name, which a writer that resumes looks for


def loads_json(text: str | bytes, bound_ints: bool = True):
    """`json.loads` for a file from elsewhere: nesting deeper than Python's recursion limit (about 1,000) and
    an integer of more than MAX_INT_DIGITS digits are ValueErrors, as any other malformed JSON is.
    `bound_ints=False` for data that is not keel's (a corpus's JSONL records), whose integers are its own."""
    try:
        return json.loads(text, parse_int=_bounded_int if bound_ints else None)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer {digits[:12]}... has more than {MAX_INT_DIGITS} digits")
    return int(digits)


def inside(root, path) -> Path:
    """`path`, checked to lie under `root` with no symlink between them (the final entry may be one:
    callers open it with O_NOFOLLOW). Raises DataError naming the entry."""
    root, path = Path(root), Path(path)
    try:
        rel = path.relative_to(root)
    except ValueError:
        raise DataError(f"{path}: outside the run directory {root}, refused") from None
    if ".." in rel.parts:
        raise DataError(f"{path}: outside the run directory {root}, refused")
    here = root
    for part in rel.parts[:-1]:
        here = here / part
        if here.is_symlink():
            raise DataError(f"{here}: is a symbolic link; keel does not follow links inside a run directory")
    if os.path.lexists(path.parent) and not path.parent.resolve().is_relative_to(root.resolve()):
        raise DataError(f"{path}: resolves outside the run directory {root}, refused")
    return path


def _refuse(path: Path, err: OSError, doing: str) -> DataError:
    if err.errno == errno.ELOOP or (err.errno == errno.ENOTDIR and Path(path).is_symlink()):
        return DataError(f"{path}: is a symbolic link; keel does not follow links inside a run directory")
    if err.errno == errno.EISDIR:
        return DataError(f"{path}: is a directory, not a file")
    if err.errno == errno.ENOSPC:
        return DataError(f"{path}: cannot {doing}: no space left on {path.parent}")
    return DataError(f"{path}: cannot {doing} ({err.strerror or err})")


def _regular(fd: int, path: Path) -> None:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
        raise DataError(f"{path}: not a regular file ({kind}); keel reads and writes only regular files")


def temporary(path: Path):
    """A new file beside `path`, named `.<name>.tmp-<pid>-<random>` and opened for binary writing, created with
    O_EXCL|O_NOFOLLOW (never an existing file, never through a link): (its path, the file). OSError as os.open's."""
    tmp = path.with_name(f".{path.name}{TMP}{os.getpid()}-{secrets.token_hex(4)}")
    return tmp, os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "wb")


def write_bytes(root, path, data: bytes, fsync: bool = False) -> Path:
    """Write `path` (under `root`) whole and atomically, never through a link; with `fsync`, on disk before its
    name is (a machine that stops hard leaves no empty file)."""
    path = inside(root, path)
    if path.is_symlink():
        raise DataError(f"{path}: is a symbolic link; refused to write through it")
    tmp = None
    try:
        tmp, f = temporary(path)
        with f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise _refuse(path, err, "write") from err  # the cause: keel data prepare tells a full disk by its errno
    return path


def write_text(root, path, text: str, fsync: bool = False) -> Path:
    return write_bytes(root, path, text.encode("utf-8"), fsync)


def append_text(root, path, text: str) -> None:
    """Append to `path` (created if missing): a regular file, never a link or FIFO."""
    path = inside(root, path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        raise _refuse(path, err, "append to it") from None
    _regular(fd, path)
    with os.fdopen(fd, "a") as f:
        f.write(text)


def open_lock(root, path):
    """The lock file opened read-write (created if missing) as a binary file object; a link, directory or
    FIFO is refused."""
    path = inside(root, path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        raise _refuse(path, err, "open the lock") from None
    _regular(fd, path)
    return os.fdopen(fd, "r+b")


def open_regular(path, follow_links: bool = False):
    """`path` opened for binary reading if it is a regular file (DataError otherwise): a FIFO is opened non-blocking
    and refused, never waited on; a symbolic link is refused (ELOOP) unless `follow_links`. OSError as os.open's."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW))
    _regular(fd, path)
    return os.fdopen(fd, "rb")


def read_regular(path, cap: int, follow_links: bool = False) -> bytes:
    """The bytes of `path` (`open_regular`), of at most `cap` bytes, refused before a byte is read."""
    with open_regular(path, follow_links) as f:
        if os.fstat(f.fileno()).st_size > cap:
            raise DataError(f"{path}: larger than {cap / MiB:g} MiB, refused")
        data = f.read(cap + 1)
    if len(data) > cap:
        raise DataError(f"{path}: larger than {cap / MiB:g} MiB, refused")
    return data


def read_bytes(root, path, cap: int) -> bytes | None:
    """The bytes of `path` (under `root`), None if it does not exist. Refuses a link, a non-regular file, or
    one larger than `cap`, before reading it."""
    path = inside(root, path)
    try:
        return read_regular(path, cap)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise _refuse(path, err, "read it") from None


def read_text(root, path, cap: int) -> str | None:
    data = read_bytes(root, path, cap)
    return None if data is None else data.decode("utf-8", errors="replace")


def check_dir(root, path) -> Path:
    """`path` (under `root`), refused when it is a symlink or exists as something other than a directory;
    for the directories keel writes into (checkpoints/, tokenizer/, tensorboard/, wandb/)."""
    path = inside(root, path)
    if path.is_symlink():
        raise DataError(f"{path}: is a symbolic link; keel does not follow links inside a run directory")
    if os.path.lexists(path) and not path.is_dir():
        raise DataError(f"{path}: exists and is not a directory")
    return path
