"""Sampling text from a model: temperature, top-k and nucleus (top-p) sampling."""

from __future__ import annotations

import torch


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
             top_p: float = 1.0, generator: torch.Generator | None = None, eos_id: int | None = None) -> torch.Tensor:
    """Extend `idx` (B, T) by up to `max_new_tokens` tokens; temperature 0 is greedy decoding.

    Recomputes the whole (cropped) context each step: simple and exact, O(T^2) per token.
    """
    model.eval()
    for _ in range(max_new_tokens):
        context = idx[:, -model.config.max_seq_len:]
        logits, _ = model(context)
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
