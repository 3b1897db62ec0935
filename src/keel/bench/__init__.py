"""Benchmarks a user runs: `keel bench`'s Keel-vs-Pre-LN comparison (core) and its command line (cli), the
performance model (perf_model, with its fitted coefficients in calibrated_gpu.json) and its tables (perf_report).
The project's own CPU suite, pipeline timing and GPU campaign, and the measured GPU figures the model is fitted
to, live in the repository's benchmarks/ folder.

The names `keel bench`'s flags offer live here, so its usage errors answer without torch's import (seconds)."""

MODELLED_GPUS = ("H100", "H200", "A100")  # the GPUs `--model-gpu` predicts (perf_model.DEVICES' keys)
