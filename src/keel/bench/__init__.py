"""Benchmarks: `keel bench`'s Keel-vs-Pre-LN comparison (core), the CPU suite (cpu), time per sub-layer against
depth (flatness), the GPU campaign (gpu) and its predicted time (gpu_plan), its command line (cli), and the
pipeline benchmark (pipeline).

The names `keel bench`'s flags offer live here, so its usage errors answer without torch's import (seconds)."""

CPU_PARTS = ("compare", "cold_warmup", "science", "flatness")  # `--suite cpu`'s parts, in order (cpu)
# `--suite gpu`'s sections, in order (gpu)
GPU_SECTIONS = ("tests", "kernel", "warmup", "compare", "depth", "max_depth")
# the campaign in parts of at most 8 minutes each (their sections' time boxes add up to 420-480 s), for the short
# windows in which a GPU is lent: `keel bench --suite gpu --sections <part's sections> --out <dir per part>`
GPU_PARTS = {"tests": ("tests",), "kernel": ("kernel", "warmup"), "model": ("compare",),
             "depth": ("depth", "max_depth")}
MODELLED_GPUS = ("H100", "H200", "A100")  # the GPUs `--model-gpu` predicts (perf_model.DEVICES' keys)
