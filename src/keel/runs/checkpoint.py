"""Checkpoints: atomic, checksummed, and never a way to run code; the layout, the sharded format and how writes
fail: docs/internals.md#keelrunscheckpoint."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
from torch import nn

from keel.errors import CheckpointError
from keel.runs.paths import checkpoint_dir, list_checkpoints
from keel.runs.untrusted import (
    Damaged,
    check_optimizer,
    check_training_state,
    dcp_metadata,
    inspect_checkpoint,
    one_line,
    read_manifest,
    read_meta,
    sha256,
)

_LEFTOVER = re.compile(r"\.(tmp|old)-(step_\d+)(-.*)?")  # what save and _commit write under temporary names


# ---- finding checkpoints: keel.runs.paths (no torch) -------------------------------------
def is_sharded(path: Path) -> bool:
    """Whether the manifest of `path` says DCP (its checksums unchecked: `load` and `load_sharded` check)."""
    try:
        return read_manifest(Path(path))[0] == "dcp"
    except Damaged:
        return False


def verify(path: Path) -> str | None:
    """None if the checkpoint at `path` is intact and parses, else what is wrong with it (one line)."""
    try:
        inspect_checkpoint(Path(path))
    except Damaged as err:
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
        raise CheckpointError(f"checkpoint {path}: weights do not fit the model ({one_line(err)})") from None
    except (SafetensorError, OSError) as err:  # replaced or removed (a live run pruning it) since verify
        raise CheckpointError(f"checkpoint {path}: model.safetensors cannot be read ({one_line(err)})") from None
    if missing or unexpected:
        names = ", ".join(sorted(missing or unexpected)[:3])
        raise CheckpointError(f"checkpoint {path}: weights do not fit the model ({names})")
    return _state_and_meta(path, manifest, model)


def load_sharded(path: Path, model: nn.Module, optimizer=None) -> tuple[dict, dict]:
    """Load a DCP checkpoint into `model` (and `optimizer`), whatever the number of ranks now: sharded
    (FSDP2) under torchrun, or a plain model in a single process. Returns (state, meta) as `load` does;
    with a process group, every rank must call it (and every rank verifies what it reads)."""
    path = Path(path)
    fmt, manifest = _verified(path)
    if fmt != "dcp":
        raise CheckpointError(f"checkpoint {path}: not a sharded checkpoint (its manifest says {fmt})")
    return _load_dcp(path, manifest, model, optimizer)


def _verified(path: Path) -> tuple[str, dict[str, str]]:
    try:
        return inspect_checkpoint(path)
    except Damaged as err:
        raise CheckpointError(f"checkpoint {path}: {err}") from None


def _state_and_meta(path: Path, manifest: dict, model: nn.Module) -> tuple[dict, dict]:
    """state.pt and meta.json, their content checked against `model` (the checksums also match what a buggy
    or hostile writer re-checksummed, so types and shapes are checked too), and the weights finite."""
    try:
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
        meta = read_meta(path, manifest)
        check_training_state(state, meta, model)
    except Exception as err:  # Damaged, or replaced since verify
        raise CheckpointError(f"checkpoint {path}: {one_line(err)}") from None
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"checkpoint {path} (step {meta['step']}): weight {name} holds NaN or inf")
    return state, meta


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
                raise Damaged("per-rank DCP metadata requested")
            metadata = dcp_metadata(path, manifest)
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
                # what DCP cannot see: hyper-parameters of the wrong type, flags keel never sets, state missing
                check_optimizer(optimizer.state_dict(), model, source="sharded optimiser state")
        except BaseException as err:  # DCP wraps what went wrong on each rank in a CheckpointException
            inner = (_rank_failures(err) or [err])[0]
            if isinstance(inner, Damaged):
                raise CheckpointError(f"checkpoint {path}: {inner}") from None
            if isinstance(inner, (RuntimeError, ValueError, KeyError)):  # missing keys, shapes that do not fit
                raise CheckpointError(f"checkpoint {path}: weights do not fit the model ({one_line(inner)})") from None
            if inner is err:
                raise
            raise CheckpointError(f"checkpoint {path}: cannot be read ({one_line(inner)})") from None
    return _state_and_meta(path, manifest, model)


def export_safetensors(path: Path, model: nn.Module, out: Path) -> Path:
    """Write checkpoint `path` (sharded or not) as one safetensors file at `out`, via `model` (a plain,
    unsharded model of the run's config, which it loads)."""
    load(Path(path), model)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_symlink():
        raise CheckpointError(f"{out}: is a symbolic link; refused to write through it")
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
        _commit(tmp, final, "safetensors", step, state, meta)
    except BaseException as err:  # whatever it was, the half-written directory goes
        shutil.rmtree(tmp, ignore_errors=True)
        if (reason := _write_failure(err)) is None:
            raise
        raise CheckpointError(f"cannot write checkpoint {final}: {reason}{_full_disk(root, model)}") from None
    _prune(run_dir, keep)
    return final


def _full_disk(root: Path, model: nn.Module) -> str:
    """A note when the disk is too full for a checkpoint: torch.save's zip writer reports a full disk only as
    "enforce fail at inline_container.cc ... unexpected pos", which does not say so."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return ""
    need = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights and AdamW's two moments
    if free >= need:
        return ""
    return (f" (the disk is full: {free / 2**20:.1f} MiB free in {root}, a checkpoint needs about "
            f"{need / 2**20:.1f} MiB)")


def save_sharded(run_dir: Path, step: int, model: nn.Module, optimizer, state: dict, meta: dict, keep: int,
                 main: bool) -> Path:
    """Collective: every rank calls this, and a failure on any rank raises on every rank
    (docs/internals.md#keelrunscheckpointsave_sharded)."""
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
    if main and failed is None:
        failed = _attempt(lambda: _commit(tmp, final, "dcp", step, state, meta))
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
    """Why writing failed, in one line, when the disk or filesystem failed; None for anything else, which is a bug and
    keeps its traceback (docs/internals.md#keelrunscheckpoint_write_failure)."""
    if isinstance(err, OSError):
        return err.strerror or one_line(err)
    if isinstance(err, SafetensorError) and ("I/O error" in str(err) or "IoError" in str(err)):
        return one_line(err)
    if isinstance(err, RuntimeError) and ("inline_container" in str(err) or "PytorchStreamWriter" in str(err)):
        return f"torch.save failed: {one_line(err)}"
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


def _commit(tmp: Path, final: Path, fmt: str, step: int, state: dict, meta: dict) -> None:
    """Add state.pt and meta.json to the weights in `tmp`, checksum every file into its manifest, fsync everything,
    then rename `tmp` to `final`."""
    torch.save(state, tmp / "state.pt")
    (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1))
    names = sorted(p.name for p in tmp.iterdir())
    manifest = {"format": fmt, **{name: sha256(tmp / name) for name in names}}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for name in (*names, "manifest.json", "."):
        _fsync(tmp / name)
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    if os.path.lexists(final) and (final.is_symlink() or not final.is_dir()):
        os.unlink(final)  # a planted link, FIFO or file holds no checkpoint; rmtree would open (and wait on) it
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
    # only directories this code wrote count, and only they are removed: a symlink or FIFO is left alone
    for old in [p for p in list_checkpoints(run_dir) if not p.is_symlink() and p.is_dir()][:-keep]:
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
