"""The engine studies run on (docs/experiments.md#the-engine-module-by-module); the studies live in research/."""
