"""The model, and only the model: its architecture config, schemes, layers, the transformer, named sizes and counts.

Its modules import nothing from keel outside this package (a test enforces it): they are exactly the code that
`keel export-hf` ships beside the weights, so an exported model loads where keel is not installed.

The names below load on first use: `architecture`, `schemes` and `sizes` need no torch, so reading or checking a
config (`keel train model.nope=1`, `keel runs`) answers without torch's import (seconds).
"""

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
