"""The log-likelihood scorer on an in-memory model, shared by the probes and the harness adapter; data-parallel
under torch.distributed (docs/internals.md#keelevalsscorer)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from keel.scale.distributed import current


def world() -> tuple[int, int]:
    """(rank, world size): keel.scale.distributed.current()'s, (0, 1) outside torch.distributed."""
    place = current()
    return place.rank, place.size


def all_sum(values: list[float], device) -> list[float]:
    """`values` summed over all ranks (float64, so counts stay exact)."""
    if world()[1] == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


class Scorer:
    """Total log-likelihoods of continuations after contexts, with the context cut from the left so that
    context + continuation fits `max_seq_len` (the model's, by default)."""

    def __init__(self, model, tokenizer, device, autocast=contextlib.nullcontext, max_seq_len: int | None = None):
        self.model, self.tokenizer, self.device, self.autocast = model, tokenizer, torch.device(device), autocast
        self.max_seq_len = max_seq_len or model.config.max_seq_len
        # an empty context still needs one token to predict from: EOS where the tokenizer has one, else byte 0
        # (NUL), as `keel lm-eval` gives the harness
        self.prefix = tokenizer.eos_id if tokenizer.eos_id is not None else 0

    def encode(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation tokenised apart, so every choice of an item shares the context's tokens."""
        return self.tokenizer.encode(context) or [self.prefix], list(self.tokenizer.encode(continuation))

    @torch.no_grad()
    def loglikelihoods(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(total log-probability of the continuation, whether greedy decoding would produce it) for each
        (context ids, continuation ids) pair, in one forward pass (right-padded: padding after a sequence does
        not change a causal model's outputs on it)."""
        rows, spans = [], []
        for ctx, cont in pairs:
            ids = (ctx + cont)[-(self.max_seq_len + 1):]  # (<= L + 1): inputs ids[:-1], targets ids[1:]
            n = min(len(cont), len(ids) - 1)
            rows.append(ids)
            spans.append((len(ids) - 1 - n, len(ids) - 1))  # positions (in the inputs) that predict cont
        T = max(len(r) for r in rows) - 1
        x = torch.zeros(len(rows), T, dtype=torch.long)
        for i, r in enumerate(rows):
            x[i, :len(r) - 1] = torch.tensor(r[:-1])
        with self.autocast():
            logits, _ = self.model(x.to(self.device))  # (B, T, V)
        logp = logits.float().log_softmax(-1).cpu()
        out = []
        for i, ((start, end), r) in enumerate(zip(spans, rows)):
            target = torch.tensor(r[start + 1:end + 1])
            lp = logp[i, start:end]  # (n, V)
            out.append((lp.gather(1, target[:, None]).sum().item(), bool((lp.argmax(-1) == target).all())))
        return out
