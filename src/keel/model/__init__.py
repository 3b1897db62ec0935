"""The model, and only the model: config, schemes, layers, the transformer, presets and counts.

This package imports nothing from keel outside itself (a test enforces it): it is exactly the code that
`keel export-hf` ships beside the weights, so an exported model loads where keel is not installed.

The names below load on first use: `config`, `schemes` and `presets` need no torch, so reading or checking a
config (`keel train model.nope=1`, `keel runs`) answers without torch's import (seconds).
"""

import importlib

_HOMES = {
    "config": ("CONFIG_FIELDS", "ModelConfig"),
    "counting": ("count_params", "flops_per_token"),
    "presets": ("PRESETS", "cpu_demo", "paper_64", "paper_128", "paper_512", "paper_1024", "preset", "tiny"),
    "schemes": ("SCHEMES", "Scheme"),
    "transformer": ("Residual", "SublayerInfo", "TransformerLM", "lm_loss"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}

__all__ = list(_HOME)


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(importlib.import_module(f"keel.model.{_HOME[name]}"), name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module 'keel.model' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
