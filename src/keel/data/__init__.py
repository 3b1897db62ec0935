"""Data: corpora (`corpus`), tokenizers (`tokenizer`), and cached token shards with their samplers (`loader`).

The names below load on first use: `corpus` (DataConfig) needs no torch, so reading or checking a config
answers without torch's import (seconds); `loader` imports it.
"""

import importlib

from keel.errors import DataError

_HOMES = {
    "corpus": ("Corpus", "DataConfig", "build_corpus"),
    "loader": ("Prepared", "WindowSampler", "eval_batches", "prepare"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}

__all__ = ["DataError", *_HOME]


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(importlib.import_module(f"keel.data.{_HOME[name]}"), name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module 'keel.data' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
