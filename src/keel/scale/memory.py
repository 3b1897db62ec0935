"""How much memory a training run needs per process, from its config alone, before anything is built.

`estimate_memory` adds up four parts, in bytes per process:
  params       the float32 master weights (sharded over ranks under FSDP2), plus the unsharded
               copies FSDP2 all-gathers for the units in use (the root, and about two block groups);
  grads        float32, the same layout as the master weights;
  optimizer    AdamW's two float32 moments per parameter and one float32 step counter per tensor;
  activations  the tensors autograd keeps for the backward pass at this micro-batch, counted per
               token from the model's own operations (tests/test_memory.py checks the count against
               what autograd saves), plus, with checkpointing, one block recomputed in the backward.
Allocator slack, the CUDA context, and temporaries inside a kernel are not included: leave ~10-20%.
"""

from __future__ import annotations

import torch
from torch import nn

from keel.model.config import ModelConfig
from keel.model.counting import count_params
from keel.model.transformer import build_scheme


def count_param_tensors(config: ModelConfig) -> int:
    """Number of parameter tensors of `TransformerLM(config)` (AdamW keeps one step counter for each)."""
    scheme = build_scheme(config)
    per_block = 4 + (3 if scheme.qkv_norm else 0) + (3 if config.ffn == "swiglu" else 2)
    norms = sum(spec.norm_in + spec.norm_out + spec.norm_branch
                for spec in (scheme.spec(i, "attn" if i % 2 == 0 else "ffn") for i in range(config.n_sublayers)))
    return config.n_blocks * per_block + norms + scheme.final_norm + 1 + (0 if config.tie_embeddings else 1)


def _block_words(config: ModelConfig, index: int, branch_scale: float) -> float:
    """4-byte words autograd saves per token in block `index` (branch tensors scaled by their dtype)."""
    d, kv, f, H = config.d_model, config.kv_heads * config.head_dim, config.ffn_dim, config.n_heads
    q = config.n_heads * config.head_dim
    scheme = build_scheme(config)
    norm = 2 * d + 1  # a norm keeps its float32 input, the normalised value, and 1 / rms
    words = 0.0
    for kind in ("attn", "ffn"):
        spec = scheme.spec(2 * index + (kind == "ffn"), kind)
        words += norm * (spec.norm_in + spec.norm_out + spec.norm_branch)
    attn = 3 * q + d + 2 * kv + H  # projections' input, rotated q, k, SDPA's q, k, v, out, logsumexp
    if scheme.qkv_norm:
        attn += 2 * (q + 2 * kv) + 3
    ffn = (4 if config.ffn == "swiglu" else 2) * f
    return words + branch_scale * (attn + ffn)


def activation_bytes(config: ModelConfig, batch_size: int, seq_len: int, ac_every: int = 0,
                     compute_bytes: int = 4, recompute: bool = True) -> int:
    """Bytes autograd holds at the end of the forward pass, plus (`recompute`) the one block that
    checkpointing recomputes at a time in the backward pass."""
    d, V = config.d_model, config.vocab_size
    scale = compute_bytes / 4
    head = V * scale + (V if scale != 1 else 0) + d + 4  # logits (and their float32 copy), head input, ids
    words = head + (2 * d + 1 if build_scheme(config).final_norm else 0)
    recomputed = 0.0
    for i in range(config.n_blocks):
        full = _block_words(config, i, scale)
        if ac_every and i % ac_every == 0:
            words += d  # a checkpointed block keeps only its float32 input
            recomputed = max(recomputed, full)
        else:
            words += full
    return int(4 * (words + (recomputed if recompute else 0)) * batch_size * seq_len)


def estimate_memory(config: ModelConfig, batch_size: int, seq_len: int, ac_every: int = 0, world_size: int = 1,
                    param_bytes: int = 4, fsdp_group: int = 0) -> dict[str, int]:
    """Bytes per process for one training step (see the module docstring); `fsdp_group` > 0 means
    FSDP2 with that many blocks per unit, `param_bytes` 2 for bf16 mixed precision."""
    n, tensors = count_params(config), count_param_tensors(config)
    shard = n / world_size if fsdp_group else n
    gathered = 0
    if fsdp_group:
        d, V = config.d_model, config.vocab_size
        root = V * d * (1 if config.tie_embeddings else 2) + (d if build_scheme(config).final_norm else 0)
        per_block = (n - root) / config.n_blocks
        gathered = param_bytes * (root + 2 * fsdp_group * per_block)
    out = {
        "params": int(4 * shard + gathered),
        "grads": int(4 * shard),
        "optimizer": int(8 * shard + 4 * tensors),
        "activations": activation_bytes(config, batch_size, seq_len, ac_every, param_bytes),
    }
    out["total"] = sum(out.values())
    return out


def measured_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """What `model` and `optimizer` hold now: parameter and optimiser-state bytes (local shards)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = sum(local(p).numel() * p.element_size() for p in model.parameters())
    state = 0
    if optimizer is not None:
        for s in optimizer.state.values():
            state += sum(local(t).numel() * t.element_size() for t in s.values() if torch.is_tensor(t))
    return {"params": params, "optimizer": state}


def saved_activation_bytes(model: nn.Module, *inputs) -> int:
    """Bytes of the tensors autograd saves for the backward pass of `model(*inputs)` (parameters and
    buffers excluded, each storage counted once). Runs one forward pass."""
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    return sum(seen.values())


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
