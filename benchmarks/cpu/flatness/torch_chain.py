"""A control without keel: the backward pass of a plain torch chain of LayerNorm -> Linear -> GELU -> Linear
blocks (d=32, 16 tokens, one thread), time per block at 128 and 1024 blocks. If this grows like keel's time per
sub-layer, the growth is torch's (autograd engine, allocator, caches), not keel's code."""
import time

import torch

torch.set_num_threads(1)
for n in (128, 1024):
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 96),
                                                       torch.nn.GELU(), torch.nn.Linear(96, 32)) for _ in range(n)])
    x = torch.randn(16, 32)
    for _ in range(3):
        layers(x).sum().backward()
    times = []
    for _ in range(7):
        for p in layers.parameters():
            p.grad = None
        y = layers(x).sum()
        t = time.perf_counter()
        y.backward()
        times.append(time.perf_counter() - t)
    print(n, "backward us per block (plain torch chain)", round(1e6 * sorted(times)[3] / n, 1))
