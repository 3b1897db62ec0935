"""`keel import-hf`: a Llama-architecture `transformers` checkpoint -> a `pre_ln` Keel run directory, the directory
read as untrusted (docs/internals.md#keelhfimport_hf)."""

from __future__ import annotations

import math
import os
import stat
from dataclasses import replace
from pathlib import Path, PurePosixPath

from keel import safe_io
from keel.errors import DataError, ExportError
from keel.model.architecture import SIZE_LIMITS

_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_OPTIONAL_INT_FIELDS = ("num_key_value_heads", "max_position_embeddings", "head_dim")
# config.json's counts -> the ModelConfig field whose size limit bounds them
_KEEL_FIELD = {"vocab_size": "vocab_size", "hidden_size": "d_model", "num_hidden_layers": "n_blocks",
               "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads", "intermediate_size": "d_ffn",
               "max_position_embeddings": "max_seq_len"}


def read_json(path: Path, what: str):
    """JSON from a directory that may come from anywhere (keel.safe_io's bounds); one ExportError naming it."""
    from keel.data.tokenizer import read_capped

    try:
        return safe_io.loads_json(read_capped(path))
    except FileNotFoundError:
        raise ExportError(f"{path}: not found; expected {what}") from None
    except OSError as err:
        raise ExportError(f"{path}: cannot read ({err.strerror})") from None
    except DataError as err:  # not a regular file, or too large
        raise ExportError(str(err).removeprefix("keel: ")) from None
    except ValueError as err:
        raise ExportError(f"{path}: not valid JSON ({str(err).splitlines()[0][:80]})") from None


def _weight_files(hf_dir: Path) -> list[Path]:
    """model.safetensors, or the shards model.safetensors.index.json lists, each a regular file named inside
    `hf_dir` (a name with .. or an absolute path is refused, never opened)."""
    single, index = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json"
    if os.path.lexists(single):
        files = [single]
    elif os.path.lexists(index):
        raw = read_json(index, "a safetensors index")
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
            raise ExportError(f"{index}: not a safetensors index (no weight_map of file names)")
        for name in weight_map.values():
            if PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts or "\\" in name:
                raise ExportError(f"{index}: weight_map names {name[:80]!r}, outside {hf_dir}; refused")
            if "\0" in name:  # no file has such a name; opening it is a ValueError, not an OSError
                raise ExportError(f"{index}: weight_map names {name[:80]!r}, which holds a NUL byte; refused")
        files = [hf_dir / name for name in sorted(set(weight_map.values()))]
    else:
        raise ExportError(f"{single}: not found (only safetensors weights are read; re-save the model with "
                          "save_pretrained(..., safe_serialization=True))")
    for path in files:
        try:
            mode = path.stat().st_mode
        except OSError as err:
            raise ExportError(f"{path}: cannot read weights ({err.strerror})") from None
        if not stat.S_ISREG(mode):
            raise ExportError(f"{path}: not a regular file")
    return files


def _weight_count(files: list[Path]) -> int:
    """Numbers in all the weight files, from their headers (no tensor read)."""
    from keel.runs.untrusted import Damaged, safetensors_shapes

    total = 0
    for path in files:
        try:
            shapes = safetensors_shapes(path)
        except Damaged as err:
            raise ExportError(f"{path.parent}{os.sep}{err}") from None
        total += sum(math.prod(s) for s in shapes.values())
    return total


def read_llama_weights(hf_dir: Path) -> dict:
    """The state dict of model.safetensors, or of the shards model.safetensors.index.json lists."""
    from safetensors.torch import load_file

    state = {}
    for path in _weight_files(hf_dir):
        try:
            state |= load_file(str(path))
        except Exception as err:  # safetensors raises its own error type for damaged files
            raise ExportError(f"{path}: cannot read weights ({str(err).splitlines()[0]})") from None
    return state


def _model_config(hf, config_path: Path):
    """The ModelConfig of config.json's fields, each checked for type first: a list, a string where a count
    belongs, or num_attention_heads=0 is one line naming the field."""
    from keel.hf.llama import config_from_llama

    if not isinstance(hf, dict):
        raise ExportError(f"{config_path}: holds a JSON {type(hf).__name__}, not an object of config fields")
    if hf.get("model_type") != "llama":
        raise ExportError(f"{config_path}: model_type {str(hf.get('model_type'))[:40]!r} is not a Llama "
                          "architecture; keel import-hf reads model_type 'llama'")
    for key in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
        value = hf.get(key)
        if (key in _INT_FIELDS or value is not None) and not (type(value) is int and value >= 1):
            raise ExportError(f"{config_path}: {key}={str(value)[:40]}; allowed: an integer >= 1")
        most = SIZE_LIMITS.get(_KEEL_FIELD.get(key, ""))
        if most is not None and value is not None and value > most:  # named as config.json spells it
            raise ExportError(f"{config_path}: {key}={value}; allowed: an integer in [1, {most:,}]")
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise ExportError(f"{config_path}: {key}={str(hf[key])[:40]}; allowed: an object, or null")
    try:
        return config_from_llama(hf)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ExportError(f"{config_path}: {str(err)[:160]}") from None


def _check_size(model_config, weights: int, config_path: Path) -> None:
    """Refuse a config.json describing more parameters than the weights hold, or than memory holds."""
    import torch

    from keel.model.counting import count_params
    from keel.runtime import device_memory

    c, memory = model_config, device_memory(torch.device("cpu"))
    if c.distinct_blocks > weights:  # before counting, which walks the blocks
        raise ExportError(f"{config_path}: num_hidden_layers={c.n_blocks}, more than the weights hold")
    n = count_params(c)
    if n > weights:
        raise ExportError(f"{config_path}: describes a model of {n:,} parameters (vocab_size={c.vocab_size}, "
                          f"hidden_size={c.d_model}, num_hidden_layers={c.n_blocks}), but the weights hold {weights:,}")
    rope = 8 * c.max_seq_len * c.head_dim  # the cos and sin tables, float32
    if memory is not None and 4 * n + rope > memory:
        field = f"max_position_embeddings={c.max_seq_len}" if rope > memory // 2 else f"{n:,} parameters"
        raise ExportError(f"{config_path}: {field} needs {(4 * n + rope) / 2**30:.3g} GiB, more than this "
                          f"machine's {memory / 2**30:.3g} GiB")


def _check_new_run_dir(run_dir: Path) -> None:
    """Before any work: `run_dir` is new or an empty directory, and the nearest part of its path that exists
    is a directory (a path under a file was a NotADirectoryError once the model was converted)."""
    if os.path.lexists(run_dir) and (not run_dir.is_dir() or run_dir.is_symlink() or any(run_dir.iterdir())):
        raise ExportError(f"{run_dir}: already exists and is not an empty directory; choose a new run directory")
    above = run_dir.absolute().parent
    while not os.path.lexists(above):
        above = above.parent
    if not above.is_dir():
        raise ExportError(f"{run_dir}: {above} is not a directory; choose a run directory under one")


def import_llama(hf_dir, run_dir, data_source: str = "stdlib") -> Path:
    """Convert `hf_dir` (config.json, model.safetensors, tokenizer.json) into the run directory `run_dir`."""
    from keel.config import RunConfig, TrainConfig, validate
    from keel.data.corpus import DataConfig
    from keel.data.tokenizer import HFTokenizer
    from keel.hf.llama import state_dict_from_llama
    from keel.model.transformer import TransformerLM
    from keel.runs import checkpoint
    from keel.runs.run_dir import RunDir

    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    config_path, tokenizer_path = hf_dir / "config.json", hf_dir / "tokenizer.json"
    _check_new_run_dir(run_dir)
    hf = read_json(config_path, "a transformers model directory")
    model_config = _model_config(hf, config_path)
    _check_size(model_config, _weight_count(_weight_files(hf_dir)), config_path)
    if not tokenizer_path.is_file():
        raise ExportError(f"{tokenizer_path}: not found; import-hf needs the model's fast tokenizer file")
    tokenizer = HFTokenizer(tokenizer_path)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ExportError(f"{tokenizer_path}: {tokenizer.vocab_size} tokens, more than the model's vocab_size "
                          f"{model_config.vocab_size} in {config_path}")
    model = TransformerLM(model_config)
    weights = hf_dir / "model.safetensors"
    try:
        state = state_dict_from_llama(read_llama_weights(hf_dir), model_config.n_blocks)
        model.load_state_dict(state, strict=True)
    except (ValueError, RuntimeError) as err:  # missing/unknown names, shapes that do not match config.json
        raise ExportError(f"{weights}: does not match {config_path.name} ({str(err).splitlines()[0]})") from None

    try:
        run = RunDir.create_at(run_dir)
    except OSError as err:  # a read-only file system, /proc, no permission
        raise ExportError(f"{run_dir}: cannot make the run directory ({err.strerror or err})") from None
    run.save_tokenizer(tokenizer)
    seq_len = min(RunConfig.seq_len, model_config.max_seq_len)
    config = TrainConfig(
        model=model_config,
        data=DataConfig(source=data_source, tokenizer=str((run_dir / "tokenizer" / "tokenizer.json").resolve())),
        run=replace(RunConfig(), seq_len=seq_len, out_dir=str(run_dir.parent), name=run_dir.name),
    )
    validate(config)
    run.write_config(config)
    run.write_provenance({"imported_from": str(hf_dir.resolve()), "source_config": hf})
    checkpoint.save(run.path, 0, model, {}, {"imported_from": str(hf_dir.resolve())}, keep=1)
    return run.path
