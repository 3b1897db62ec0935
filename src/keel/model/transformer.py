"""The decoder-only causal LM: embedding, a stack of blocks, optional final norm, LM head."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from keel.model.architecture import ModelConfig
from keel.model.layers import Attention, KVCache, make_ffn, make_norm, rope_tables
from keel.model.numerics import upcast
from keel.model.schemes import SCHEMES, Scheme, SublayerSpec


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The one next-token loss: cross-entropy of (B, T, V) logits against (B, T) targets, computed in float32
    (bf16 logits would round the log-softmax); targets set to -100 are ignored. `targets` are the tokens to
    predict, already shifted: position t's target is the token after position t."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction=reduction)


def build_scheme(config: ModelConfig) -> Scheme:
    return SCHEMES[config.scheme](config.n_sublayers, **config.scheme_kwargs())


@dataclass(frozen=True)
class SublayerInfo:
    """One sub-layer as analysis tools see it; `path` names its `Residual` module."""

    index: int  # 0..L-1, the paper's layer index
    block: int  # its block in `blocks` (in a looped model, shared by every pass)
    kind: str  # "attn" or "ffn"
    scheme: str
    alpha: float
    norm_in: bool
    norm_out: bool
    norm_branch: bool
    path: str


def block_specs(config: ModelConfig, scheme: Scheme, index: int) -> tuple[tuple[SublayerSpec, ...], ...]:
    """The layouts block `index` (of `config.distinct_blocks`) takes: (attn, ffn) on its first pass, then, in a
    looped model whose later passes differ (Keel's first-layer rule, applied once), (attn, ffn) on the later ones."""
    first = (scheme.spec(2 * index, "attn"), scheme.spec(2 * index + 1, "ffn"))
    if config.distinct_blocks == config.n_blocks:  # one pass
        return (first,)
    later_index = index + config.loop_blocks  # the same block on the second pass
    later = (scheme.spec(2 * later_index, "attn"), scheme.spec(2 * later_index + 1, "ffn"))
    return (first,) if later == first else (first, later)


class Residual(nn.Module):
    """`x' = norm_out(alpha * x + norm_branch(F(norm_in(x))))`, absent norms skipped.

    The sum is always formed in (at least) float32, whatever autocast or the weights' dtype do: see
    `keel.model.numerics.stream_dtype` for why. (`apply_fused_junction`, in keel.scale's junction module, may swap
    a subclass in from outside that computes one sub-layer's norm_out and the next one's norm_in in one piece.)
    """

    def __init__(self, spec: SublayerSpec, make_norm: Callable[[], nn.Module], dropout: float = 0.0):
        super().__init__()
        self.alpha = float(spec.alpha)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        self.norm_in = make_norm() if spec.norm_in else None
        self.norm_branch = make_norm() if spec.norm_branch else None
        self.norm_out = make_norm() if spec.norm_out else None

    def forward(self, x: torch.Tensor, branch: Callable[..., torch.Tensor], *args) -> torch.Tensor:
        x = upcast(x)
        h = self.update(x if self.norm_in is None else self.norm_in(x), branch, *args)
        y = self.alpha * x + h.to(x.dtype)
        return y if self.norm_out is None else self.norm_out(y)

    def update(self, u: torch.Tensor, branch: Callable[..., torch.Tensor], *args) -> torch.Tensor:
        """`norm_branch(F(u))`, then dropout: what the sub-layer adds to `alpha * x`."""
        h = branch(u, *args)
        if self.norm_branch is not None:
            h = self.norm_branch(h)
        return h if self.dropout is None else self.dropout(h)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:g}"


class Block(nn.Module):
    """One attention sub-layer and one FFN sub-layer, each wrapped by its scheme's `Residual`.

    In a looped model, a block whose later passes have another layout than its first (block 0 under Keel's
    first-layer rule) also has `later_attn_res`/`later_ffn_res`: the same branches, their own norms.
    """

    def __init__(self, config: ModelConfig, scheme: Scheme, index: int):
        super().__init__()
        norm = partial(make_norm, config)
        specs = block_specs(config, scheme, index)
        self.attn = Attention(config, qkv_norm=scheme.qkv_norm, layer=index)
        self.ffn = make_ffn(config)
        self.attn_res = Residual(specs[0][0], norm, config.dropout)
        self.ffn_res = Residual(specs[0][1], norm, config.dropout)
        if len(specs) > 1:
            self.later_attn_res = Residual(specs[1][0], norm, config.dropout)
            self.later_ffn_res = Residual(specs[1][1], norm, config.dropout)

    def residuals(self, later: bool = False) -> tuple[Residual, Residual]:
        """(attn, ffn) residuals of the first pass, or of the later passes of a looped model."""
        if later and hasattr(self, "later_attn_res"):
            return self.later_attn_res, self.later_ffn_res
        return self.attn_res, self.ffn_res

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
                later: bool = False):
        attn_res, ffn_res = self.residuals(later)
        x = attn_res(x, self.attn, cos, sin, cache)
        return ffn_res(x, self.ffn)


class _LayerOffset:
    """A KV cache seen from one pass of a looped model: pass j's block b keeps its keys in slot j*k + b, so
    each unrolled attention sub-layer has its own slot although the weights are shared."""

    def __init__(self, cache, offset: int):
        self.cache, self.offset = cache, offset

    def get_seq_length(self, layer: int = 0) -> int:
        return self.cache.get_seq_length(layer + self.offset)

    def update(self, k, v, layer, *args, **kwargs):
        return self.cache.update(k, v, layer + self.offset, *args, **kwargs)


class TransformerLM(nn.Module):
    """A causal language model whose residual/normalisation scheme is `config.scheme`.

    `forward(idx, targets=None, cache=None)` takes token ids (B, T) and returns `(logits, loss)`; `targets` (B, T) are
    the next tokens, already shifted (`model(seq[:, :-1], targets=seq[:, 1:])`), -100 ignored. With a `KVCache` (or a
    `transformers` DynamicCache) `idx` continues the cached sequence. The residual stream is float32 throughout, also
    under autocast; looped models: docs/internals.md#keelmodeltransformertransformerlm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.scheme = build_scheme(config)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, self.scheme, i) for i in range(config.distinct_blocks))
        # Pre-LN-like schemes need a norm before the head; Post-LN-like ones (Keel included) already
        # end in one, so theirs is an explicit identity.
        self.final_norm = make_norm(config) if self.scheme.final_norm else nn.Identity()
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(config, config.max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @property
    def n_sublayers(self) -> int:
        """The paper's L: 2 * n_blocks."""
        return self.config.n_sublayers

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, init_std^2) for every weight matrix, 1 for every norm gain, then the scheme's gains."""
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif hasattr(module, "weight") and module.weight is not None and module.weight.dim() == 1:
                nn.init.ones_(module.weight)
        for i, block in enumerate(self.blocks):
            for index, kind, branch in ((2 * i, "attn", block.attn), (2 * i + 1, "ffn", block.ffn)):
                for name, param in branch.named_parameters():
                    if param.dim() > 1:
                        param.mul_(self.scheme.init_gain(index, kind, name))
        cos, sin = rope_tables(self.config, self.config.max_seq_len)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None):
        B, T = idx.shape
        start = 0 if cache is None else cache.get_seq_length()  # position of idx's first token
        if start + T > self.config.max_seq_len:
            raise ValueError(f"sequence length {start + T} exceeds ModelConfig.max_seq_len={self.config.max_seq_len}")
        logits = self.head(self.run_blocks(self.embed_tokens(idx), self.passes(cache), start))  # (B, T, V)
        if targets is None:
            return logits, None
        return logits, lm_loss(logits, targets)

    # forward's three pieces, which pipeline stages (keel.scale.pipeline) also run, each on its own share
    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        return upcast(self.embed(idx))  # (B, T, d): the stream is float32 from here to the head

    def run_blocks(self, x: torch.Tensor, passes, start: int = 0) -> torch.Tensor:
        """The stream `x` (B, T, d) through `passes`, (block, later, cache) triples as `passes()` yields them;
        `start` is the position of x's first token."""
        T = x.shape[1]
        cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]  # (T, hd) each
        for block, later, view in passes:
            x = block(x, cos, sin, view, later=later)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.final_norm(x).to(self.lm_head.weight.dtype))  # (B, T, V)

    def passes(self, cache=None):
        """(block, later, cache) for each of the n_blocks blocks the stream goes through, in order: every
        block once, or in a looped model the k blocks n_blocks/k times (`later` from the second pass on)."""
        k = len(self.blocks)
        for j in range(self.config.n_blocks // k):
            view = cache if j == 0 or cache is None else _LayerOffset(cache, j * k)
            for block in self.blocks:
                yield block, j > 0, view

    def sublayers(self) -> list[SublayerInfo]:
        """Every sub-layer in order, with its kind, scheme, alpha and norms; in a looped model every unrolled
        sub-layer, its `path` naming the (shared) `Residual` that computes it."""
        out = []
        k = len(self.blocks)
        for i in range(self.config.n_blocks):
            block, later = self.blocks[i % k], i >= k
            prefix = "later_" if later and hasattr(block, "later_attn_res") else ""
            for offset, kind, res in zip((0, 1), ("attn", "ffn"), block.residuals(later)):
                out.append(SublayerInfo(
                    index=2 * i + offset, block=i % k, kind=kind, scheme=self.config.scheme, alpha=res.alpha,
                    norm_in=res.norm_in is not None, norm_out=res.norm_out is not None,
                    norm_branch=res.norm_branch is not None, path=f"blocks.{i % k}.{prefix}{kind}_res",
                ))
        return out
