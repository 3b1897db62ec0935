"""What every study shares: a point trained as `keel train` would, held-out halves, outputs and plots."""

from __future__ import annotations

import contextlib
import contextvars
import io
import json
import math
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from keel import runtime, safe_io
from keel.config import GuardConfig, RunConfig, TrainConfig, validate
from keel.data import DataConfig, WindowSampler, prepare
from keel.data import eval_batches as spaced_batches
from keel.data.shards import token_counts
from keel.experiments.partial import Discarded, Partial
from keel.model import ModelConfig, TransformerLM
from keel.runtime import autocast_for, machine, resolve_device
from keel.train.evaluate import evaluate, nll_sum
from keel.train.guard import DivergenceGuard
from keel.train.optim import build_optimizer, lr_at
from keel.train.step import TrainStep, build_model, on_device
from keel.train.stop import DeferredStop


def experiment_guard() -> GuardConfig:
    """Experiments stop a point on non-finite values only: loss spikes and blow-ups are what max-lr measures."""
    return GuardConfig(spike_min_history=0, loss_ceiling=0)


def experiment_run(**fields) -> RunConfig:
    """A point's run: 8 x 64 tokens per step, compiled (faster at the science shapes, equal to eager to float32
    tolerance: benchmarks/cpu/compile), the fields a sweep does not use at their defaults."""
    return RunConfig(**({"steps": 400, "batch_size": 8, "seq_len": 64, "eval_batches": 16, "compile": True} | fields))


@dataclass
class Curve:
    losses: list[float]
    lrs: list[float]
    val_loss: float | None
    seconds: float
    stopped_at: int | None = None  # the step at which the guard (non-finite loss or gradient) ended the run


_DATA_CACHE: dict = {}


def corpus(data: DataConfig):
    """Prepared token shards, prepared once per process."""
    key = json.dumps(asdict(data), sort_keys=True)
    if key not in _DATA_CACHE:
        _DATA_CACHE[key] = prepare(data)
    return _DATA_CACHE[key]


def point_config(cfg, model_cfg: ModelConfig, seed: int, **optim) -> TrainConfig:
    """The TrainConfig of one point: `cfg`'s sections (a TrainConfig's, a code study's config's) with the point's
    model, seed and optimiser fields (`lr=...`);
    `keel train` with it trains the same model on the same batches and logs the same losses (a test checks this)."""
    run = replace(cfg.run, seed=seed, eval_every=0, ckpt_every=0, log_every=1, progress=False)
    config = TrainConfig(model=model_cfg, data=cfg.data, optim=replace(cfg.optim, **optim), guard=cfg.guard, run=run)
    validate(config)
    return config


def train_curve(config: TrainConfig, eval_batches: int = 8, model: TransformerLM | None = None,
                on_step: Callable | None = None, eval_tokens: np.ndarray | None = None,
                partial: Partial | None = None) -> tuple[Curve, torch.nn.Module]:
    """Train `config` from scratch (or from `model`) as `keel train` would, without run directories: the loss of
    every step, then the validation loss on `eval_tokens` (default: the whole validation split). A step the guard
    rejects ends the curve (`stopped_at`), and so does `on_step(i, model, result)` returning True. With `partial`
    (keel.experiments.partial), progress is saved as it trains and a point killed earlier continues from its last
    save (`model` must then be None; `seconds` add the time before)."""
    if partial is not None and model is not None:
        raise ValueError("train_curve: a point that keeps its progress is built from its seed, not given a model")
    c = config
    prepared = corpus(c.data)
    device = resolve_device(c.run.device)
    autocast = autocast_for(device, c.run.dtype)
    progress = None
    while True:  # a second pass only when a saved progress was discarded after it touched what it loaded into
        torch.manual_seed(c.run.seed)
        built = build_model(c.model, c.run, device, model=model)
        optimizer, guard = build_optimizer(built, c.optim), DivergenceGuard(c.guard)
        sampler = WindowSampler(prepared.train, c.run.seq_len, c.run.batch_size, seed=c.run.seed)
        try:
            progress = partial.restore(built, optimizer, sampler, guard) if partial is not None else None
            break
        except Discarded:
            continue
    step = TrainStep(built, optimizer, grad_accum=c.run.grad_accum, grad_clip=c.optim.grad_clip, autocast=autocast,
                     guard=guard)
    done, losses, lrs, before = progress or (0, [], [], 0.0)
    stopped, start = None, time.time()
    # a point that keeps its progress takes SIGINT/SIGTERM at the next step boundary and saves there first, so a
    # sweep stopped on purpose loses no training (a SIGKILL still loses up to partial.EVERY_SECONDS)
    stop = DeferredStop().install() if partial is not None else None
    try:
        for i in range(done, c.run.steps):
            if stop is not None and stop.signum is not None:
                if i > done:
                    partial.save(i, built, optimizer, sampler, guard, losses, lrs, before + time.time() - start)
                    print(f"keel: {partial.key}: progress saved at step {i}", file=sys.stderr, flush=True)
                raise KeyboardInterrupt
            runtime.stop_if_signalled()
            result = step(lambda: on_device(sampler.next_batch(), device), lr_at(i, c.run.steps, c.optim))
            losses.append(result.loss)
            lrs.append(result.lr)
            if result.diverged is not None or (on_step is not None and on_step(i, built, result)):
                stopped = i
                break
            if partial is not None and i + 1 < c.run.steps:
                partial.maybe_save(i + 1, built, optimizer, sampler, guard, losses, lrs, before + time.time() - start)
    finally:
        if stop is not None:
            stop.restore()
    if stop is not None and stop.signum is not None and not runtime.PENDING_SIGNALS:
        # signalled during the last step (or one that ended the curve): the point finishes (its evaluation, its
        # file) and the sweep stops at its next boundary
        runtime.PENDING_SIGNALS.append(stop.signum)
    val = None
    if stopped is None and eval_batches:
        tokens = prepared.val if eval_tokens is None else eval_tokens
        val = evaluate(built, tokens, c.run.seq_len, c.run.batch_size, eval_batches, device, autocast)["val_loss"]
    return Curve(losses, lrs, val, before + time.time() - start, stopped), built


def splits(data: DataConfig) -> dict[str, np.ndarray]:
    """The validation tokens cut in two halves by position: "select" (choose settings) and "report"
    (measure what is reported). Disjoint: evaluation windows are drawn inside one half."""
    val = corpus(data).val
    half = len(val) // 2
    return {"select": val[:half], "report": val[half:]}


def fixed_batches(tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int) -> list:
    """The same evenly spaced (x, y) batches every call, as a list (for evaluating every few steps)."""
    return list(spaced_batches(tokens, seq_len, batch_size, n_batches))


@torch.no_grad()
def loss_on(model, batches: list, autocast=contextlib.nullcontext) -> float:
    """Mean next-token loss of `model` over `batches` (eval mode restored afterwards)."""
    was_training, device = model.training, next(model.parameters()).device
    model.eval()
    nll, n = 0.0, 0
    for x, y in batches:
        batch_nll, batch_tokens, _ = nll_sum(model, x.to(device), y.to(device), autocast)
        nll, n = nll + batch_nll, n + batch_tokens
    model.train(was_training)
    return nll / max(1, n)


# token_counts of a training split (a TokenShards, read-only, as common.corpus keeps it for the process), counted
# once: every max-LR point reads them, about 0.1 CPU s each for the stdlib bytes
_TRAIN_COUNTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _train_counts(train) -> np.ndarray:
    try:
        return _TRAIN_COUNTS[train]
    except KeyError:
        counts = _TRAIN_COUNTS[train] = token_counts(train, minlength=256)  # a chunk at a time: memory bounded
        return counts
    except TypeError:  # an array (unhashable) is counted each time
        return token_counts(train, minlength=256)


def unigram_loss(train: np.ndarray, batches: list) -> float:
    """The loss on `batches`' targets of the training split's token frequencies (add-one smoothed), whatever the
    input: the level a collapsed LM falls back to (about 3.29 nats for the stdlib bytes)."""
    counts = _train_counts(train).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    targets = np.concatenate([y.numpy().ravel() for _, y in batches])
    return float(-logp[targets].mean())


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample SD (0 for one value; NaN-free inputs expected)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return float("nan"), float("nan")
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def pm(values: list[float], digits: int = 3) -> str:
    """"mean ± SD (n)" for a table cell; one value has no SD."""
    m, s = mean_sd(values)
    n = sum(1 for v in values if v is not None and math.isfinite(v))
    return "-" if not n else f"{m:.{digits}f} (n=1)" if n == 1 else f"{m:.{digits}f} ± {s:.{digits}f} (n={n})"


SMOKE_TEST_BANNER = "SMOKE TEST, NOT A RESULT"
_SMOKE_TEST = contextvars.ContextVar("smoke_test", default=False)


@contextlib.contextmanager
def smoke_test(on: bool = True):
    """While open (and `on`), every report.md starts with SMOKE_TEST_BANNER and every figure `save` writes carries
    it in its title: `--quick` numbers come from a tiny model and read like findings if nothing says otherwise."""
    token = _SMOKE_TEST.set(on)
    try:
        yield
    finally:
        _SMOKE_TEST.reset(token)


def write_outputs(out: Path, name: str, config, command: str, results: dict, table: str, plots: list[str],
                  notes: str = "") -> None:
    """results.json (numbers, config, machine; its points by key: store.read_results fills them in from `points/`)
    and report.md (command, table, plots, notes; under `smoke_test()` the banner first)."""
    if isinstance(results.get("points"), dict):
        results = results | {"points": sorted(results["points"])}
    payload = {"experiment": name, "command": command, "config": asdict(config),
               "machine": machine(resolve_device(getattr(getattr(config, "run", None), "device", "cpu"))),
               "results": results,
               "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")} | ({"smoke_test": True} if _SMOKE_TEST.get() else {})
    # whole and atomic, never through a link planted in the output directory (keel.safe_io)
    safe_io.write_text(out, out / "results.json", json.dumps(payload, indent=1, default=float))
    lines = [f"> **{SMOKE_TEST_BANNER}**: `--quick` trains a tiny model for a few steps to check that the "
             "experiment runs end to end; its numbers say nothing about the schemes.", ""] if _SMOKE_TEST.get() else []
    lines += [f"# {name}", "", "Produced by:", "", "```bash", command, "```", "", table, ""]
    lines += [f"![{p}]({p})" for p in plots]
    if notes:
        lines += ["", notes]
    safe_io.write_text(out, out / "report.md", "\n".join(lines) + "\n")


def markdown_table(header: list[str], rows: list[list]) -> str:
    cell = lambda v: (f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e3 else f"{v:.4f}") if isinstance(
        v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def save(fig, out: Path, name: str) -> str:
    """Write `fig` as out/<name> (tight layout, 110 dpi; under `smoke_test()` the banner in its title), close
    it, and return the name for the report."""
    if _SMOKE_TEST.get():
        title = fig._suptitle.get_text() if fig._suptitle is not None else ""
        fig.suptitle(f"{SMOKE_TEST_BANNER}" + (f"\n{title}" if title else ""), fontsize=10, color="firebrick")
    fig.tight_layout()
    image = io.BytesIO()  # drawn in memory, then written as results.json is
    fig.savefig(image, dpi=110, format=Path(name).suffix.lstrip(".") or "png")
    pyplot().close(fig)
    safe_io.write_bytes(out, Path(out) / name, image.getvalue())
    return name


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
