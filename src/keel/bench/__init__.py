"""Benchmarks: `keel bench`'s Keel-vs-Pre-LN comparison (core), the CPU suite (cpu), the GPU campaign (gpu),
its command line (cli), and the pipeline benchmark (pipeline).

The names `keel bench`'s flags offer live here, so its usage errors answer without torch's import (seconds)."""

GPU_SECTIONS = ("tests", "kernel", "compare", "depth", "max_depth")  # `--suite gpu`'s sections, in order (gpu)
MODELLED_GPUS = ("H100", "H200", "A100")  # the GPUs `--model-gpu` predicts (perf_model.DEVICES' keys)
