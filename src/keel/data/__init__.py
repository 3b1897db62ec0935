"""Data: corpora (`corpus`), tokenizers (`tokenizer`), and cached token shards with their samplers (`loader`), loaded
on first use (docs/internals.md#keeldata)."""

from keel._lazy import lazy_names
from keel.errors import DataError

__getattr__, __dir__, _NAMES = lazy_names(__name__, {
    "corpus": ("Corpus", "DataConfig", "build_corpus"),
    "loader": ("Prepared", "WindowSampler", "eval_batches", "prepare"),
})

__all__ = ["DataError", *_NAMES]
