"""Parameter and FLOP counts from a config alone, without building the model."""

from __future__ import annotations

from dataclasses import replace

from keel.model.config import ModelConfig
from keel.model.transformer import block_specs, build_scheme


def count_params(config: ModelConfig, embedding: bool = True) -> int:
    """Number of distinct parameters of `TransformerLM(config)`.

    `embedding=False` leaves out the input embedding table (the LM head stays in: it is a matmul).
    With tied embeddings the shared matrix is the head and is counted once, in either case. A looped model's
    blocks count once (`distinct_blocks`), with the norms of their later-pass layouts where those differ.
    """
    d, V = config.d_model, config.vocab_size
    q_dim, kv_dim = config.n_heads * config.head_dim, config.kv_heads * config.head_dim
    scheme = build_scheme(config)
    attn = d * q_dim + 2 * d * kv_dim + q_dim * d
    if scheme.qkv_norm:
        attn += q_dim + 2 * kv_dim
    ffn = (3 if config.ffn == "swiglu" else 2) * d * config.ffn_dim
    norms = 0
    for index in range(config.distinct_blocks):
        for layout in block_specs(config, scheme, index):
            norms += sum(d * (spec.norm_in + spec.norm_out + spec.norm_branch) for spec in layout)
    total = config.distinct_blocks * (attn + ffn) + norms + (d if scheme.final_norm else 0) + V * d
    if not config.tie_embeddings:
        total += V * d if embedding else 0
    return total


def flops_per_token(config: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward): the standard `6 N + 12 n_layers d_attn T`.

    N counts every parameter that takes part in a matmul (all but the input embedding table); the
    second term is attention's scores and weighted sum (QK^T and AV, 2 * 2 * T * d_attn per token per
    block forward, times 3 for the backward) at context length T, counted without the causal mask's
    saving, as PaLM's MFU and nanoGPT do. A looped model computes as its unrolled twin does, so N is the
    unrolled model's.
    """
    T = config.max_seq_len if seq_len is None else seq_len
    n = count_params(replace(config, loop_blocks=None), embedding=False)
    return 6 * n + 12 * config.n_blocks * config.n_heads * config.head_dim * T
