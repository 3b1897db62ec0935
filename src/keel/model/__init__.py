"""The model, and only the model: it imports nothing from keel outside this package, since `keel export-hf` ships it
beside the weights (docs/internals.md#keelmodel)."""

from keel._lazy import lazy_names

__getattr__, __dir__, _NAMES = lazy_names(__name__, {
    "architecture": ("CONFIG_FIELDS", "ModelConfig"),
    "counting": ("count_params", "flops_per_token"),
    "sizes": ("PRESETS", "cpu_demo", "paper", "paper_64", "paper_128", "paper_512", "paper_1024", "paper_2048",
              "preset", "tiny"),
    "schemes": ("SCHEMES", "Scheme"),
    "transformer": ("Residual", "SublayerInfo", "TransformerLM", "lm_loss"),
})

__all__ = _NAMES
