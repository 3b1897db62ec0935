"""Benchmarks: `keel bench`'s Keel-vs-Pre-LN comparison (core), the CPU suite (cpu), the GPU campaign (gpu),
its command line (cli), and the pipeline benchmark (pipeline)."""
