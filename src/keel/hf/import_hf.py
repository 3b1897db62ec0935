"""`keel import-hf`: a Llama-architecture `transformers` checkpoint -> a `pre_ln` Keel run directory.

The names map one to one (`keel.hf.llama`); the result is a run directory with config.yaml, tokenizer/ and
checkpoints/step_00000000/, which `keel eval`, `keel generate` and `keel export-hf` accept.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from keel.errors import ExportError


def read_llama_weights(hf_dir: Path) -> dict:
    """The state dict of model.safetensors, or of the shards model.safetensors.index.json lists."""
    from safetensors.torch import load_file

    single, index = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            files = [hf_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (ValueError, KeyError) as err:
            raise ExportError(f"{index}: not a safetensors index ({err})") from None
    else:
        raise ExportError(f"{single}: not found (only safetensors weights are read; re-save the model with "
                          "save_pretrained(..., safe_serialization=True))")
    state = {}
    for path in files:
        try:
            state |= load_file(str(path))
        except Exception as err:  # safetensors raises its own error type for damaged files
            raise ExportError(f"{path}: cannot read weights ({str(err).splitlines()[0]})") from None
    return state


def import_llama(hf_dir, run_dir, data_source: str = "stdlib") -> Path:
    """Convert `hf_dir` (config.json, model.safetensors, tokenizer.json) into the run directory `run_dir`."""
    from keel.data.corpus import DataConfig
    from keel.data.tokenizer import HFTokenizer
    from keel.hf.llama import config_from_llama, state_dict_from_llama
    from keel.model.transformer import TransformerLM
    from keel.train import checkpoint
    from keel.train.config import RunConfig, TrainConfig, validate
    from keel.train.run_dir import RunDir

    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    config_path, tokenizer_path = hf_dir / "config.json", hf_dir / "tokenizer.json"
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ExportError(f"{run_dir}: already exists and is not empty; choose a new run directory")
    try:
        hf = json.loads(config_path.read_text())
    except OSError:
        raise ExportError(f"{config_path}: not found; expected a transformers model directory") from None
    except ValueError as err:
        raise ExportError(f"{config_path}: not valid JSON ({err})") from None
    if hf.get("model_type") != "llama":
        raise ExportError(f"{config_path}: model_type {hf.get('model_type')!r} is not a Llama architecture; "
                          "keel import-hf reads model_type 'llama'")
    try:
        model_config = config_from_llama(hf)
    except (ValueError, KeyError) as err:
        raise ExportError(f"{config_path}: {err}") from None
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

    run = RunDir.create_at(run_dir)
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
