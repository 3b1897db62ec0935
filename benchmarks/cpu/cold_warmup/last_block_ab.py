"""A/B in one process: compiled Keel with the last block handing on a pair (twin, 2 graphs), without it (3 graphs),
and Pre-LN; alternating steps; per-repeat ratios."""
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/cpu: suite.py

import torch  # noqa: E402
from suite import CPU_SHAPES  # noqa: E402
from torch import nn  # noqa: E402

from keel.bench.core import Bench, alternate, scheme_config  # noqa: E402
from keel.config import RunConfig  # noqa: E402
from keel.model.sizes import cpu_demo  # noqa: E402
from keel.scale.fused_junction import FusedResidual  # noqa: E402

shape, steps, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
over, batch, seq = CPU_SHAPES[shape]
cfg = cpu_demo(**over)
run = RunConfig(batch_size=batch, seq_len=seq, dtype="float32", compile=True)
torch._dynamo.reset()
benches = {"twin": Bench(scheme_config(cfg, "keel"), run), "three": Bench(scheme_config(cfg, "keel"), run),
           "pre_ln": Bench(scheme_config(cfg, "pre_ln"), run)}
m = benches["three"].model
last = [x for x in m.modules() if isinstance(x, FusedResidual) and x.hands_head]
assert len(last) == 1
last[0].junction, last[0].hands_head = None, False
m.final_norm = nn.Identity()
alternate(benches, steps, 3)
for _ in range(repeats - 1):
    alternate(benches, steps, 0)
per = [{k: statistics.median(b.times[r * steps:(r + 1) * steps]) for k, b in benches.items()} for r in range(repeats)]
out = {"shape": shape, "per_repeat_ms": [{k: 1e3 * v for k, v in p.items()} for p in per],
       "twin/pre_ln": [p["twin"] / p["pre_ln"] for p in per], "three/pre_ln": [p["three"] / p["pre_ln"] for p in per],
       "twin/three": [p["twin"] / p["three"] for p in per],
       "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}
print(json.dumps(out))
