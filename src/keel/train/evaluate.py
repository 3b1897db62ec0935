"""Validation loss, perplexity and bits per byte."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from keel.data import eval_batches
from keel.errors import DataError
from keel.model import lm_loss


def bytes_per_token(tokenizer) -> np.ndarray:
    """UTF-8 length of each token id, for converting a per-token loss into bits per byte."""
    if tokenizer.name == "bytes":
        return np.ones(tokenizer.vocab_size, dtype=np.int64)
    lengths = getattr(tokenizer, "token_byte_lengths", lambda: None)()
    if lengths is not None:
        return lengths
    return np.array([len(tokenizer.decode([i]).encode("utf-8")) for i in range(tokenizer.vocab_size)])


@torch.no_grad()
def evaluate(model, tokens, seq_len: int, batch_size: int, max_batches: int, device,
             autocast=contextlib.nullcontext, token_bytes: np.ndarray | None = None) -> dict:
    """Mean next-token loss over evenly spaced windows of `tokens` (the same windows every call)."""
    was_training = model.training
    model.eval()
    nll, n_tokens, n_bytes = 0.0, 0, 0
    for x, y in eval_batches(tokens, seq_len, batch_size, max_batches):
        x, y = x.to(device), y.to(device)
        with autocast():
            logits, _ = model(x)
        nll += lm_loss(logits, y, reduction="sum").item()
        n_tokens += y.numel()
        if token_bytes is not None:
            n_bytes += int(token_bytes[y.cpu().numpy()].sum())
    model.train(was_training)
    if n_tokens == 0:
        raise DataError("validation split is too short for one window of run.seq_len tokens")
    loss = nll / n_tokens
    out = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": n_tokens}
    if token_bytes is not None and n_bytes:
        out["val_bits_per_byte"] = nll / (math.log(2) * n_bytes)
    return out


def evaluate_run(run_dir, checkpoint: str | None = None, split: str = "val", batches: int = 0,
                 device: str = "auto") -> dict:
    """`keel eval`: a run's checkpoint on its own data split, with the run's sequence length and dtype."""
    from keel.data import prepare
    from keel.runtime import autocast_for, resolve_device
    from keel.train.run_dir import RunDir

    run = RunDir.open(run_dir)
    config, model, tokenizer, path = run.load_model(checkpoint)
    dev = resolve_device(device)
    data = prepare(config.data)
    tokens = data.val if split == "val" else data.train
    torch.manual_seed(0)
    result = evaluate(model.to(dev), tokens, config.run.seq_len, config.run.batch_size,
                      batches or config.run.eval_batches, dev, autocast_for(dev, config.run.dtype),
                      bytes_per_token(tokenizer))
    return {"checkpoint": str(path), "split": split, **result}
