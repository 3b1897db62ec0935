"""Keel: deep Transformer language models with the Keel residual connection and its baselines."""

__version__ = "0.1.0"

from keel.hf import register_on_transformers_import  # noqa: E402
from keel.model import (  # noqa: E402
    PRESETS,
    SCHEMES,
    ModelConfig,
    SublayerInfo,
    TransformerLM,
    count_params,
    cpu_demo,
    flops_per_token,
    paper_64,
    paper_128,
    paper_512,
    paper_1024,
    preset,
    tiny,
)

register_on_transformers_import()  # KeelConfig / KeelForCausalLM with the Auto classes, when transformers loads

__all__ = [
    "ModelConfig", "TransformerLM", "SublayerInfo", "SCHEMES", "PRESETS", "preset", "tiny", "cpu_demo",
    "paper_64", "paper_128", "paper_512", "paper_1024", "count_params", "flops_per_token", "__version__",
]
