"""The Llama-style parts: norms, rotary embeddings, grouped-query attention, FFNs.

None of this knows about residual schemes: a scheme only decides where norms sit around these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from keel.model.architecture import ModelConfig
from keel.model.numerics import upcast


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x` in the dtype the branch's matmuls compute in: autocast's where it is on (cast once here, not again by
    each of the branch's matmuls), else the weights'. The values are those autocast would have made."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x.to(weight.dtype)


class _GainNorm(nn.Module):
    """A norm's parameters: a learnable gain (init 1), no bias, and eps."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))


class RMSNorm(_GainNorm):
    """`x / rms(x) * gain`, learnable gain, no bias; computed in float32 (as Llama does).

    The output stays float32 for a float32 input even when the gain is bf16, so a norm on the
    residual stream never drops the stream to low precision.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class LayerNorm(_GainNorm):
    """LayerNorm with learnable gain and no bias, computed in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        out = F.layer_norm(xf, (x.shape[-1],), self.weight.to(xf.dtype), None, self.eps)
        return out.to(torch.promote_types(x.dtype, self.weight.dtype))


def make_norm(config: ModelConfig, dim: int | None = None) -> nn.Module:
    cls = RMSNorm if config.norm == "rmsnorm" else LayerNorm
    return cls(config.d_model if dim is None else dim, config.norm_eps)


def rope_tables(config: ModelConfig, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (seq_len, head_dim), in Hugging Face Llama's half-split layout."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, dim/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, dim)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, hd) queries or keys by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class KVCache:
    """The keys and values of every position seen so far, per attention layer, for incremental decoding.

    It has the `update(k, v, layer)` and `get_seq_length()` methods of `transformers`' `DynamicCache`,
    so the Hugging Face wrapper hands that cache to the model unchanged.
    """

    def __init__(self):
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def get_seq_length(self, layer: int = 0) -> int:
        return self.layers[layer][0].shape[-2] if layer < len(self.layers) else 0

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, KV, T, hd) keys and values for `layer`; return all of that layer's, (B, KV, S, hd)."""
        if layer == len(self.layers):
            self.layers.append((k, v))
        else:
            past_k, past_v = self.layers[layer]
            self.layers[layer] = (torch.cat((past_k, k), dim=-2), torch.cat((past_v, v), dim=-2))
        return self.layers[layer]


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE, through PyTorch's fused SDPA kernel.

    `layer` is this attention's index in the stack, its slot in a KV cache.
    """

    def __init__(self, config: ModelConfig, qkv_norm: bool = False, layer: int = 0):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.dropout = config.dropout
        self.wq = nn.Linear(config.d_model, q_dim, bias=False)
        self.wk = nn.Linear(config.d_model, kv_dim, bias=False)
        self.wv = nn.Linear(config.d_model, kv_dim, bias=False)
        self.wo = nn.Linear(q_dim, config.d_model, bias=False)
        if qkv_norm:
            self.q_norm = make_norm(config, q_dim)
            self.k_norm = make_norm(config, kv_dim)
            self.v_norm = make_norm(config, kv_dim)
        else:
            self.q_norm = self.k_norm = self.v_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        """`cos`/`sin` start at the position of x's first token; `cache` (a KVCache) holds the earlier ones."""
        B, T, _ = x.shape
        x = compute_dtype(x, self.wq.weight)  # the stream is float32; compute in the matmuls' dtype
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # (B, T, H*hd), (B, T, KV*hd) x2
        if self.q_norm is not None:
            q, k, v = self.q_norm(q), self.k_norm(k), self.v_norm(v)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])
        mask = None
        if cache is not None:
            k, v = cache.update(k, v, self.layer)  # (B, KV, S, hd): S - T cached positions, then these T
            S = k.shape[-2]
            # SDPA's is_causal aligns the mask top-left, wrong when S > T: query i sees keys <= S - T + i
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T) if S > T else None
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )  # (B, H, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`, as in Llama."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.w_up = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.w_down = nn.Linear(config.ffn_dim, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = compute_dtype(x, self.w_up.weight)
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class GeluFFN(nn.Module):
    """`down(gelu(up(x)))`, the original Transformer/GPT-2 FFN without biases."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w_up = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.w_down = nn.Linear(config.ffn_dim, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.gelu(self.w_up(compute_dtype(x, self.w_up.weight))))


def make_ffn(config: ModelConfig) -> nn.Module:
    return SwiGLU(config) if config.ffn == "swiglu" else GeluFFN(config)
