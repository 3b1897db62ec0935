"""Where a cold compile's time goes: one scheme's first compiled training step at the GPU suite's warm-up shape, in
this process, with empty Inductor and Triton caches of its own, then torch's per-phase compile times.

    python benchmarks/gpu/warmup_profile.py SCHEME FUSED_JUNCTION   # e.g. keel auto; run each in a fresh process
"""

import json
import os
import sys
import tempfile
import time

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()

import torch  # noqa: E402
from campaign import GpuSuite  # noqa: E402
from torch._dynamo.utils import compile_times  # noqa: E402

from keel.bench.core import Bench  # noqa: E402

scheme, fused = sys.argv[1], sys.argv[2]
suite = GpuSuite.toy() if not torch.cuda.is_available() else GpuSuite()
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
start = time.monotonic()
b = Bench(suite.model(suite.warmup_sublayers, scheme), suite.run(compile=True, fused_junction=fused),
          **suite.bench_options(device))
built = time.monotonic() - start
b.step()
first = time.monotonic() - start - built
b.step()
print(json.dumps({"scheme": scheme, "fused_junction": fused, "build_s": built, "first_step_s": first,
                  "second_step_s": b.times[-1]}))
print(compile_times(repr="str", aggregate=True))
