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
             autocast=contextlib.nullcontext, token_bytes: np.ndarray | None = None, world=None, replica: int = 0,
             replicas: int = 1) -> dict:
    """Mean next-token loss over evenly spaced windows of `tokens` (the same windows every call).

    The windows are `batch_size x max_batches` (keel.data.eval_batches) however many processes there are, so
    one process, FSDP2 and a pipeline's replicas report the same loss: under torchrun (`world`) data-parallel
    replica `replica` of `replicas` evaluates every `replicas`-th of them, and the sums are added over all
    ranks. Every rank gets the result. Each rank runs as many forward passes as every other (a rank short of
    windows runs one it does not count), since FSDP2 and the pipeline's stages gather and send in each."""
    windows = list(eval_batches(tokens, seq_len, batch_size, max_batches))
    if not windows:
        raise DataError("validation split is too short for one window of run.seq_len tokens")
    xs, ys = torch.cat([x for x, _ in windows]), torch.cat([y for _, y in windows])  # (windows, T) each
    mine = torch.arange(replica, len(xs), replicas)
    n_batches = math.ceil(math.ceil(len(xs) / replicas) / batch_size)
    was_training = model.training
    model.eval()
    nll, n_tokens, n_bytes = 0.0, 0, 0
    for i in range(n_batches):
        rows = mine[i * batch_size:(i + 1) * batch_size]
        counted = len(rows) > 0
        if not counted:
            rows = torch.zeros(1, dtype=torch.long)
        x, y = xs[rows].to(device), ys[rows].to(device)
        with autocast():
            logits, _ = model(x)
        if counted:
            nll += lm_loss(logits, y, reduction="sum").item()
            n_tokens += y.numel()
            if token_bytes is not None:
                n_bytes += int(token_bytes[y.cpu().numpy()].sum())
    model.train(was_training)
    if world is not None and world.distributed:
        # every rank of a replica (its pipeline stages) counted the replica's windows: divide that out
        sums = torch.tensor([nll, n_tokens, n_bytes], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(sums)
        nll, n_tokens, n_bytes = (sums / (world.size // replicas)).tolist()
        n_tokens, n_bytes = round(n_tokens), round(n_bytes)
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
