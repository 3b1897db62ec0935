"""Keel: deep Transformer language models with the Keel residual connection and its baselines."""

from keel.config import ModelConfig
from keel.counting import count_params, flops_per_token
from keel.hf import register_on_transformers_import
from keel.model import SublayerInfo, TransformerLM
from keel.presets import PRESETS, cpu_demo, paper_64, paper_128, paper_512, paper_1024, preset, tiny
from keel.schemes import SCHEMES

register_on_transformers_import()  # KeelConfig / KeelForCausalLM with the Auto classes, when transformers loads

__version__ = "0.1.0"

__all__ = [
    "ModelConfig", "TransformerLM", "SublayerInfo", "SCHEMES", "PRESETS", "preset", "tiny", "cpu_demo",
    "paper_64", "paper_128", "paper_512", "paper_1024", "count_params", "flops_per_token", "__version__",
]
