"""Scoring by log-likelihood on an in-memory model, shared by the probes and the harness adapter.

Under torch.distributed the ranks are data-parallel replicas of one model (plain, DDP or FSDP2; not pipeline
stages): each scores every world-th item and the counts are summed, so one process and several give the same
score. Every rank runs as many forward passes as every other (a rank short of items runs one it does not
count), since FSDP2 all-gathers weights in each.
"""

from __future__ import annotations

import contextlib
import math
import random

import numpy as np
import torch
import torch.distributed as dist

from keel.data.corpus import DataConfig
from keel.errors import DataError
from keel.evals.tasks import HarnessTask, Probe, Task


def world() -> tuple[int, int]:
    """(rank, world size): (0, 1) outside torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_sum(values: list[float], device) -> list[float]:
    """`values` summed over all ranks (float64, so counts stay exact)."""
    if world()[1] == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


class Scorer:
    """Total log-likelihoods of continuations after contexts, with the context cut from the left so that
    context + continuation fits `max_seq_len` (the model's, by default)."""

    def __init__(self, model, tokenizer, device, autocast=contextlib.nullcontext, max_seq_len: int | None = None):
        self.model, self.tokenizer, self.device, self.autocast = model, tokenizer, torch.device(device), autocast
        self.max_seq_len = max_seq_len or model.config.max_seq_len
        # an empty context still needs one token to predict from: EOS where the tokenizer has one, else byte 0
        # (NUL), as `keel lm-eval` gives the harness
        self.prefix = tokenizer.eos_id if tokenizer.eos_id is not None else 0

    def encode(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation tokenised apart, so every choice of an item shares the context's tokens."""
        return self.tokenizer.encode(context) or [self.prefix], list(self.tokenizer.encode(continuation))

    @torch.no_grad()
    def loglikelihoods(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(total log-probability of the continuation, whether greedy decoding would produce it) for each
        (context ids, continuation ids) pair, in one forward pass (right-padded: padding after a sequence does
        not change a causal model's outputs on it)."""
        rows, spans = [], []
        for ctx, cont in pairs:
            ids = (ctx + cont)[-(self.max_seq_len + 1):]  # (<= L + 1): inputs ids[:-1], targets ids[1:]
            n = min(len(cont), len(ids) - 1)
            rows.append(ids)
            spans.append((len(ids) - 1 - n, len(ids) - 1))  # positions (in the inputs) that predict cont
        T = max(len(r) for r in rows) - 1
        x = torch.zeros(len(rows), T, dtype=torch.long)
        for i, r in enumerate(rows):
            x[i, :len(r) - 1] = torch.tensor(r[:-1])
        with self.autocast():
            logits, _ = self.model(x.to(self.device))  # (B, T, V)
        logp = logits.float().log_softmax(-1).cpu()
        out = []
        for i, ((start, end), r) in enumerate(zip(spans, rows)):
            target = torch.tensor(r[start + 1:end + 1])
            lp = logp[i, start:end]  # (n, V)
            out.append((lp.gather(1, target[:, None]).sum().item(), bool((lp.argmax(-1) == target).all())))
        return out


@contextlib.contextmanager
def untouched(model, device):
    """The model in eval mode while scoring, then back in the mode it was in; the torch (CPU and this CUDA
    device), Python and NumPy generators restored, so a run that scores resumes bit for bit like one that
    does not (dropout is off in eval mode, and the harness seeds all three generators). A compiled model compiles
    nothing new here: its blocks compile static (keel.scale.parallel.apply_compile), and every scored batch has a
    shape of its own, so shapes it has no graph for run eager (`eager_on_recompile`) rather than spend compiles and
    the recompile limit that training's graphs share."""
    was_training = model.training
    device = torch.device(device)
    devices = [device.index or 0] if device.type == "cuda" else []
    py_state, np_state = random.getstate(), np.random.get_state()
    model.eval()
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), torch.compiler.set_stance("eager_on_recompile"):
            yield
    finally:
        model.train(was_training)
        random.setstate(py_state)
        np.random.set_state(np_state)


def score_probe(scorer: Scorer, probe: Probe, items: list[dict]) -> dict:
    """Accuracy of the highest total log-likelihood choice (`acc`) and of the highest per byte (`acc_norm`)."""
    rank, size = world()
    mine = items[rank::size]
    correct = correct_norm = 0
    for i in range(math.ceil(len(items) / size)):
        item = mine[i] if i < len(mine) else items[0]  # a rank short of items runs one it does not count
        ctx = scorer.tokenizer.encode(item["context"]) or [scorer.prefix]
        scores = [ll for ll, _ in scorer.loglikelihoods([(ctx, scorer.tokenizer.encode(c)) for c in item["choices"]])]
        if i < len(mine):
            per_byte = [s / max(1, len(c.encode())) for s, c in zip(scores, item["choices"])]
            correct += int(np.argmax(scores) == item["answer"])
            correct_norm += int(np.argmax(per_byte) == item["answer"])
    correct, correct_norm = all_sum([correct, correct_norm], scorer.device)
    n = len(items)
    return {"acc": correct / n, "acc_norm": correct_norm / n, "n": n, "chance": probe.chance,
            "version": probe.version}


def prepare(tasks: list[Task], data_config: DataConfig, tokenizer) -> dict[str, list[dict]]:
    """Every probe's stored items, generated now on the first call, so that a corpus too small for a probe
    fails before training rather than at the first evaluation (harness tasks are loaded when scored)."""
    items = {}
    for task in tasks:
        if isinstance(task, Probe):
            items[task.name] = task.items(data_config, tokenizer)
            if not items[task.name]:
                raise DataError(f"probe {task.name!r}: the validation split of {data_config.source!r} gives no "
                                "items; use more validation text (data.val_fraction) or drop the probe")
    return items


def score(model, tasks: list[Task], data_config: DataConfig, tokenizer, *, max_items: int = 200, device,
          autocast=contextlib.nullcontext) -> dict[str, dict]:
    """Score `model` on `tasks` (from `resolve`): per task `{"acc", "n", "chance", ...}` (probes add
    `acc_norm` and `version`; harness tasks add the harness's own `metrics`).

    At most `max_items` items per task; contexts cut from the left to the model's max_seq_len. Under
    torch.distributed every rank must call this (ranks split the items) and every rank gets the result. The
    model's mode, weights and the random generators are as they were afterwards."""
    items = prepare(tasks, data_config, tokenizer)
    scorer = Scorer(model, tokenizer, device, autocast)
    out = {}
    with untouched(model, device):
        for task in tasks:
            if isinstance(task, HarnessTask):
                from keel.evals.harness import score_harness  # lm_eval is optional: imported only when asked

                out[task.name] = score_harness(scorer, task, max_items)
            else:
                out[task.name] = score_probe(scorer, task, items[task.name][:max_items])
    return out
