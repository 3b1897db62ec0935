"""The comparison at the heart of `keel bench`: training steps of several schemes at one shape, timed alternately.

Both schemes train in one process on the same synthetic batches, one step each in turn (the order flipped every
round, so neither always runs on a warmer cache), after warm-up steps that are not timed. Reported per scheme:
median step time, tokens/s, peak memory (CUDA: measured; CPU: the keel.scale.memory estimate), MFU on GPUs with
a known bf16 peak, and the Keel/Pre-LN step-time ratio. The depth series times a Keel step at growing depth to
show that cost per sub-layer stays flat.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import replace

import torch

from keel.config import OptimConfig, RunConfig
from keel.errors import ConfigError
from keel.model import SCHEMES, ModelConfig, TransformerLM, count_params, flops_per_token
from keel.model.architecture import with_scheme
from keel.runtime import autocast_for, peak_flops, resolve_device
from keel.scale.fused_junction import fused_junctions, hands_on_sums
from keel.scale.memory import estimate_memory
from keel.train.optim import build_optimizer
from keel.train.step import TrainStep, build_model

clock = time.perf_counter  # what every step time is read from (tests replace it with a fake clock)


class Bench:
    """One model, its optimiser and a fixed synthetic batch; `step()` times one training step, the same
    TrainStep (forward, backward over `run.grad_accum` micro-batches, clip, AdamW) that `keel train` takes.

    From `run` it reads batch_size, seq_len, grad_accum, seed, device (unless `device` is given), dtype, compile,
    fused_junction and ac_every; from `optim` the AdamW settings and clipping, at the constant rate `optim.lr`."""

    def __init__(self, config: ModelConfig, run: RunConfig, optim: OptimConfig | None = None,
                 device: torch.device | None = None, compile_backend: str = "inductor", init_on_device: bool = False):
        optim = optim or OptimConfig()
        device = device or resolve_device(run.device)
        torch.manual_seed(run.seed)
        self.config, self.run, self.device = config, run, device
        self.tokens = run.batch_size * run.seq_len * run.grad_accum  # per optimiser step
        model = None
        if init_on_device:  # billions of parameters initialise in seconds on a GPU, in minutes on its host's CPU
            with torch.device(device):
                model = TransformerLM(config)
        self.model = build_model(config, run, device, model=model, compile_backend=compile_backend)
        self.fused = fused_junctions(self.model)
        self.train_step = TrainStep(self.model, build_optimizer(self.model, optim), grad_accum=run.grad_accum,
                                    grad_clip=optim.grad_clip, autocast=autocast_for(device, run.dtype))
        self.lr = optim.lr
        ids = torch.randint(0, config.vocab_size, (run.batch_size, run.seq_len + 1),
                            generator=torch.Generator().manual_seed(run.seed))
        self.batch = ids[:, :-1].to(device), ids[:, 1:].to(device)
        self.times: list[float] = []
        self.peak: int | None = None

    def step(self, record: bool = True) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = clock()
        self.train_step(lambda: self.batch, self.lr)
        if cuda:  # kernels run asynchronously: the step ends when the device is done
            torch.cuda.synchronize(self.device)
        elapsed = clock() - start
        if record:
            self.times.append(elapsed)
            if cuda:
                self.peak = max(self.peak or 0, torch.cuda.max_memory_allocated(self.device))


def alternate(benches: dict[str, Bench], steps: int, warmup: int) -> dict[str, float]:
    """Step every bench in turn, the order flipped each round; the untimed warm-up seconds of each (compiles)."""
    labels, warm = list(benches), dict.fromkeys(benches, 0.0)
    for i in range(warmup + steps):
        for label in (labels if i % 2 == 0 else labels[::-1]):
            start = clock()
            benches[label].step(record=i >= warmup)
            if i < warmup:
                warm[label] += clock() - start
    return warm


def summarize(b: Bench) -> dict:
    """Median step time, tokens/s, memory and MFU of a timed Bench."""
    step = statistics.median(b.times)
    tps = b.tokens / step
    peak = peak_flops(b.device)
    return {
        "step_time_s": step, "step_time_min_s": min(b.times), "tokens_per_s": tps,
        "peak_memory_bytes": b.peak, "n_params": count_params(b.config),
        "memory_estimate_bytes": estimate_memory(b.config, b.run.batch_size, b.run.seq_len, b.run.ac_every,
                                                 compiled=hands_on_sums(b.run, b.config, b.device))["total"],
        "mfu": tps * flops_per_token(b.config, b.run.seq_len) / peak if peak else None, "fused_junctions": b.fused,
    }


def check_schemes(schemes: list[str]) -> None:
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown or not schemes:
        raise ConfigError(f"--schemes: unknown {', '.join(unknown) or '(none given)'}; allowed: {', '.join(SCHEMES)}")


def scheme_config(config: ModelConfig, scheme: str) -> ModelConfig:
    """`config` as `scheme` (keel.model.architecture.with_scheme, what the experiments use too)."""
    return with_scheme(config, scheme)


def compare(config: ModelConfig, run: RunConfig, schemes: list[str], steps: int, warmup: int,
            optim: OptimConfig | None = None, device: torch.device | None = None, together: bool = True,
            **bench_options) -> dict:
    """Training steps of each scheme at `config`'s shape; per-scheme results and the Keel/Pre-LN ratio.

    together: all schemes' models live at once and step alternately; False: one after another, each freed
    before the next is built (for models too large to hold two of on the device)."""
    check_schemes(schemes)
    device = device or resolve_device(run.device)
    out = {}
    for group in [schemes] if together else [[s] for s in schemes]:
        out |= _measure_group(config, run, group, steps, warmup, optim, device, bench_options)
    if "keel" in out and "pre_ln" in out:
        out["keel_over_pre_ln_step_time"] = out["keel"]["step_time_s"] / out["pre_ln"]["step_time_s"]
    return out


def _measure_group(config, run, group, steps, warmup, optim, device, bench_options) -> dict:
    """One group of schemes built, timed and summarised in a frame of its own: when it returns, nothing of it
    (models, optimiser state, compiled graphs) is left for the next group to sit beside. A loop variable in the
    caller would keep the last model and its AdamW state alive while the next one is built: two 512-sub-layer
    models at once."""
    fresh_compile_state()
    benches = {s: Bench(scheme_config(config, s), run, optim, device, **bench_options) for s in group}
    counts = compile_counts() if run.compile else None
    warm = alternate(benches, steps, warmup)
    out = {s: summarize(b) | {"warmup_s": warm[s]} for s, b in benches.items()}
    if run.compile:  # graphs and recompiles of this group (one scheme each when schemes run one after another)
        after = compile_counts()
        for s in out:
            out[s]["compile_graphs"] = {"graphs": after["graphs"] - counts["graphs"], "of_schemes": list(group)}
    del benches
    free(device)
    return out


def fresh_compile_state() -> None:
    """Forget every compiled graph and Dynamo's caches, so the next variant compiles from nothing (the
    compile warm-up of whichever variant came second would otherwise reuse the first one's work)."""
    torch._dynamo.reset()


def compile_counts() -> dict[str, int]:
    """Dynamo's running count of graphs compiled. Only blocks are compiled (keel.scale.parallel.apply_compile) and
    every block runs the same `Block.forward`, so for one model each graph beyond the first is a recompile of
    that code (a guard on alpha or on the norm layout failed)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    return {"graphs": int(counters["stats"]["unique_graphs"])}


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def depth_series(config: ModelConfig, run: RunConfig, sublayers: list[int], steps: int,
                 optim: OptimConfig | None = None, device: torch.device | None = None,
                 deadline: float | None = None, on_row=None, **bench_options) -> list[dict]:
    """Median step time at each depth (`sublayers`: the paper's L), and per sub-layer. Stops at the first depth
    that runs out of device memory, or once time.monotonic() passes `deadline`; `on_row(rows)` sees the rows so
    far after each depth."""
    device = device or resolve_device(run.device)
    rows = []
    for n in sublayers:
        if deadline is not None and time.monotonic() > deadline:
            rows.append({"n_sublayers": n, "skipped": "time box reached"})
            continue

        def measure(n=n):
            b = Bench(replace(config, n_blocks=n // 2), run, optim, device, **bench_options)
            b.step(record=False)
            for _ in range(steps):
                b.step()
            step = statistics.median(b.times)
            layers = b.config.n_sublayers  # the sub-layers a step runs (a looped model's unrolled count)
            return {"n_sublayers": layers, "step_time_s": step, "ms_per_sublayer": 1e3 * step / layers,
                    "n_params": count_params(b.config), "peak_memory_bytes": b.peak, "fused_junctions": b.fused}

        row = attempt(measure, device)
        rows.append(row if isinstance(row, dict) else {"n_sublayers": n, "failed": row})
        if on_row is not None:
            on_row(rows)
        if not isinstance(row, dict):
            break
    return rows


def attempt(fn, device: torch.device):
    """fn(), or "out of memory" where the device ran out; either way what fn left behind is freed."""
    try:
        result = fn()
    except RuntimeError as err:  # torch.OutOfMemoryError, or a library's own "CUDA error: out of memory"
        if not isinstance(err, torch.OutOfMemoryError) and "out of memory" not in str(err):
            raise
        result = "out of memory"  # the traceback (and the tensors its frames hold) is released after this block
    free(device)
    return result


def to_markdown(result: dict) -> str:
    """The comparison and depth series of `keel bench` as a markdown table."""
    s, m = result["settings"], result["machine"]
    run = s["run"]
    lines = [f"# keel bench ({m['device']}, {m['gpu'] or m['cpu']}, {m['cpu_count']} cores)", "",
             f"Shape: d_model={s['model']['d_model']}, n_sublayers={s['n_sublayers']}, batch {run['batch_size']} x "
             f"{run['seq_len']} tokens x {run['grad_accum']} micro-batches, {s['dtype']}, {s['steps']} timed steps "
             f"after {s['warmup']} warm-up steps, alternating.", "",
             "| scheme | step time (ms, median) | tokens/s | peak memory (MiB) | MFU |", "|---|---|---|---|---|"]
    for scheme in s["schemes"]:
        r = result["compare"][scheme]
        mem = r["peak_memory_bytes"]
        mem_text = f"{mem / 2**20:.1f}" if mem else f"~{r['memory_estimate_bytes'] / 2**20:.1f} (estimate)"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        lines.append(f"| {scheme} | {1e3 * r['step_time_s']:.1f} | {r['tokens_per_s']:,.0f} | {mem_text} | {mfu} |")
    if "keel_over_pre_ln_step_time" in result["compare"]:
        lines += ["", f"Keel / Pre-LN step time: **{result['compare']['keel_over_pre_ln_step_time']:.3f}**"]
    if result.get("depth"):
        lines += ["", f"Depth series ({s['schemes'][0]}):", "", "| sub-layers | step time (ms) | ms per sub-layer |",
                  "|---|---|---|"]
        lines += [f"| {r['n_sublayers']} | {1e3 * r['step_time_s']:.1f} | {r['ms_per_sublayer']:.3f} |"
                  if "step_time_s" in r else f"| {r['n_sublayers']} | {r.get('failed')} | |" for r in result["depth"]]
    return "\n".join(lines) + "\n"
