"""Time per sub-layer from 128 to 1024 sub-layers with run.compile=true (the bench's flatness section is eager):
CPU_FLATNESS's shape, one thread. Usage: python benchmarks/cpu/flatness/compiled.py [SUBLAYERS [REPEATS]]"""
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(BENCHMARKS / "gpu"), str(BENCHMARKS / "cpu")]  # flatness.py, suite.py

import torch  # noqa: E402
from flatness import flatness_markdown, flatness_series  # noqa: E402
from suite import CPU_FLATNESS  # noqa: E402

from keel.config import RunConfig  # noqa: E402
from keel.model import ModelConfig  # noqa: E402

torch.set_num_threads(1)
f = CPU_FLATNESS
subl = tuple(int(x) for x in sys.argv[1].split(",")) if len(sys.argv) > 1 else f["sublayers"]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else f["repeats"]
run = RunConfig(batch_size=f["batch_size"], seq_len=f["seq_len"], dtype="float32", compile=True)
s = flatness_series(ModelConfig(**f["model"]), run, subl, steps=f["steps"], warmup=3, repeats=reps)
print("\n".join(flatness_markdown(s, "compiled")))
