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
def nll_sum(model, x: torch.Tensor, y: torch.Tensor, autocast=contextlib.nullcontext,
            token_bytes: np.ndarray | None = None) -> tuple[float, int, int]:
    """One batch's summed next-token loss, its token count and (with `token_bytes`) its UTF-8 byte count: the one
    evaluation step, for `evaluate` and for every measurement that scores fixed batches (loss_on)."""
    with autocast():
        logits, _ = model(x)
    n_bytes = int(token_bytes[y.cpu().numpy()].sum()) if token_bytes is not None else 0
    return lm_loss(logits, y, reduction="sum").item(), y.numel(), n_bytes


@torch.no_grad()
def evaluate(model, tokens, seq_len: int, batch_size: int, max_batches: int, device,
             autocast=contextlib.nullcontext, token_bytes: np.ndarray | None = None, world=None, replica: int = 0,
             replicas: int = 1) -> dict:
    """Mean next-token loss over `batch_size x max_batches` evenly spaced windows of `tokens` (the same every call),
    `batch_size` the global batch split over data-parallel replicas; every rank gets the result
    (docs/internals.md#keeltrainevaluateevaluate)."""
    # ids beyond the model's vocabulary (a cache from elsewhere) are one line naming it, not an IndexError
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    windows = list(eval_batches(tokens, seq_len, batch_size * max_batches, 1, vocab_size=vocab,
                                source=getattr(tokens, "filename", None) or "the validation tokens"))
    if not windows:
        raise DataError("validation split is too short for one window of run.seq_len tokens")
    xs, ys = windows[0]  # (windows, T) each
    mine = torch.arange(replica, len(xs), replicas)
    share = math.ceil(batch_size / replicas)  # sequences per forward pass
    n_batches = math.ceil(math.ceil(len(xs) / replicas) / share)
    was_training = model.training
    model.eval()
    nll, n_tokens, n_bytes = 0.0, 0, 0
    for i in range(n_batches):
        rows = mine[i * share:(i + 1) * share]
        counted = len(rows) > 0
        if not counted:
            rows = torch.zeros(1, dtype=torch.long)
        batch = nll_sum(model, xs[rows].to(device), ys[rows].to(device), autocast, token_bytes)
        if counted:
            nll, n_tokens, n_bytes = nll + batch[0], n_tokens + batch[1], n_bytes + batch[2]
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
                 device: str = "auto", trust: bool = False) -> dict:
    """`keel eval`: a run's checkpoint on its own data split, with the run's sequence length, dtype and saved tokenizer;
    its data paths followed only when trusted (docs/internals.md#keeltrainevaluateevaluate_run)."""
    from keel.data import prepare
    from keel.runs.run_dir import RunDir
    from keel.runs.trust import check_data_paths
    from keel.runtime import autocast_for, resolve_device
    from keel.scale import distributed
    from keel.train.step import build_model

    run = RunDir.open(run_dir)
    dev = resolve_device(device)
    world = distributed.init(dev.type)
    try:
        if dev.type == "cuda" and world.distributed:
            dev = torch.device("cuda", world.local_rank)
        config, tokenizer = run.config(), run.tokenizer()
        check_data_paths(run.path, config.data, trust, tokenizer=False)  # before any file is read
        model, meta, path = run.load_weights(config, checkpoint)  # the newest that loads, unless one is named
        global_batch = meta.get("global_batch", config.run.batch_size)  # of the processes that trained it
        data = prepare(config.data, tokenizer)
        tokens = data.val if split == "val" else data.train
        replica, replicas, autocast = 0, 1, autocast_for(dev, config.run.dtype)
        model = model.to(dev)
        if world.distributed:
            pp = config.run.pp > 1
            model = build_model(config.model, config.run, dev, fsdp=not pp, model=model)
            replica, replicas = (model.dp_rank, model.dp_size) if pp else (world.rank, world.size)
            if not pp:  # FSDP2's mixed-precision policy gives bf16 weights instead of autocast
                autocast = contextlib.nullcontext
        torch.manual_seed(0)
        result = evaluate(model, tokens, config.run.seq_len, global_batch,
                          batches or config.run.eval_batches, dev, autocast, bytes_per_token(tokenizer), world,
                          replica, replicas)
        distributed.barrier(world)  # every rank leaves together (Trainer._leave_group says why)
    finally:
        distributed.close(world)
    return {"checkpoint": str(path), "split": split, **result}
