"""Data: corpora (`corpus`), tokenizers (`tokenizer`), and cached token shards with their samplers (`loader`)."""

from keel.data.corpus import Corpus, DataConfig, build_corpus
from keel.data.loader import Prepared, WindowSampler, eval_batches, prepare
from keel.errors import DataError

__all__ = ["Corpus", "DataConfig", "DataError", "Prepared", "WindowSampler", "build_corpus", "eval_batches",
           "prepare"]
