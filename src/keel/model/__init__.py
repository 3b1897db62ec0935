"""The model, and only the model: config, schemes, layers, the transformer, presets and counts.

This package imports nothing from keel outside itself (a test enforces it): it is exactly the code that
`keel export-hf` ships beside the weights, so an exported model loads where keel is not installed.
"""

from keel.model.config import CONFIG_FIELDS, ModelConfig
from keel.model.counting import count_params, flops_per_token
from keel.model.presets import PRESETS, cpu_demo, paper_64, paper_128, paper_512, paper_1024, preset, tiny
from keel.model.schemes import SCHEMES, Residual, Scheme
from keel.model.transformer import SublayerInfo, TransformerLM, lm_loss

__all__ = ["CONFIG_FIELDS", "ModelConfig", "count_params", "flops_per_token", "PRESETS", "cpu_demo", "paper_64",
           "paper_128", "paper_512", "paper_1024", "preset", "tiny", "SCHEMES", "Residual", "Scheme", "SublayerInfo",
           "TransformerLM", "lm_loss"]
