"""Checkpoints: atomic, checksummed, and never a way to run code.

A checkpoint is a directory `checkpoints/step_XXXXXXXX/` holding
  model.safetensors   the weights (safetensors: tensors only)
  state.pt            optimiser, data-sampler and RNG state (tensors and plain containers only,
                      loaded with `torch.load(weights_only=True)`)
  meta.json           step, schedule and guard state
  manifest.json       {"format": "safetensors", "<file>": "<SHA-256>", ...}, written last
It is built under a temporary name, every file fsync'ed, then renamed into place, so a crash leaves
either the complete checkpoint or none.

Runs under torchrun write sharded checkpoints instead (`save_sharded`, format "dcp"): the weights and
optimiser state are a `torch.distributed.checkpoint` (DCP) save, `.metadata` plus one `__<rank>_0.distcp`
file per rank, in place of model.safetensors and the optimiser in state.pt. DCP reshards on load, so a
checkpoint written by N ranks loads on M ranks, or in a single process (`load`, `load_sharded`), and
`export_safetensors` turns one into a single safetensors file.

What a loader trusts: only the manifest. Its "format" picks the loader (never the presence of some file:
a stray `.metadata` once sent a safetensors checkpoint down the DCP path, which unpickles it), only the
files it lists are opened, and each is checksummed against it before it is parsed. Manifests written
before "format" existed are read by the files they list (`.metadata`: dcp, `model.safetensors`:
safetensors). The checksums catch corruption; a hostile checkpoint with a consistent manifest is stopped
by the parsers, none of which can run code: safetensors, JSON, `torch.load(weights_only=True)`, and, for
DCP's pickled `.metadata` and the hyper-parameters DCP pickles into its shards, an unpickler that builds
only DCP's own metadata classes and a weights-only load.

What `verify` promises: after the checksums it parses every file's structure cheaply (the safetensors
header, state.pt's archive and pickle with its tensors memory-mapped, meta.json, the DCP metadata and the
shard extents it points to), so a checkpoint it passes loads unless it does not fit the model. That is
what lets `latest_valid` fall back past a checkpoint whose checksums match content that is still broken
(a writer that lost data without reporting it). Directories that are symlinks, and listed files that are
not regular files (a FIFO would hang the reader), are refused, never followed.

Writing fails as one `CheckpointError` naming the checkpoint when the disk or filesystem does (full,
read-only, quota); the temporary directory is removed and earlier checkpoints are untouched. What killed
writers leave behind is removed by `clean_stale_tmp`, which every save calls and a run should call when it
starts. One writer per run directory is assumed throughout.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import stat
import sys
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model
from torch import nn

from keel.errors import CheckpointError

FILES = ("model.safetensors", "state.pt", "meta.json")  # format "safetensors": exactly these
DCP_METADATA = ".metadata"
DCP_FILES = (DCP_METADATA, "state.pt", "meta.json")  # format "dcp": these and one or more shards
_SHARD = re.compile(r"__\d+_\d+\.distcp")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_STEP = re.compile(r"step_\d+")
_LEFTOVER = re.compile(r"\.(tmp|old)-(step_\d+)(-.*)?")  # what save and _commit write under temporary names
_SMALL = 64 << 20  # manifest.json, meta.json and .metadata are read whole; anything larger is not ours


class _Damaged(Exception):
    """What is wrong with a checkpoint, in a few words: `verify` returns it, loaders raise it with the path."""


# ---- reading files that may be hostile -------------------------------------------------------------
def _open_regular(path: Path):
    """`path` opened for reading only if it is a regular file: a symlink is not followed, and a FIFO is
    opened non-blocking and refused rather than waited on forever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        if err.errno == errno.ENOENT:
            raise _Damaged(f"{path.name} missing") from None
        if err.errno == errno.ELOOP:
            raise _Damaged(f"{path.name} is a symbolic link") from None
        raise _Damaged(f"{path.name} unreadable ({err.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _Damaged(f"{path.name} is not a regular file")
    return os.fdopen(fd, "rb")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with _open_regular(path) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_small(path: Path) -> bytes:
    with _open_regular(path) as f:
        data = f.read(_SMALL + 1)
    if len(data) > _SMALL:
        raise _Damaged(f"{path.name} is larger than {_SMALL >> 20} MiB")
    return data


def _read_checked(path: Path, manifest: dict) -> bytes:
    """A small listed file, checksummed from the very bytes that are then parsed."""
    data = _read_small(path)
    if hashlib.sha256(data).hexdigest() != manifest[path.name]:
        raise _Damaged(f"{path.name} does not match its checksum")
    return data


def _one_line(err: BaseException) -> str:
    text = str(err)
    if "WeightsUnpickler error: " in text:  # torch.load(weights_only=True): the one informative sentence
        text = text.split("WeightsUnpickler error: ", 1)[1].split(". ", 1)[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else type(err).__name__
    if len(line) > 160 and ". " in line[20:]:  # torch's long messages: the first sentence says it
        line = line[:line.index(". ", 20)]
    return line[:200]


# ---- the manifest and the checks behind verify ------------------------------------------------------
def _manifest(path: Path) -> tuple[str, dict[str, str]]:
    """(format, {file: SHA-256}) from `path`/manifest.json, checked for shape: every value a SHA-256 and
    the files exactly those of its format, so nothing outside that list is ever opened."""
    try:
        raw = json.loads(_read_small(path / "manifest.json"))
    except ValueError:
        raise _Damaged("manifest.json is not valid JSON") from None
    if not isinstance(raw, dict):
        raise _Damaged(f"manifest.json holds {json.dumps(raw)[:40]}, not an object of checksums")
    files = {name: sha for name, sha in raw.items() if name != "format"}
    for name, sha in files.items():
        if not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
            raise _Damaged(f"manifest.json: the checksum of {name!r} is not a SHA-256")
    # before "format" existed: only what the manifest itself lists decides
    fmt = raw.get("format", "dcp" if DCP_METADATA in files else "safetensors" if "model.safetensors" in files else None)
    if fmt == "safetensors":
        required, allowed = set(FILES), set(FILES)
    elif fmt == "dcp":
        required, allowed = set(DCP_FILES), set(DCP_FILES) | {name for name in files if _SHARD.fullmatch(name)}
    else:
        raise _Damaged(f"manifest.json names no known format ({fmt!r})")
    if missing := sorted(required - set(files)):
        raise _Damaged(f"manifest.json does not list {missing[0]}")
    if unexpected := sorted(set(files) - allowed):
        raise _Damaged(f"manifest.json lists {unexpected[0]!r}, which no {fmt} checkpoint holds")
    if fmt == "dcp" and not any(_SHARD.fullmatch(name) for name in files):
        raise _Damaged("manifest.json lists no .distcp shard")
    return fmt, files


def _inspect(path: Path) -> tuple[str, dict[str, str]]:
    """(format, manifest) once everything a load reads is checked; `_Damaged` at the first problem."""
    if path.is_symlink():
        raise _Damaged(f"is a symbolic link to {os.readlink(path)}, refused")
    if not path.is_dir():
        raise _Damaged("is not a directory")
    fmt, manifest = _manifest(path)
    for name, sha in manifest.items():  # every checksum before any parsing
        if _sha256(path / name) != sha:
            raise _Damaged(f"{name} does not match its checksum")
    _meta(path, manifest)
    try:  # mmap: the archive and its pickle are parsed, the tensors are not read
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        raise _Damaged(f"state.pt cannot be read ({_one_line(err)})") from None
    if not isinstance(state, dict):
        raise _Damaged(f"state.pt holds {type(state).__name__}, not a dict")
    if fmt == "safetensors":
        try:  # validates the header: dtypes, shapes, and offsets that cover the file exactly
            with safe_open(str(path / "model.safetensors"), framework="pt") as f:
                f.keys()
        except SafetensorError as err:
            raise _Damaged(f"model.safetensors cannot be read ({_one_line(err)})") from None
    else:
        try:  # the metadata's objects are DCP's classes, but their fields came from the file
            _check_shards(path, manifest, _dcp_metadata(path, manifest))
        except (AttributeError, TypeError, ValueError, OverflowError) as err:
            raise _Damaged(f".metadata is malformed ({_one_line(err)})") from None
    return fmt, manifest


def _meta(path: Path, manifest: dict) -> dict:
    try:
        meta = json.loads(_read_checked(path / "meta.json", manifest))
    except ValueError:
        raise _Damaged("meta.json is not valid JSON") from None
    if not (isinstance(meta, dict) and type(meta.get("step")) is int):
        raise _Damaged("meta.json is not an object with an integer step")
    return meta


# DCP's .metadata is a pickle. These are the globals a genuine one names (torch 2.x); the dtypes are
# allowed separately. A pickle naming anything else (builtins.open, os.system, ...) is refused before
# that object is even looked up, let alone called.
_DCP_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup among torch's layouts by name
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "WindowsPath")),
}


class _DcpMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")


def _dcp_metadata(path: Path, manifest: dict):
    from torch.distributed.checkpoint.metadata import Metadata

    data = _read_checked(path / DCP_METADATA, manifest)
    try:
        metadata = _DcpMetadataUnpickler(io.BytesIO(data)).load()
    except Exception as err:
        raise _Damaged(f".metadata cannot be read ({_one_line(err)})") from None
    if not (isinstance(metadata, Metadata) and isinstance(metadata.storage_data, dict)):
        raise _Damaged(".metadata is not DCP metadata")
    return metadata


def _check_shards(path: Path, manifest: dict, metadata) -> None:
    """Every item the metadata points at lies inside a shard the manifest lists, and every non-tensor item
    (DCP pickles those: optimiser hyper-parameters, a few bytes each) parses weights-only."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    sizes = {name: (path / name).stat().st_size for name in manifest if _SHARD.fullmatch(name)}
    for index, info in metadata.storage_data.items():
        if not isinstance(info, _StorageInfo) or info.relative_path not in sizes:
            raise _Damaged(f".metadata points at {getattr(info, 'relative_path', info)!r}, not a listed shard")
        if info.transform_descriptors:
            raise _Damaged(".metadata asks for DCP storage transforms, which keel never writes")
        if not (type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0
                and info.offset + info.length <= sizes[info.relative_path]):
            raise _Damaged(f"{info.relative_path} is shorter than its .metadata says")
        if isinstance(metadata.state_dict_metadata.get(getattr(index, "fqn", None)), BytesStorageMetadata):
            with _open_regular(path / info.relative_path) as f:
                f.seek(info.offset)
                value = io.BytesIO(f.read(info.length))
            try:
                torch.load(value, weights_only=True)
            except Exception as err:
                raise _Damaged(f"{info.relative_path}: {index.fqn} cannot be read ({_one_line(err)})") from None


def _verified(path: Path) -> tuple[str, dict[str, str]]:
    try:
        return _inspect(path)
    except _Damaged as err:
        raise CheckpointError(f"checkpoint {path}: {err}") from None


# ---- finding checkpoints ---------------------------------------------------------------------------
def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The `step_N` entries of checkpoints/, oldest first: directories, and symlinks so that `latest_valid`
    reports them (temporary ones excluded). Nothing is checked here; see `verify`."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP.fullmatch(p.name) and (p.is_symlink() or p.is_dir())]
    return sorted(found, key=lambda p: int(p.name[len("step_"):]))


def is_sharded(path: Path) -> bool:
    """Whether the manifest of `path` says DCP (its checksums unchecked: `load` and `load_sharded` check)."""
    try:
        return _manifest(Path(path))[0] == "dcp"
    except _Damaged:
        return False


def verify(path: Path) -> str | None:
    """None if the checkpoint at `path` is intact and parses, else what is wrong with it (one line)."""
    try:
        _inspect(Path(path))
    except _Damaged as err:
        return str(err)
    return None


def latest_valid(run_dir: Path, warn=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """The newest checkpoint `verify` passes; newer ones are reported and skipped, never deleted."""
    for path in reversed(list_checkpoints(run_dir)):
        problem = verify(path)
        if problem is None:
            return path
        warn(f"keel: checkpoint {path} is damaged ({problem}); trying an older one")
    raise CheckpointError(f"{checkpoint_dir(run_dir)}: no intact checkpoint to resume from")


# ---- loading ---------------------------------------------------------------------------------------
def load(path: Path, model: nn.Module) -> tuple[dict, dict]:
    """Load weights into `model`; return (state, meta). The caller restores the state it needs.
    Either format; a CheckpointError names the path."""
    path = Path(path)
    fmt, manifest = _verified(path)
    if fmt == "dcp":
        return _load_dcp(path, manifest, model, None)
    try:
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    except RuntimeError as err:  # shape mismatch
        raise CheckpointError(f"checkpoint {path}: weights do not fit the model ({_one_line(err)})") from None
    except SafetensorError as err:  # replaced since verify
        raise CheckpointError(f"checkpoint {path}: model.safetensors cannot be read ({_one_line(err)})") from None
    if missing or unexpected:
        names = ", ".join(sorted(missing or unexpected)[:3])
        raise CheckpointError(f"checkpoint {path}: weights do not fit the model ({names})")
    return _state_and_meta(path, manifest)


def load_sharded(path: Path, model: nn.Module, optimizer=None) -> tuple[dict, dict]:
    """Load a DCP checkpoint into `model` (and `optimizer`), whatever the number of ranks now: sharded
    (FSDP2) under torchrun, or a plain model in a single process. Returns (state, meta) as `load` does;
    with a process group, every rank must call it (and every rank verifies what it reads)."""
    path = Path(path)
    fmt, manifest = _verified(path)
    if fmt != "dcp":
        raise CheckpointError(f"checkpoint {path}: not a sharded checkpoint (its manifest says {fmt})")
    return _load_dcp(path, manifest, model, optimizer)


def _state_and_meta(path: Path, manifest: dict) -> tuple[dict, dict]:
    try:
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
        return state, _meta(path, manifest)
    except Exception as err:  # replaced since verify
        raise CheckpointError(f"checkpoint {path}: {_one_line(err)}") from None


def _load_dcp(path: Path, manifest: dict, model: nn.Module, optimizer) -> tuple[dict, dict]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    class Reader(dcp.FileSystemReader):
        """DCP's reader, but the metadata is read checksummed and with the restricted unpickler."""

        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:  # per-rank metadata files: keel writes none, manifests list none
                raise _Damaged("per-rank DCP metadata requested")
            metadata = _dcp_metadata(path, manifest)
            metadata.storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()  # older DCP: none
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(dcp.DefaultLoadPlanner):
        """DCP's planner, but the non-tensor values it stores pickled (optimiser hyper-parameters), which
        it would load with weights_only=False, are parsed weights-only first; DCP then gets our own
        re-serialised copy."""

        def load_bytes(self, read_item, value):
            safe = io.BytesIO()
            torch.save(torch.load(value, weights_only=True), safe)
            safe.seek(0)
            super().load_bytes(read_item, safe)

    def read(state_dict):
        dcp.load(state_dict, storage_reader=Reader(path), planner=Planner())

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: intended
        try:
            if optimizer is None:
                model_sd = get_model_state_dict(model)
                read({"model": model_sd})
                set_model_state_dict(model, model_sd)
            else:
                model_sd, optim_sd = get_state_dict(model, optimizer)
                both = {"model": model_sd, "optimizer": optim_sd}
                read(both)
                set_state_dict(model, optimizer, model_state_dict=both["model"], optim_state_dict=both["optimizer"])
        except BaseException as err:  # DCP wraps what went wrong on each rank in a CheckpointException
            inner = (_rank_failures(err) or [err])[0]
            if isinstance(inner, _Damaged):
                raise CheckpointError(f"checkpoint {path}: {inner}") from None
            if isinstance(inner, (RuntimeError, ValueError, KeyError)):  # missing keys, shapes that do not fit
                raise CheckpointError(f"checkpoint {path}: weights do not fit the model ({_one_line(inner)})") from None
            if inner is err:
                raise
            raise CheckpointError(f"checkpoint {path}: cannot be read ({_one_line(inner)})") from None
    return _state_and_meta(path, manifest)


def export_safetensors(path: Path, model: nn.Module, out: Path) -> Path:
    """Write checkpoint `path` (sharded or not) as one safetensors file at `out`, via `model` (a plain,
    unsharded model of the run's config, which it loads)."""
    load(Path(path), model)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, str(out))
    return out


# ---- writing ---------------------------------------------------------------------------------------
def save(run_dir: Path, step: int, model: nn.Module, state: dict, meta: dict, keep: int) -> Path:
    """Write checkpoint `step` atomically and keep only the newest `keep` checkpoints."""
    root, tmp, final = _paths(run_dir, step, f"-{os.getpid()}")
    clean_stale_tmp(run_dir)
    try:
        _fresh(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(state, tmp / "state.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1))
        _commit(tmp, final, "safetensors", FILES)
    except BaseException as err:  # whatever it was, the half-written directory goes
        shutil.rmtree(tmp, ignore_errors=True)
        if (reason := _write_failure(err)) is None:
            raise
        raise CheckpointError(f"cannot write checkpoint {final}: {reason}") from None
    _prune(run_dir, keep)
    return final


def save_sharded(run_dir: Path, step: int, model: nn.Module, optimizer, state: dict, meta: dict, keep: int,
                 main: bool) -> Path:
    """Collective: every rank calls this. Model and optimiser go through DCP (each rank writes its own
    shards); rank 0 (`main`) adds `state` and `meta`, the manifest, and renames the directory into place.
    The temporary name carries no pid, so that every rank writes into the same one. A failure on any rank
    raises on every rank (a CheckpointError when it was the disk), so none is left waiting for the others."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root, tmp, final = _paths(run_dir, step, "-sharded")
    failed = None
    if main:
        clean_stale_tmp(run_dir)
        failed = _attempt(lambda: _fresh(tmp))
    _raise_on_every_rank(failed, final)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # DCP gathers every rank's write result, so when one rank fails, it raises on all of them
    failed = _attempt(lambda: dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp)))

    def finish():
        torch.save(state, tmp / "state.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1))
        _commit(tmp, final, "dcp", sorted(p.name for p in tmp.iterdir()))

    if main and failed is None:
        failed = _attempt(finish)
    if main and failed is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    _raise_on_every_rank(failed, final)
    if main:
        _prune(run_dir, keep)
    return final


def _attempt(work) -> BaseException | None:
    try:
        work()
    except BaseException as err:
        return err
    return None


def _raise_on_every_rank(failed: BaseException | None, final: Path) -> None:
    """Share each rank's failure (also a barrier). A rank re-raises its own non-I/O failure as is, with its
    traceback; every other failure becomes one CheckpointError."""
    import torch.distributed as dist

    reasons = [None] * dist.get_world_size()
    mine = None if failed is None else _write_failure(failed) or f"{type(failed).__name__} on rank {dist.get_rank()}"
    dist.all_gather_object(reasons, mine)
    if failed is not None and _write_failure(failed) is None:
        raise failed
    if reason := next((r for r in reasons if r), None):
        raise CheckpointError(f"cannot write checkpoint {final}: {reason}")


def _write_failure(err: BaseException) -> str | None:
    """Why writing failed, in one line, when the disk or filesystem failed (full, read-only, quota, I/O);
    None for anything else, which is a bug and keeps its traceback. The libraries report I/O failure in
    their own ways: torch.save as a RuntimeError from its zip writer, safetensors as a SafetensorError,
    DCP as a CheckpointException carrying each rank's exception."""
    if isinstance(err, OSError):
        return err.strerror or _one_line(err)
    if isinstance(err, SafetensorError) and ("I/O error" in str(err) or "IoError" in str(err)):
        return _one_line(err)
    if isinstance(err, RuntimeError) and ("inline_container" in str(err) or "PytorchStreamWriter" in str(err)):
        return f"torch.save failed: {_one_line(err)}"
    return next(filter(None, map(_write_failure, _rank_failures(err))), None)


def _rank_failures(err: BaseException) -> list[BaseException]:
    """The exceptions of the ranks that failed, inside DCP's CheckpointException; [] for any other."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict):
        return []
    inner = [failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()]
    return [e for e in inner if isinstance(e, BaseException)]


def _paths(run_dir: Path, step: int, suffix: str) -> tuple[Path, Path, Path]:
    root = checkpoint_dir(run_dir)
    return root, root / f".tmp-step_{step:08d}{suffix}", root / f"step_{step:08d}"


def _fresh(tmp: Path) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()


def _commit(tmp: Path, final: Path, fmt: str, names) -> None:
    """Checksum `names` in `tmp` into its manifest, fsync everything, then rename `tmp` to `final`."""
    manifest = {"format": fmt, **{name: _sha256(tmp / name) for name in names}}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for name in (*names, "manifest.json", "."):
        _fsync(tmp / name)
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    if os.path.lexists(final):  # the same step written again (e.g. after a rollback): set the old one aside
        os.rename(final, old)  # first, so a crash between the renames still leaves a complete copy on disk
    try:
        os.rename(tmp, final)
    except BaseException:
        if os.path.lexists(old) and not os.path.lexists(final):
            os.rename(old, final)
        raise
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(run_dir: Path, keep: int) -> None:
    # only directories this code wrote count, and only they are removed: a symlink is left alone
    for old in [p for p in list_checkpoints(run_dir) if not p.is_symlink()][:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def clean_stale_tmp(run_dir: Path) -> list[Path]:
    """Remove what killed writers left in checkpoints/, and return it: `.tmp-step_*` directories (a
    checkpoint never completed) and `.old-step_*` ones (the previous copy of a step being rewritten). An
    `.old-` copy whose step never landed is the only copy, so it is put back instead, if it verifies.
    Call it on the main process when a run starts; every save calls it too. Symlinks are unlinked, never
    followed; errors are ignored (the next call tries again)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    removed = []
    for entry in sorted(root.iterdir()):
        match = _LEFTOVER.fullmatch(entry.name)
        if not match:
            continue
        final = root / match.group(2)
        try:
            if match.group(1) == "old" and not os.path.lexists(final) and verify(entry) is None:
                os.rename(entry, final)
                continue
            if entry.is_symlink() or not entry.is_dir():
                entry.unlink()
            else:
                shutil.rmtree(entry)
            removed.append(entry)
        except OSError:
            pass
    return removed
