"""Named model sizes, each taking field overrides as keywords; the paper's follow its Table 8 and are named by
sub-layers (docs/internals.md#keelmodelsizes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

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


def paper(n_sublayers: int, **overrides) -> ModelConfig:
    """The paper's model of `n_sublayers` sub-layers (n_sublayers / 2 blocks), d=1024: its own depths are 64, 128,
    512 (its main model, about 3B parameters) and 1024 (its deepest); 2048 (about 13B) is twice that."""
    base = ModelConfig(vocab_size=32000, d_model=1024, n_blocks=n_sublayers // 2, n_heads=16,
                       n_kv_heads=8, d_ffn=3072, max_seq_len=4096)
    return replace(base, **overrides)


PAPER = {n: partial(paper, n) for n in (64, 128, 512, 1024, 2048)}  # each preset at the top level too: keel.paper_512
paper_64, paper_128, paper_512, paper_1024, paper_2048 = PAPER.values()
PRESETS: dict[str, Callable[..., ModelConfig]] = {"tiny": tiny, "cpu-demo": cpu_demo,
                                                  **{f"paper-{n}": fn for n, fn in PAPER.items()}}


def preset(name: str, **overrides) -> ModelConfig:
    """The preset called `name` (see PRESETS), with field overrides."""
    if name not in PRESETS:
        raise ValueError(f"preset: unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
    return PRESETS[name](**overrides)
