"""Where the time of one TrainStep goes at 128 and 1024 sub-layers (d=32, 16 tokens, one thread): cProfile's
top functions by own time. (The RuntimeWarning about import order does not matter for a one-thread profile.)"""
import cProfile
import io
import pstats
import time

import torch

import keel  # noqa: F401
from keel.config import OptimConfig
from keel.model import ModelConfig, TransformerLM
from keel.train.optim import build_optimizer
from keel.train.step import TrainStep

torch.set_num_threads(1)


def make(n: int):
    cfg = ModelConfig(vocab_size=256, d_model=32, n_blocks=n // 2, n_heads=4, n_kv_heads=2, d_ffn=96, max_seq_len=16)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    ids = torch.randint(0, 256, (1, 17))
    return TrainStep(model, build_optimizer(model, OptimConfig())), (lambda: (ids[:, :-1], ids[:, 1:]))


for n in (128, 1024):
    step, batch = make(n)
    for _ in range(2):
        step(batch, 1e-3)
    start = time.perf_counter()
    for _ in range(5):
        step(batch, 1e-3)
    per = (time.perf_counter() - start) / 5
    profile = cProfile.Profile()
    profile.enable()
    step(batch, 1e-3)
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(12)
    print(n, "ms per sub-layer", round(1e3 * per / n, 3))
    print("\n".join(out.getvalue().splitlines()[6:22]))
    del step
