"""Parameter and FLOP counts from a config alone, without building the model; `block_params` is the one layer
counter (docs/internals.md#keelmodelcounting)."""

from __future__ import annotations

from dataclasses import replace

from keel.model.architecture import ModelConfig
from keel.model.transformer import block_specs, build_scheme


def block_params(config: ModelConfig, tensors: bool = False) -> list[int]:
    """Parameters of each block of `TransformerLM(config).blocks` (`config.distinct_blocks` of them), or with
    `tensors=True` how many parameter tensors each holds (AdamW keeps a step counter per tensor)."""
    d = config.d_model
    q_dim, kv_dim = config.n_heads * config.head_dim, config.kv_heads * config.head_dim
    scheme = build_scheme(config)
    swiglu = config.ffn == "swiglu"
    if tensors:  # wq, wk, wv, wo (+ the q, k, v norms); gate, up, down or up, down; one gain per norm
        branches, per_norm = 4 + 3 * scheme.qkv_norm + (3 if swiglu else 2), 1
    else:
        branches = d * q_dim + 2 * d * kv_dim + q_dim * d + (q_dim + 2 * kv_dim) * scheme.qkv_norm
        branches += (3 if swiglu else 2) * d * config.ffn_dim
        per_norm = d
    out = []
    for index in range(config.distinct_blocks):
        norms = sum(spec.norm_in + spec.norm_out + spec.norm_branch
                    for layout in block_specs(config, scheme, index) for spec in layout)
        out.append(branches + per_norm * norms)
    return out


def root_params(config: ModelConfig, tensors: bool = False) -> dict[str, int]:
    """Parameters (or tensors) outside the blocks: `embed`, `final_norm`, and the LM `head` (0 when tied: the
    embedding's matrix is the head and is counted once, as `embed`)."""
    d, V = config.d_model, config.vocab_size
    final = build_scheme(config).final_norm
    head = 0 if config.tie_embeddings else (1 if tensors else V * d)
    return {"embed": 1 if tensors else V * d, "final_norm": (1 if tensors else d) * final, "head": head}


def count_params(config: ModelConfig, embedding: bool = True) -> int:
    """Number of distinct parameters of `TransformerLM(config)`.

    `embedding=False` leaves out the input embedding table (the LM head stays in: it is a matmul).
    With tied embeddings the shared matrix is the head and is counted once, in either case. A looped model's
    blocks count once (`block_params`), with the norms of their later-pass layouts where those differ.
    """
    root = root_params(config)
    total = sum(block_params(config)) + root["final_norm"] + root["embed"] + root["head"]
    if not embedding and not config.tie_embeddings:
        total -= root["embed"]
    return total


def count_param_tensors(config: ModelConfig) -> int:
    """Number of parameter tensors of `TransformerLM(config)` (a tied matrix once)."""
    return sum(block_params(config, tensors=True)) + sum(root_params(config, tensors=True).values())


def flops_per_token(config: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward): `6 N + 12 n_layers d_attn T`, N the parameters in matmuls,
    without the causal mask's saving, as PaLM and nanoGPT count (docs/internals.md#keelmodelcountingflops_per_token)."""
    T = config.max_seq_len if seq_len is None else seq_len
    n = count_params(replace(config, loop_blocks=None), embedding=False)
    return 6 * n + 12 * config.n_blocks * config.n_heads * config.head_dim * T
