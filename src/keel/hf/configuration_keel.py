"""`KeelConfig`: a `transformers` config holding the fields of `keel.model.architecture.ModelConfig`.

`keel export-hf` copies this file into an exported directory with its `keel` imports made relative, so
keep every import of this project on one `from keel.<module> import ...` line.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from keel.model.architecture import CONFIG_FIELDS, ModelConfig


class KeelConfig(PretrainedConfig):
    """Every `ModelConfig` field under its own name; `model_config()` rebuilds (and validates) it.

    The usual `transformers` names (`hidden_size`, `num_hidden_layers`, ...) are aliases, so generic
    tools (caches, lm-evaluation-harness's context length) read the right fields.
    """

    model_type = "keel"
    attribute_map = {
        "hidden_size": "d_model", "num_hidden_layers": "n_blocks", "num_attention_heads": "n_heads",
        "max_position_embeddings": "max_seq_len",
    }

    def __init__(self, **kwargs):
        defaults = ModelConfig()
        for name in CONFIG_FIELDS:
            setattr(self, name, kwargs.pop(name, getattr(defaults, name)))
        kwargs["tie_word_embeddings"] = self.tie_embeddings  # transformers ties the head by this flag
        super().__init__(**kwargs)

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs) -> KeelConfig:
        return cls(**{name: getattr(config, name) for name in CONFIG_FIELDS}, **kwargs)

    def model_config(self) -> ModelConfig:
        return ModelConfig(**{name: getattr(self, name) for name in CONFIG_FIELDS})
