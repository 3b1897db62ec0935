"""What every experiment shares: a lean training loop with per-step hooks, sweep bookkeeping, output.

An experiment is a sweep of independent points (scheme x depth x LR x seed ...). Each finished point is
written to `<out>/points/<key>.json`, so an interrupted sweep resumes by skipping finished points.
`results.json` (every number, config, versions, machine), PNG plots and `report.md` are written at the end.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from keel.data import DataConfig, WindowSampler, prepare
from keel.model.config import ModelConfig
from keel.model.transformer import TransformerLM
from keel.train.config import OptimConfig
from keel.train.evaluate import evaluate
from keel.train.optim import build_optimizer, lr_at
from keel.train.trainer import machine


@dataclass
class Shape:
    """The model shape shared by an experiment's points; depth and scheme vary per point."""

    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    seq_len: int = 64
    batch_size: int = 4

    def model(self, scheme: str, n_sublayers: int, **extra) -> ModelConfig:
        return ModelConfig(vocab_size=self.vocab_size, d_model=self.d_model, n_blocks=n_sublayers // 2,
                           n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, max_seq_len=self.seq_len,
                           scheme=scheme, **extra)


@dataclass
class Curve:
    losses: list[float]
    lrs: list[float]
    val_loss: float | None
    seconds: float
    stopped_at: int | None = None  # the step at which a non-finite loss ended the run early


_DATA_CACHE: dict = {}


def corpus(data: DataConfig):
    """Prepared token shards, prepared once per process."""
    key = json.dumps(asdict(data), sort_keys=True)
    if key not in _DATA_CACHE:
        _DATA_CACHE[key] = prepare(data)
    return _DATA_CACHE[key]


def train_curve(model_cfg: ModelConfig, optim: OptimConfig, steps: int, shape: Shape, data: DataConfig, seed: int,
                eval_batches: int = 8, after_backward: Callable | None = None, model: TransformerLM | None = None,
                ) -> tuple[Curve, TransformerLM]:
    """Train from scratch (or `model`) for `steps` steps; the loss of every step, then validation loss.

    The same optimiser, schedule, sampler and evaluation as `keel train`, without run directories or
    checkpoints. A non-finite loss stops the run (the curve records where). `after_backward(model, step)`
    sees the gradients of every step before the optimiser does.
    """
    prepared = corpus(data)
    torch.manual_seed(seed)
    model = model if model is not None else TransformerLM(model_cfg)
    opt = build_optimizer(model, optim)
    sampler = WindowSampler(prepared.train, shape.seq_len, shape.batch_size, seed=seed)
    losses, lrs, stopped, start = [], [], None, time.time()
    for step in range(steps):
        lr = lr_at(step, steps, optim)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = sampler.next_batch()
        _, loss = model(x, y)
        loss.backward()
        value = loss.item()
        losses.append(value)
        lrs.append(lr)
        if not math.isfinite(value):
            stopped = step
            break
        if after_backward is not None:
            after_backward(model, step)
        if optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    val = None
    if stopped is None and eval_batches:
        val = evaluate(model, prepared.val, shape.seq_len, shape.batch_size, eval_batches, "cpu")["val_loss"]
    return Curve(losses, lrs, val, time.time() - start, stopped), model


@dataclass
class Sweep:
    """Runs named points once each, keeping each result on disk as soon as it is done. The directory
    records the experiment's config, so points from another configuration are never reused."""

    out: Path
    config: object

    def run(self, points: dict[str, Callable[[], dict]], desc: str) -> dict[str, dict]:
        (self.out / "points").mkdir(parents=True, exist_ok=True)
        recorded, mine = self.out / "points" / "config.json", json.loads(json.dumps(asdict(self.config)))
        if recorded.exists() and json.loads(recorded.read_text()) != mine:
            theirs = json.loads(recorded.read_text())
            changed = sorted(k for k in mine if theirs.get(k) != mine[k])
            raise ValueError(f"{self.out}: holds points of another configuration (differs in {', '.join(changed)}); "
                             "use another --out or delete that directory")
        if not recorded.exists():
            recorded.write_text(json.dumps(mine, indent=1))
        results = {}
        bar = tqdm(points.items(), desc=desc, file=sys.stdout, dynamic_ncols=True)
        for key, fn in bar:
            path = self.out / "points" / f"{key}.json"
            if path.exists():
                results[key] = json.loads(path.read_text())
                continue
            bar.set_postfix_str(key)
            result = fn()
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(result))
            tmp.rename(path)  # a point is either finished on disk or not there
            results[key] = result
        return results


def write_outputs(out: Path, name: str, config, command: str, results: dict, table: str, plots: list[str],
                  notes: str = "") -> None:
    """results.json (numbers + config + machine) and report.md (command, table, plots, notes)."""
    payload = {"experiment": name, "command": command, "config": asdict(config),
               "machine": machine(torch.device("cpu")), "results": results,
               "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (out / "results.json").write_text(json.dumps(payload, indent=1, default=float))
    lines = [f"# {name}", "", "Produced by:", "", "```bash", command, "```", "", table, ""]
    lines += [f"![{p}]({p})" for p in plots]
    if notes:
        lines += ["", notes]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def markdown_table(header: list[str], rows: list[list]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e3 else f"{v:.4f}"
        return str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
