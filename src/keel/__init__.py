"""Keel: deep Transformer language models with the Keel residual connection and its baselines.

`import keel` loads the model and nothing of Hugging Face: `keel.hf.register()` registers `KeelConfig` and
`KeelForCausalLM` with `transformers`' Auto classes when you want them.
"""

from keel._version import __version__
from keel.model import (
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

__all__ = [
    "ModelConfig", "TransformerLM", "SublayerInfo", "SCHEMES", "PRESETS", "preset", "tiny", "cpu_demo",
    "paper_64", "paper_128", "paper_512", "paper_1024", "count_params", "flops_per_token", "__version__",
]
