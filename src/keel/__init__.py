"""Keel: deep Transformer language models with the Keel residual connection and its baselines. `import keel` loads
nothing heavy and changes nothing process-wide (docs/internals.md#keel)."""

from keel._lazy import lazy_names
from keel._version import __version__

# keel.model (and torch with it) loads on first use, not on `import keel`: the `keel` command imports this package
# before it can catch Ctrl-C, and torch takes seconds to import
__getattr__, __dir__, _MODEL = lazy_names(__name__, {"model": (
    "ModelConfig", "TransformerLM", "SublayerInfo", "SCHEMES", "PRESETS", "preset", "tiny", "cpu_demo", "paper_64",
    "paper_128", "paper_512", "paper_1024", "paper_2048", "count_params", "flops_per_token")})
__all__ = [*_MODEL, "__version__"]
