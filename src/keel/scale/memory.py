"""How much memory a training run needs per process, from its config alone, before anything is built
(docs/scale.md, "Memory model"; what is counted: docs/internals.md#keelscalememory)."""

from __future__ import annotations

import torch
from torch import nn

from keel.model.architecture import ModelConfig
from keel.model.counting import block_params, count_param_tensors, root_params
from keel.model.transformer import build_scheme


def _block_words(config: ModelConfig, index: int, branch_scale: float) -> float:
    """4-byte words autograd saves per token in the block at unrolled position `index` (branch tensors scaled
    by their dtype)."""
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


def hands_on_sum(config: ModelConfig, ac_every: int, compiled: bool) -> bool:
    """Whether the stack's last sub-layer hands on its sum, normalised at the root
    (keel.scale.fused_junction.NormOfSum):
    compiled under AC, an unlooped model whose last sub-layer is a junction's first half and that has no final
    norm (Keel)."""
    scheme = build_scheme(config)
    spec = scheme.spec(config.n_sublayers - 1, "ffn")
    return bool(compiled and ac_every and config.loop_blocks is None and spec.norm_out and spec.norm_in
                and not scheme.final_norm)


def activation_bytes(config: ModelConfig, batch_size: int, seq_len: int, ac_every: int = 0,
                     compute_bytes: int = 4, recompute: bool = True, blocks: range | None = None,
                     first: bool = True, last: bool = True, compiled: bool = False) -> int:
    """Bytes autograd holds at the end of the forward pass, plus (`recompute`) the one block that
    checkpointing recomputes at a time in the backward pass. `blocks` (unrolled positions, default all), `first`
    (the token ids the embedding keeps) and `last` (the final norm, the head, the loss) select a pipeline stage;
    `compiled` a model whose last sub-layer may hand on its sum (`hands_on_sum`: the root then norms it)."""
    d, V = config.d_model, config.vocab_size
    scale = compute_bytes / 4
    words = 2.0 if first else 0.0  # int64 ids
    if last:  # logits (and their float32 copy), the head's input, int64 targets, a final norm's input and output
        final = build_scheme(config).final_norm or hands_on_sum(config, ac_every, compiled)
        words += V * scale + (V if scale != 1 else 0) + d + 2 + (2 * d + 1 if final else 0)
    recomputed = 0.0
    for i in blocks if blocks is not None else range(config.n_blocks):
        full = _block_words(config, i, scale)
        if ac_every and (i % config.distinct_blocks) % ac_every == 0:  # apply_ac wraps blocks[i % k] of k
            words += d  # a checkpointed block keeps only its float32 input
            recomputed = max(recomputed, full)
        else:
            words += full
    return int(4 * (words + (recomputed if recompute else 0)) * batch_size * seq_len)


def _states(n: float, tensors: int, shard: int, state_bytes: float = 8, grad_bytes: int = 4) -> dict[str, int]:
    return {"grads": int(grad_bytes * n / shard), "optimizer": int(state_bytes * n / shard + 4 * tensors)}


# bytes per parameter of AdamW's two moments, by optim.state
STATE_BYTES = {"float32": 8, "bfloat16": 4, "8bit": 2}


def optim_temp_bytes(n_largest_group: float, implementation: str = "foreach") -> int:
    """The optimizer step's temporary: torch's foreach AdamW takes the square root of every second moment of a
    parameter group at once (one float32 tensor per parameter, freed after the group's update); the fused AdamW
    (and torchao's, which steps one parameter at a time) keeps none worth counting."""
    return int(4 * n_largest_group) if implementation == "foreach" else 0


def estimate_memory(config: ModelConfig, batch_size: int, seq_len: int, ac_every: int = 0, world_size: int = 1,
                    param_bytes: int = 4, fsdp_group: int = 0, pp: int = 1, pp_schedule: str = "1f1b",
                    pp_microbatches: int = 1, grad_accum: int = 1, bf16_autocast: bool = False,
                    optim_impl: str = "foreach", state: str = "float32", weights: str = "float32",
                    compiled: bool = False) -> dict:
    """Bytes per process for one training step (docs/internals.md#keelscalememory): the parts, `phases` (forward,
    backward, optimizer: bytes each), `peak_phase`, and `total` (the peak phase's bytes). `fsdp_group` > 0 means
    FSDP2 with that many blocks per unit, `param_bytes` 2 for its bf16 mixed precision; `bf16_autocast` for a
    single process computing under bf16 autocast. `optim_impl` (foreach or fused) and `state` (STATE_BYTES) are
    the optimizer's. `weights` bfloat16 (run.weights) holds weights and gradients in 2 bytes a parameter, with
    no autocast copies (the matmuls read the bf16 weights themselves). `pp` > 1: a pipeline of `pp` ranks per
    replica (world_size / pp replicas),
    `pp_microbatches` per batch of `batch_size`. `compiled`: run.compile (see `activation_bytes`)."""
    if pp > 1:
        return max(pipeline_memory(config, batch_size, seq_len, ac_every, world_size, param_bytes, pp, pp_schedule,
                                   pp_microbatches, grad_accum), key=lambda m: m["total"])
    blocks, root = block_params(config), root_params(config)
    n = sum(blocks) + sum(root.values())
    shard = world_size if fsdp_group else 1
    gathered = 0
    if fsdp_group:
        per_block = sum(blocks) / len(blocks)
        gathered = param_bytes * (sum(root.values()) + 2 * fsdp_group * per_block)
    bf16_weights = weights == "bfloat16"
    compute_bytes = 2 if (bf16_autocast or param_bytes == 2 or bf16_weights) else 4
    own = 2 if bf16_weights else 4  # bytes a parameter of the weights this process holds, and of their gradients
    matrices = n - root["embed"] - root["final_norm"]  # the decayed group: every weight matrix (norm gains aside)
    kept = activation_bytes(config, batch_size, seq_len, ac_every, compute_bytes, recompute=False, compiled=compiled)
    recomputed = activation_bytes(config, batch_size, seq_len, ac_every, compute_bytes, compiled=compiled) - kept
    out = {"params": int(own * n / shard + gathered), **_states(n, count_param_tensors(config), shard,
                                                                STATE_BYTES[state], own),
           "activations": kept + recomputed,
           "autocast_cache": int(2 * matrices / shard) if bf16_autocast and not (fsdp_group or bf16_weights) else 0,
           "optimizer_temp": optim_temp_bytes(matrices / shard, "per-parameter" if state == "8bit" or bf16_weights
                                              else optim_impl)}
    held = out["params"] + out["optimizer"] + out["autocast_cache"]
    logits_grad = 4 * batch_size * seq_len * config.vocab_size
    # under checkpointing a block's forward keeps nothing, but while it runs its FFN's two projections are alive
    transient = 2 * batch_size * seq_len * config.ffn_dim * compute_bytes if ac_every else 0
    out["phases"] = {"forward": held + kept + transient,
                     # the bf16 weight copies are autocast's cache during the forward; without checkpointing
                     # the matmuls keep them for the backward, with it each block casts its own again
                     "backward": out["params"] + out["optimizer"] + recomputed
                     + max(kept + logits_grad + (0 if ac_every else out["autocast_cache"]), out["grads"]),
                     "optimizer": out["params"] + out["optimizer"] + out["grads"] + out["optimizer_temp"]}
    out["peak_phase"] = max(out["phases"], key=out["phases"].get)
    out["total"] = out["phases"][out["peak_phase"]]
    return out


def pipeline_memory(config: ModelConfig, batch_size: int, seq_len: int, ac_every: int = 0, world_size: int = 2,
                    param_bytes: int = 4, pp: int = 2, pp_schedule: str = "1f1b", pp_microbatches: int = 1,
                    grad_accum: int = 1) -> list[dict[str, int]]:
    """`estimate_memory`'s parts for each pipeline rank (pp coordinate 0, 1, ...), as keel.scale.pipeline splits
    the model: the rank's stages' parameters (over its dp replicas, sharded, plus the whole stages gathered in
    `param_bytes`), and the activations of its micro-batches in flight."""
    from keel.scale.pipeline import split_blocks, stage_placement  # noqa: PLC0415 (pipelining: only here)

    placement = stage_placement(pp, pp_schedule)
    n_stages, dp = len(placement), world_size // pp
    spans, blocks = split_blocks(config, n_stages), block_params(config)
    blocks_t, root, root_t = block_params(config, tensors=True), root_params(config), root_params(config, True)
    micro, in_flight = batch_size // pp_microbatches, pp_microbatches * grad_accum
    out = []
    for rank in range(pp):
        n = tensors = activations = recomputed = 0
        for s in (s for s in placement if placement[s] == rank):
            first, last = s == 0, s == n_stages - 1
            n += sum(blocks[i] for i in spans[s]) + first * root["embed"] + last * (root["head"] + root["final_norm"])
            tensors += sum(blocks_t[i] for i in spans[s]) + first * root_t["embed"]
            tensors += last * (root_t["head"] + root_t["final_norm"])
            held = in_flight if pp_schedule == "gpipe" else min(in_flight, n_stages - s)
            activations += held * activation_bytes(config, micro, seq_len, ac_every, param_bytes, False, spans[s],
                                                   first, last)
            recomputed = max(recomputed, activation_bytes(config, micro, seq_len, ac_every, param_bytes, True,
                                                          spans[s], False, False)
                             - activation_bytes(config, micro, seq_len, ac_every, param_bytes, False, spans[s],
                                                False, False))
        m = {"params": int(4 * n / dp + (param_bytes * n if dp > 1 else 0)), **_states(n, tensors, dp),
             "activations": activations + recomputed}
        m["total"] = sum(m.values())
        out.append(m)
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


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
