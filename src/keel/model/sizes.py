"""Named model sizes, one function each; every function takes field overrides as keywords.

The paper's shapes follow its Table 8 (d=1024, 16 query heads, 8 KV heads, FFN 3x). The paper names
its models by sub-layers (L), so `paper_512` has 512 sub-layers = 256 blocks. Its vocabulary is not
stated; 32000 (a Llama-2-sized BPE vocabulary) is the default here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from keel.model.architecture import ModelConfig


def tiny(**overrides) -> ModelConfig:
    """For tests: 2 blocks of width 64 over bytes."""
    return replace(ModelConfig(vocab_size=256, d_model=64, n_blocks=2, n_heads=4, n_kv_heads=2,
                               d_ffn=192, max_seq_len=64), **overrides)


def cpu_demo(**overrides) -> ModelConfig:
    """A deep, narrow model that trains visibly on 2 CPU cores in minutes: 32 sub-layers, d=128."""
    return replace(ModelConfig(vocab_size=256, d_model=128, n_blocks=16, n_heads=4, n_kv_heads=2,
                               d_ffn=384, max_seq_len=256), **overrides)


def science(**overrides) -> ModelConfig:
    """The science experiments' base model (keel.experiments), d=64, 4 query / 2 KV heads, over bytes; each sweep
    point sets its scheme and depth (so it is not a `--preset`). benchmarks/cpu/suite.py times this shape."""
    return replace(ModelConfig(vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2, max_seq_len=64), **overrides)


def _paper(n_sublayers: int, overrides: dict) -> ModelConfig:
    base = ModelConfig(vocab_size=32000, d_model=1024, n_blocks=n_sublayers // 2, n_heads=16,
                       n_kv_heads=8, d_ffn=3072, max_seq_len=4096)
    return replace(base, **overrides)


def paper_64(**overrides) -> ModelConfig:
    """The paper's 64-sub-layer model (32 blocks), d=1024."""
    return _paper(64, overrides)


def paper_128(**overrides) -> ModelConfig:
    """The paper's 128-sub-layer model (64 blocks), d=1024."""
    return _paper(128, overrides)


def paper_512(**overrides) -> ModelConfig:
    """The paper's main 512-sub-layer model (256 blocks), d=1024, about 3B parameters."""
    return _paper(512, overrides)


def paper_1024(**overrides) -> ModelConfig:
    """The paper's deepest 1024-sub-layer model (512 blocks), d=1024."""
    return _paper(1024, overrides)


def paper_2048(**overrides) -> ModelConfig:
    """2048 sub-layers (1024 blocks), d=1024: twice the paper's deepest, about 13B parameters."""
    return _paper(2048, overrides)


PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "tiny": tiny,
    "cpu-demo": cpu_demo,
    "paper-64": paper_64,
    "paper-128": paper_128,
    "paper-512": paper_512,
    "paper-1024": paper_1024,
    "paper-2048": paper_2048,
}


def preset(name: str, **overrides) -> ModelConfig:
    """The preset called `name` (see PRESETS), with field overrides."""
    if name not in PRESETS:
        raise ValueError(f"preset: unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
    return PRESETS[name](**overrides)
