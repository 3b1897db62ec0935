"""Scoring by log-likelihood on an in-memory model: the probes here, lm-evaluation-harness tasks through
keel.evals.in_memory_lm, both with keel.evals.scorer.Scorer."""

from __future__ import annotations

import contextlib
import math
import random

import numpy as np
import torch

from keel.data.corpus import DataConfig, build_corpus
from keel.errors import DataError
from keel.evals import in_memory_lm
from keel.evals.scorer import Scorer, all_sum, world
from keel.evals.tasks import HarnessTask, Probe, Task


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
    items, corpus = {}, None
    for task in tasks:
        if isinstance(task, Probe):
            corpus = build_corpus(data_config) if corpus is None else corpus  # once for all the probes
            items[task.name] = task.items(data_config, tokenizer, corpus)
            if not items[task.name]:
                raise DataError(f"probe {task.name!r}: the validation split of {data_config.source!r} gives no "
                                "items; use more validation text (data.val_fraction) or drop the probe")
    return items


def score(model, tasks: list[Task], data_config: DataConfig, tokenizer, *, max_items: int = 200, device,
          autocast=contextlib.nullcontext, items: dict[str, list[dict]] | None = None) -> dict[str, dict]:
    """Score `model` on `tasks` (from `resolve`): per task `{"acc", "n", "chance", ...}` (probes add
    `acc_norm` and `version`; harness tasks add the harness's own `metrics`).

    At most `max_items` items per task; contexts cut from the left to the model's max_seq_len. Under
    torch.distributed every rank must call this (ranks split the items) and every rank gets the result. The
    model's mode, weights and the random generators are as they were afterwards. `items`: what `prepare(tasks,
    data_config, tokenizer)` returned, for a caller that scores the same tasks again (read once, not at every call)."""
    items = prepare(tasks, data_config, tokenizer) if items is None else items
    scorer = Scorer(model, tokenizer, device, autocast)
    out = {}
    with untouched(model, device):
        for task in tasks:
            if isinstance(task, HarnessTask):
                out[task.name] = in_memory_lm.score_harness(scorer, task, max_items)
            else:
                out[task.name] = score_probe(scorer, task, items[task.name][:max_items])
    return out
