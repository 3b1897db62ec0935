"""The checks on checkpoint files, which may be damaged or hostile: nothing here runs code. What a loader trusts and
what `verify` promises: docs/internals.md#keelrunsuntrusted."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from keel import safe_io
from keel.data.shards import is_count
from keel.errors import DataError
from keel.safe_io import loads_json

FILES = ("model.safetensors", "state.pt", "meta.json")  # format "safetensors": exactly these
DCP_METADATA = ".metadata"
DCP_FILES = (DCP_METADATA, "state.pt", "meta.json")  # format "dcp": these and one or more shards
SHARD = re.compile(r"__\d+_\d+\.distcp")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SMALL = 64 << 20  # manifest.json, meta.json and .metadata are read whole; anything larger is not ours


class Damaged(Exception):
    """What is wrong with a checkpoint, in a few words: `verify` returns it, loaders raise it with the path."""


# ---- reading files that may be hostile -------------------------------------------------------------
def open_regular(path: Path):
    """`path` opened for reading by keel.safe_io.open_regular (no link, no FIFO waited on), a refusal `Damaged`."""
    try:
        return safe_io.open_regular(path)
    except DataError:
        raise Damaged(f"{path.name} is not a regular file") from None
    except OSError as err:
        if err.errno == errno.ENOENT:
            raise Damaged(f"{path.name} missing") from None
        if err.errno == errno.ELOOP:
            raise Damaged(f"{path.name} is a symbolic link") from None
        raise Damaged(f"{path.name} unreadable ({err.strerror})") from None


def sha256(path: Path) -> str:
    with open_regular(path) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _read_small(path: Path) -> bytes:
    with open_regular(path) as f:
        data = f.read(_SMALL + 1)
    if len(data) > _SMALL:
        raise Damaged(f"{path.name} is larger than {_SMALL >> 20} MiB")
    return data


def read_checked(path: Path, manifest: dict) -> bytes:
    """A small listed file, checksummed from the very bytes that are then parsed."""
    data = _read_small(path)
    if hashlib.sha256(data).hexdigest() != manifest[path.name]:
        raise Damaged(f"{path.name} does not match its checksum")
    return data


def one_line(err: BaseException) -> str:
    text = str(err)
    if "WeightsUnpickler error: " in text:  # torch.load(weights_only=True): the one informative sentence
        text = text.split("WeightsUnpickler error: ", 1)[1].split(". ", 1)[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else type(err).__name__
    if len(line) > 160 and ". " in line[20:]:  # torch's long messages: the first sentence says it
        line = line[:line.index(". ", 20)]
    return line[:200]


# ---- the manifest and the checks behind verify ------------------------------------------------------
def read_manifest(path: Path) -> tuple[str, dict[str, str]]:
    """(format, {file: SHA-256}) from `path`/manifest.json, checked for shape: every value a SHA-256 and
    the files exactly those of its format, so nothing outside that list is ever opened."""
    try:
        raw = loads_json(_read_small(path / "manifest.json"))
    except ValueError:
        raise Damaged("manifest.json is not valid JSON") from None
    if not isinstance(raw, dict):
        raise Damaged(f"manifest.json holds {json.dumps(raw)[:40]}, not an object of checksums")
    files = {name: sha for name, sha in raw.items() if name != "format"}
    for name, sha in files.items():
        if not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
            raise Damaged(f"manifest.json: the checksum of {name!r} is not a SHA-256")
    # before "format" existed: only what the manifest itself lists decides
    fmt = raw.get("format", "dcp" if DCP_METADATA in files else "safetensors" if "model.safetensors" in files else None)
    if fmt == "safetensors":
        required, allowed = set(FILES), set(FILES)
    elif fmt == "dcp":
        required, allowed = set(DCP_FILES), set(DCP_FILES) | {name for name in files if SHARD.fullmatch(name)}
    else:
        raise Damaged(f"manifest.json names no known format ({fmt!r})")
    if missing := sorted(required - set(files)):
        raise Damaged(f"manifest.json does not list {missing[0]}")
    if unexpected := sorted(set(files) - allowed):
        raise Damaged(f"manifest.json lists {unexpected[0]!r}, which no {fmt} checkpoint holds")
    if fmt == "dcp" and not any(SHARD.fullmatch(name) for name in files):
        raise Damaged("manifest.json lists no .distcp shard")
    return fmt, files


def inspect_checkpoint(path: Path) -> tuple[str, dict[str, str]]:
    """(format, manifest) once everything a load reads is checked; `Damaged` at the first problem."""
    if path.is_symlink():
        raise Damaged(f"is a symbolic link to {os.readlink(path)}, refused")
    if not path.is_dir():
        raise Damaged("is not a directory")
    fmt, manifest = read_manifest(path)
    for name, sha in manifest.items():  # every checksum before any parsing
        if sha256(path / name) != sha:
            raise Damaged(f"{name} does not match its checksum")
    read_meta(path, manifest)
    try:  # mmap: the archive and its pickle are parsed, the tensors are not read
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        raise Damaged(f"state.pt cannot be read ({one_line(err)})") from None
    if not isinstance(state, dict):
        raise Damaged(f"state.pt holds {type(state).__name__}, not a dict")
    if fmt == "safetensors":
        try:  # validates the header: dtypes, shapes, and offsets that cover the file exactly
            with safe_open(str(path / "model.safetensors"), framework="pt") as f:
                f.keys()
        except SafetensorError as err:
            raise Damaged(f"model.safetensors cannot be read ({one_line(err)})") from None
        except OSError as err:  # removed since its checksum was read: a live run pruning it
            raise Damaged(f"model.safetensors cannot be read ({err.strerror or err})") from None
    else:
        try:  # the metadata's objects are DCP's classes, but their fields came from the file
            check_shards(path, manifest, dcp_metadata(path, manifest))
        except (AttributeError, TypeError, ValueError, OverflowError) as err:
            raise Damaged(f".metadata is malformed ({one_line(err)})") from None
        except OSError as err:
            raise Damaged(f"a shard cannot be read ({err.strerror or err})") from None
    return fmt, manifest


def read_meta(path: Path, manifest: dict) -> dict:
    try:
        meta = loads_json(read_checked(path / "meta.json", manifest))
    except ValueError:
        raise Damaged("meta.json is not valid JSON") from None
    if not (isinstance(meta, dict) and type(meta.get("step")) is int and meta["step"] >= 0):
        raise Damaged("meta.json is not an object with an integer step >= 0")
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


def dcp_metadata(path: Path, manifest: dict):
    from torch.distributed.checkpoint.metadata import Metadata

    data = read_checked(path / DCP_METADATA, manifest)
    try:
        metadata = _DcpMetadataUnpickler(io.BytesIO(data)).load()
    except Exception as err:
        raise Damaged(f".metadata cannot be read ({one_line(err)})") from None
    if not (isinstance(metadata, Metadata) and isinstance(metadata.storage_data, dict)):
        raise Damaged(".metadata is not DCP metadata")
    return metadata


def check_shards(path: Path, manifest: dict, metadata) -> None:
    """Every item the metadata points at lies inside a shard the manifest lists, and every non-tensor item
    (DCP pickles those: optimiser hyper-parameters, a few bytes each) parses weights-only."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    sizes = {name: (path / name).stat().st_size for name in manifest if SHARD.fullmatch(name)}
    for index, info in metadata.storage_data.items():
        if not isinstance(info, _StorageInfo) or info.relative_path not in sizes:
            raise Damaged(f".metadata points at {getattr(info, 'relative_path', info)!r}, not a listed shard")
        if info.transform_descriptors:
            raise Damaged(".metadata asks for DCP storage transforms, which keel never writes")
        if not (type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0
                and info.offset + info.length <= sizes[info.relative_path]):
            raise Damaged(f"{info.relative_path} is shorter than its .metadata says")
        if isinstance(metadata.state_dict_metadata.get(getattr(index, "fqn", None)), BytesStorageMetadata):
            with open_regular(path / info.relative_path) as f:
                f.seek(info.offset)
                value = io.BytesIO(f.read(info.length))
            try:
                torch.load(value, weights_only=True)
            except Exception as err:
                raise Damaged(f"{info.relative_path}: {index.fqn} cannot be read ({one_line(err)})") from None


# ---- content that passed its checksums ----------------------------------------------------------------
# A checksum proves only that the bytes are what the writer listed; a buggy or hostile writer lists wrong
# content. Each field a resume restores is checked here for type (and the optimiser's tensors for shape),
# so a bad one is refused at load in one line, never as a TypeError at restore or a RuntimeError at the
# first step. Fields are checked when present: checkpoints without training state (keel import-hf) load.
_CPU_RNG_BYTES = torch.Generator().get_state().numel()  # 5056: the Mersenne Twister's state, seed and offset
_CUDA_RNG_BYTES = 16  # Philox: seed and offset


def _rng(v, size: int = _CPU_RNG_BYTES) -> bool:
    """A generator's state as `get_state` returns it; one of another length is a RuntimeError at set_state."""
    return isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1 and v.numel() == size


_META = {
    "draws": (is_count, "an integer >= 0"),
    "rollbacks": (is_count, "an integer >= 0"),
    "global_batch": (is_count, "an integer >= 0"),
    "world_size": (is_count, "an integer >= 0"),
    "lr_scale": (lambda v: type(v) in (int, float) and 0 < v < float("inf"), "a positive number"),
    "skip_draws": (lambda v: isinstance(v, list) and all(map(is_count, v)), "a list of integers >= 0"),
    "guard": (lambda v: isinstance(v, dict) and isinstance(v.get("history", []), list)
              and all(type(x) in (int, float) for x in v.get("history", [])), "an object with a list of numbers"),
}


def check_training_state(state: dict, meta: dict, model) -> None:
    """Raise `Damaged` naming the first field of meta.json or state.pt of the wrong type or shape."""
    for key, (ok, allowed) in _META.items():
        if key in meta and not ok(meta[key]):
            raise Damaged(f"meta.json: {key} is {json.dumps(meta[key])[:40]}, not {allowed}")
    if not isinstance(state, dict):
        raise Damaged(f"state.pt holds {type(state).__name__}, not a dict")
    for key, size in (("torch_rng", _CPU_RNG_BYTES), ("cuda_rng", _CUDA_RNG_BYTES)):
        if key in state and not _rng(state[key], size):
            raise Damaged(f"state.pt: {key} is not a random-generator state (a 1-D uint8 tensor of {size} bytes)")
    if "sampler" in state:
        sampler = state["sampler"]
        if not (isinstance(sampler, dict) and _rng(sampler.get("generator")) and is_count(sampler.get("step"))):
            raise Damaged(f"state.pt: sampler is not {{generator: uint8 tensor of {_CPU_RNG_BYTES} bytes, "
                          "step: integer >= 0}")
    if "optimizer" in state:
        check_optimizer(state["optimizer"], model)


def check_optimizer(opt, model, source: str = "state.pt") -> None:
    """The AdamW state keel.train.optim writes for `model` (from `source`: state.pt, or the sharded optimiser
    state of a DCP checkpoint once loaded): one entry per trainable parameter, each tensor the parameter's
    shape. Its groups are [decay, no_decay]: the parameters in model order, or, with norms
    and embeddings undecayed, the weight matrices first."""
    from torch import nn

    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    if not (isinstance(groups, list) and isinstance(opt.get("state"), dict)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)):
        raise Damaged(f"{source}: optimizer is not an optimiser state dict")
    ids = [i for g in groups for i in g["params"]]
    params = [p for p in model.parameters() if p.requires_grad]
    if len(ids) != len(params) or len(set(ids)) != len(ids):
        raise Damaged(f"{source}: optimizer holds {len(ids)} parameters; the model has {len(params)}")
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matrices = [p for p in params if p.dim() >= 2 and id(p) not in embeddings]
    if [len(g["params"]) for g in groups] not in ([len(params)], [len(params), 0]):  # one group: model order
        params = matrices + [p for p in params if not (p.dim() >= 2 and id(p) not in embeddings)]
    # AdamW takes its hyper-parameters and flags from the loaded groups: a string there, or a flag keel never
    # sets (amsgrad wants state keel never wrote), is a TypeError or KeyError only at the first step
    for group in groups:
        for name, n in (("lr", 1), ("eps", 1), ("weight_decay", 1), ("betas", 2)):
            if name in group and not _numbers(group[name] if n > 1 else [group[name]], n):
                raise Damaged(f"{source}: optimizer {name} is {str(group[name])[:40]!r}, not "
                              + ("two finite numbers" if n > 1 else "a finite number"))
        for name in ("amsgrad", "maximize", "capturable", "differentiable", "foreach", "fused"):
            if group.get(name) not in (None, False) and not (name in ("foreach", "fused") and group[name] is True):
                raise Damaged(f"{source}: optimizer {name} is {str(group[name])[:40]!r}, which keel's AdamW never sets")
    shapes = dict(zip(ids, (tuple(p.shape) for p in params)))
    for key, entry in opt["state"].items():
        if key not in shapes or not isinstance(entry, dict):
            raise Damaged(f"{source}: optimizer state names parameter {key!r}, which the model does not have")
        if missing := sorted({"step", "exp_avg", "exp_avg_sq"} - set(entry)):
            raise Damaged(f"{source}: optimizer state of parameter {key} has no {missing[0]}")
        quantised = {name for name in ("exp_avg", "exp_avg_sq") if f"{name}.scale" in entry}
        for name, value in entry.items():
            base, _, part = name.partition(".")
            if base in quantised:  # optim.state=8bit: uint8 codes, their block scales and code book
                _check_8bit(source, key, name, part, value, shapes[key])
                continue
            if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
                raise Damaged(f"{source}: optimizer {name} of parameter {key} is not a floating-point tensor")
            if (name == "step" and value.dim() != 0) or (value.dim() > 0 and tuple(value.shape) != shapes[key]):
                raise Damaged(f"{source}: optimizer {name} of parameter {key} has shape {tuple(value.shape)}, "
                              f"not {() if name == 'step' else shapes[key]}")
        for name in quantised:
            codes, scale = entry[name], entry.get(f"{name}.scale")
            if f"{name}.qmap" not in entry or f"{name}.signed" not in entry or codes.numel() % scale.numel():
                raise Damaged(f"{source}: optimizer {name} of parameter {key} is 8-bit without its code book, "
                              "sign or whole blocks")


def _check_8bit(source: str, key, name: str, part: str, value, shape: tuple) -> None:
    """One piece of an 8-bit moment (keel.train.optim.adamw_8bit's state dict), type and shape."""
    expected = {"": (torch.uint8, shape), "scale": (None, None), "qmap": (None, (256,)), "signed": (None, ())}
    if part not in expected or not isinstance(value, torch.Tensor):
        raise Damaged(f"{source}: optimizer {name} of parameter {key} is not part of an 8-bit moment")
    dtype, want = expected[part]
    ok = value.dtype == dtype if dtype is not None else value.is_floating_point()
    ok = ok and (tuple(value.shape) == want if want is not None else value.dim() == 1)
    if not ok:
        raise Damaged(f"{source}: optimizer {name} of parameter {key} has dtype {value.dtype} and shape "
                      f"{tuple(value.shape)}, not an 8-bit moment's")


def _numbers(value, n: int) -> bool:
    """`value` is a list or tuple of `n` finite numbers (not booleans)."""
    return (isinstance(value, (list, tuple)) and len(value) == n
            and all(type(v) in (int, float) and abs(v) < float("inf") for v in value))


# ---- a run's model config against its checkpoint, before anything is allocated ---------------------------
# config.yaml sizes the model; a hostile or damaged one (model.d_model=65536, model.max_seq_len=10**12) would
# allocate until memory runs out before any weight is compared. So the model is first built on the meta
# device (shapes only), its bytes bounded by `memory`, and its weights' shapes compared with the checkpoint's.
def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight in the checkpoint at `path`: from the safetensors header, or from the DCP
    metadata (a few KiB read; no tensor)."""
    fmt, manifest = read_manifest(path)
    if fmt == "dcp":
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        items = dcp_metadata(path, manifest).state_dict_metadata.items()
        return {k.removeprefix("model."): tuple(v.size) for k, v in items
                if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    # a link or a FIFO is refused; safetensors then reads the file checked, by its descriptor where the system names
    # one, not what the name holds a moment later (a FIFO swapped in would hang it)
    with open_regular(path / "model.safetensors") as file:
        by_descriptor = Path(f"/proc/self/fd/{file.fileno()}")
        return safetensors_shapes(by_descriptor if by_descriptor.exists() else path / "model.safetensors",
                                  "model.safetensors")


def safetensors_shapes(path: Path, name: str | None = None) -> dict[str, tuple[int, ...]]:
    """Name -> shape from the header of the safetensors file at `path` (`name` in messages), which safetensors
    reads and checks."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError) as err:
        raise Damaged(f"{name or path.name} has a malformed header ({one_line(err)})") from None


def check_model_memory(config, shapes: dict, memory: int | None) -> None:
    """Raise `Damaged` naming the model.* field when `TransformerLM(config)` (a ModelConfig) has more blocks
    than a checkpoint's `weight_shapes` hold weights, or its float32 weights and RoPE tables would take more
    than `memory` bytes."""
    from keel.model.counting import count_params

    if config.distinct_blocks > len(shapes):  # before counting, which walks the blocks
        raise Damaged(f"model.n_blocks={config.n_blocks} needs more weights than the checkpoint's {len(shapes)}")
    size = 4 * (count_params(config) + 2 * config.max_seq_len * config.head_dim)
    if memory is not None and size > memory:
        field = "max_seq_len" if 8 * config.max_seq_len * config.head_dim > memory else "d_model"
        raise Damaged(f"model.{field}={getattr(config, field)}: the model needs {size / 2**30:.3g} GiB, more "
                      f"than this machine's {memory / 2**30:.3g} GiB")


def check_model_shapes(config, shapes: dict) -> None:
    """Raise `Damaged` when a weight of `TransformerLM(config)`, built on the meta device (nothing allocated;
    after `check_model_memory`, which bounds its blocks), has another shape than in `shapes`."""
    from keel.model import TransformerLM

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in TransformerLM(config).state_dict().items()}
    for name, shape in shapes.items():
        if name in expected and expected[name] != shape:
            raise Damaged(f"config.yaml's model (d_model={config.d_model}, vocab_size={config.vocab_size}) gives "
                          f"{name} the shape {expected[name]}, the checkpoint {shape}")


def check_model_fits(config_path: Path, model_config, checkpoint: Path, memory: int | None) -> None:
    """The checks before `TransformerLM(model_config)` is built for `checkpoint`, by eval, generate, export-hf
    (RunDir.build_model) and a resume (keel.runs.resume): the checkpoint's weight shapes read (CheckpointError),
    the model's size bounded by `memory` (ConfigError naming `config_path` and the model.* field), and its
    weights' shapes compared with the checkpoint's (CheckpointError). Nothing is allocated."""
    from keel.errors import CheckpointError, ConfigError

    try:
        shapes = weight_shapes(checkpoint)
    except Damaged as err:
        raise CheckpointError(f"checkpoint {checkpoint}: {err}") from None
    try:
        check_model_memory(model_config, shapes, memory)
    except Damaged as err:
        raise ConfigError(f"{config_path}: {err}") from None
    try:
        check_model_shapes(model_config, shapes)
    except Damaged as err:
        raise CheckpointError(f"checkpoint {checkpoint}: weights do not fit the model ({err})") from None
