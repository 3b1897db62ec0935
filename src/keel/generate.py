"""Sampling text from a model: temperature, top-k and nucleus (top-p) sampling, with a KV cache."""

from __future__ import annotations

import torch

from keel.model.layers import KVCache


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the smallest set with mass >= top_p."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


@torch.no_grad()
def generate(model, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, generator: torch.Generator | None = None, eos_id: int | None = None,
             use_cache: bool = True) -> torch.Tensor:
    """Extend `idx` (B, T) by up to `max_new_tokens` tokens; temperature 0 is greedy decoding. `use_cache` reuses keys
    and values (a `KVCache`); both ways give the same tokens (docs/internals.md#keelgenerategenerate)."""
    model.eval()
    max_len = model.config.max_seq_len
    cache = KVCache() if use_cache else None
    for _ in range(max_new_tokens):
        context = idx[:, -max_len:]
        if cache is not None:
            if idx.size(1) > max_len:  # the window slid: every cached position is stale
                cache = KVCache()
            context = context[:, cache.get_seq_length():]  # the tokens the cache does not hold yet
        logits, _ = model(context, cache=cache)
        logits = logits[:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
        idx = torch.cat((idx, nxt), dim=1)
        if eos_id is not None and (nxt == eos_id).all():
            break
    return idx
