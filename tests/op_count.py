"""ATen operators counted at dispatch (`OpCounter`), and the operators one sub-layer adds to an eager training step:
an operator count independent of the profiler and of the performance model's launch counts."""

from collections import Counter
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from keel.model import ModelConfig, TransformerLM


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators run inside it, by name (`ops`)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def aten_ops_per_sublayer(config: ModelConfig, blocks: tuple[int, int] = (4, 8)) -> float:
    """ATen operators one sub-layer adds to an eager training step (forward and backward), counted by a dispatch
    mode at two depths and differenced, so the embedding, head and loss drop out. Host time per step on a GPU is
    about this count times the launch cost."""
    totals = []
    for n in blocks:
        c = replace(config, n_blocks=n)
        model = TransformerLM(c)
        ids = torch.randint(0, c.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
        with OpCounter() as count:
            model(ids[:, :-1], ids[:, 1:])[1].backward()
        totals.append(sum(count.ops.values()))
    return (totals[1] - totals[0]) / (2 * (blocks[1] - blocks[0]))

