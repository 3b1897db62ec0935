"""Data: corpora (`corpus`), tokenizers (`tokenizer`), and cached token shards with their samplers (`loader`).

The names below load on first use: `corpus` (DataConfig) needs no torch, so reading or checking a config
answers without torch's import (seconds); `loader` imports it.
"""

from keel._lazy import lazy_names
from keel.errors import DataError

__getattr__, __dir__, _NAMES = lazy_names(__name__, {
    "corpus": ("Corpus", "DataConfig", "build_corpus"),
    "loader": ("Prepared", "WindowSampler", "eval_batches", "prepare"),
})

__all__ = ["DataError", *_NAMES]
