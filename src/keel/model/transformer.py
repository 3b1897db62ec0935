"""The decoder-only causal LM: embedding, a stack of blocks, optional final norm, LM head."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from keel.model.config import ModelConfig
from keel.model.layers import Attention, KVCache, make_ffn, make_norm, rope_tables
from keel.model.numerics import upcast
from keel.model.schemes import SCHEMES, Residual, Scheme


def build_scheme(config: ModelConfig) -> Scheme:
    return SCHEMES[config.scheme](config.n_sublayers, **config.scheme_kwargs())


@dataclass(frozen=True)
class SublayerInfo:
    """One sub-layer as analysis tools see it; `path` names its `Residual` module."""

    index: int  # 0..L-1, the paper's layer index
    block: int
    kind: str  # "attn" or "ffn"
    scheme: str
    alpha: float
    norm_in: bool
    norm_out: bool
    norm_branch: bool
    path: str


class Block(nn.Module):
    """One attention sub-layer and one FFN sub-layer, each wrapped by its scheme's `Residual`."""

    def __init__(self, config: ModelConfig, scheme: Scheme, index: int):
        super().__init__()
        norm = partial(make_norm, config)
        self.attn = Attention(config, qkv_norm=scheme.qkv_norm, layer=index)
        self.ffn = make_ffn(config)
        self.attn_res = Residual(scheme.spec(2 * index, "attn"), norm, config.dropout)
        self.ffn_res = Residual(scheme.spec(2 * index + 1, "ffn"), norm, config.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None):
        x = self.attn_res(x, self.attn, cos, sin, cache)
        return self.ffn_res(x, self.ffn)


class TransformerLM(nn.Module):
    """A causal language model whose residual/normalisation scheme is `config.scheme`.

    `forward(idx, targets=None, cache=None)` takes token ids (B, T) and returns `(logits, loss)`; loss is
    the mean next-token cross-entropy when `targets` (B, T) is given (positions set to -100 are ignored),
    else None. With a `KVCache` (or a `transformers` DynamicCache), `idx` continues the sequence the cache
    holds: its keys and values are reused and `idx`'s are appended. The residual stream is float32
    throughout, also under autocast.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.scheme = build_scheme(config)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, self.scheme, i) for i in range(config.n_blocks))
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
        x = upcast(self.embed(idx))  # (B, T, d): the stream is float32 from here to the head
        cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]  # (T, hd) each
        for block in self.blocks:
            x = block(x, cos, sin, cache)
        x = self.final_norm(x)
        logits = self.lm_head(x.to(self.lm_head.weight.dtype))  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
        return logits, loss

    def sublayers(self) -> list[SublayerInfo]:
        """Every sub-layer in order, with its kind, scheme, alpha and norms."""
        out = []
        for i, block in enumerate(self.blocks):
            for offset, kind, res in ((0, "attn", block.attn_res), (1, "ffn", block.ffn_res)):
                out.append(SublayerInfo(
                    index=2 * i + offset, block=i, kind=kind, scheme=self.config.scheme, alpha=res.alpha,
                    norm_in=res.norm_in is not None, norm_out=res.norm_out is not None,
                    norm_branch=res.norm_branch is not None, path=f"blocks.{i}.{kind}_res",
                ))
        return out
