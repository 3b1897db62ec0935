"""`keel bench`: Keel's training-step cost against Pre-LN at identical shapes, and against depth.

Both schemes train in one process on the same synthetic batches, one step each in turn (the order
flipped every round, so neither always runs on a warmer cache), after warm-up steps that are not
timed. Reported per scheme: median step time, tokens/s, peak memory (CUDA: measured; CPU: the
keel.scale.memory estimate), MFU on GPUs with a known bf16 peak, and the Keel/Pre-LN step-time ratio. The
depth series times a Keel step from 16 to 1024 sub-layers to show cost per sub-layer stays flat.

Two fixed campaigns (`--suite`), each one command writing bench.json and bench.md:
  cpu  compiled against eager, Keel against Pre-LN, all four alternating in one process, at the bench shape and
       at the default `keel train` job's shape (waits for an idle machine first, records the load average);
  gpu  the `gpu` tests, Keel/Pre-LN eager / compiled / compiled+fused at d=1024, the junction kernel alone,
       time per sub-layer against depth, and the deepest model that trains: each section time-boxed and every
       result written as soon as it exists, so a run cut off by its time limit still leaves data. `--toy`
       runs the same campaign at toy sizes on a CPU in seconds (what CI runs).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from keel.errors import ConfigError
from keel.kernels.junction import can_fuse
from keel.kernels.timing import copy_bandwidth, junction_bandwidth
from keel.model import ModelConfig, TransformerLM, count_params, flops_per_token
from keel.model.presets import cpu_demo
from keel.runtime import autocast_for, machine, peak_flops, resolve_device
from keel.scale.memory import estimate_memory
from keel.scale.parallel import fused_junctions
from keel.train.config import OptimConfig, Runtime, add_config_arguments, load_config
from keel.train.optim import build_optimizer
from keel.train.step import TrainStep, build_model


class Bench:
    """One model, its optimiser and a fixed synthetic batch; `step()` times one training step, the same
    TrainStep (forward, backward, clip, AdamW) that `keel train` and the experiments take."""

    def __init__(self, config: ModelConfig, batch_size: int, seq_len: int, device: torch.device, dtype: str = "auto",
                 ac_every: int = 0, compile: bool = False, fused_junction: str = "auto",
                 compile_backend: str = "inductor", init_on_device: bool = False):
        torch.manual_seed(0)
        self.config, self.device, self.tokens = config, device, batch_size * seq_len
        runtime = Runtime(device=str(device), dtype=dtype, compile=compile, ac_every=ac_every,
                          fused_junction=fused_junction)
        model = None
        if init_on_device:  # billions of parameters initialise in seconds on a GPU, in minutes on its host's CPU
            with torch.device(device):
                model = TransformerLM(config)
        self.model = build_model(config, runtime, device, model=model, compile_backend=compile_backend)
        self.fused = fused_junctions(self.model)
        optim = OptimConfig(lr=1e-4, warmup_steps=0)
        self.train_step = TrainStep(self.model, build_optimizer(self.model, optim), grad_clip=optim.grad_clip,
                                    autocast=autocast_for(device, dtype))
        self.lr = optim.lr
        ids = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0))
        self.batch = ids[:, :-1].to(device), ids[:, 1:].to(device)
        self.times: list[float] = []
        self.peak: int | None = None

    def step(self, record: bool = True) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        self.train_step(lambda: self.batch, self.lr)
        if cuda:
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        if record:
            self.times.append(elapsed)
            if cuda:
                self.peak = max(self.peak or 0, torch.cuda.max_memory_allocated(self.device))


def alternate(benches: dict[str, Bench], steps: int, warmup: int) -> dict[str, float]:
    """Step every bench in turn, the order flipped each round; the untimed warm-up seconds of each (compiles)."""
    labels, warm = list(benches), dict.fromkeys(benches, 0.0)
    for i in range(warmup + steps):
        for label in (labels if i % 2 == 0 else labels[::-1]):
            start = time.perf_counter()
            benches[label].step(record=i >= warmup)
            if i < warmup:
                warm[label] += time.perf_counter() - start
    return warm


def summarize(b: Bench, batch_size: int, seq_len: int, ac_every: int = 0) -> dict:
    """Median step time, tokens/s, memory and MFU of a timed Bench."""
    step = statistics.median(b.times)
    tps = b.tokens / step
    peak = peak_flops(b.device)
    return {
        "step_time_s": step, "step_time_min_s": min(b.times), "tokens_per_s": tps,
        "peak_memory_bytes": b.peak,
        "memory_estimate_bytes": estimate_memory(b.config, batch_size, seq_len, ac_every)["total"],
        "mfu": tps * flops_per_token(b.config, seq_len) / peak if peak else None, "fused_junctions": b.fused,
    }


def compare(config: ModelConfig, schemes: list[str], batch_size: int, seq_len: int, steps: int, warmup: int,
            device: torch.device, dtype: str = "auto", ac_every: int = 0, compile: bool = False,
            fused_junction: str = "auto", together: bool = True, **bench_options) -> dict:
    """Training steps of each scheme at `config`'s shape; per-scheme results and the Keel/Pre-LN ratio.

    together: all schemes' models live at once and step alternately; False: one after another, each freed
    before the next is built (for models too large to hold two of on the device)."""
    def bench(scheme):
        cfg = replace(config, scheme=scheme, **_scheme_defaults(config, scheme))
        return Bench(cfg, batch_size, seq_len, device, dtype, ac_every, compile, fused_junction, **bench_options)

    out = {}
    groups = [schemes] if together else [[s] for s in schemes]
    for group in groups:
        benches = {s: bench(s) for s in group}
        warm = alternate(benches, steps, warmup)
        for s, b in benches.items():
            out[s] = summarize(b, batch_size, seq_len, ac_every) | {"warmup_s": warm[s]}
        del benches
        _free(device)
    if "keel" in out and "pre_ln" in out:
        out["keel_over_pre_ln_step_time"] = out["keel"]["step_time_s"] / out["pre_ln"]["step_time_s"]
    return out


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _scheme_defaults(config: ModelConfig, scheme: str) -> dict:
    """Clear options the target scheme does not read (ModelConfig rejects them)."""
    return {name: None for name in ("alpha", "first_layer", "mix_ln_fraction", "deepnorm_beta")
            if getattr(config, name) is not None and scheme != config.scheme}


def depth_series(config: ModelConfig, sublayers: list[int], batch_size: int, seq_len: int, steps: int,
                 device: torch.device, dtype: str = "auto", deadline: float | None = None, on_row=None,
                 **bench_options) -> list[dict]:
    """Median Keel step time at each depth, and per sub-layer. Stops at the first depth that runs out of device
    memory, or once time.monotonic() passes `deadline`; `on_row(rows)` sees the rows so far after each depth."""
    rows = []
    for n in sublayers:
        if deadline is not None and time.monotonic() > deadline:
            rows.append({"n_sublayers": n, "skipped": "time box reached"})
            continue

        def measure(n=n):
            b = Bench(replace(config, n_blocks=n // 2), batch_size, seq_len, device, dtype, **bench_options)
            b.step(record=False)
            for _ in range(steps):
                b.step()
            step = statistics.median(b.times)
            return {"n_sublayers": n, "step_time_s": step, "ms_per_sublayer": 1e3 * step / n,
                    "peak_memory_bytes": b.peak, "fused_junctions": b.fused}

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
    _free(device)
    return result


def to_markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"# keel bench ({result['machine']['device']}, {result['machine']['gpu'] or result['machine']['cpu']}, "
             f"{result['machine']['cpu_count']} cores)", "",
             f"Shape: d_model={s['d_model']}, n_sublayers={s['n_sublayers']}, batch {s['batch_size']} x "
             f"{s['seq_len']} tokens, {s['steps']} timed steps after {s['warmup']} warm-up steps, alternating.", "",
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
        lines += ["", "Depth series (Keel):", "", "| sub-layers | step time (ms) | ms per sub-layer |", "|---|---|---|"]
        lines += [f"| {r['n_sublayers']} | {1e3 * r['step_time_s']:.1f} | {r['ms_per_sublayer']:.3f} |"
                  for r in result["depth"]]
    return "\n".join(lines) + "\n"


def wait_for_idle(max_load: float, timeout_s: float) -> dict:
    """Wait (up to `timeout_s`) until the 1-minute load average is below `max_load`: on a small shared machine
    any other job's work lands in the step times. Returns the seconds waited and the load average then."""
    start = time.monotonic()
    while os.getloadavg()[0] >= max_load and time.monotonic() - start < timeout_s:
        time.sleep(15)
    return {"waited_s": round(time.monotonic() - start), "load_average": os.getloadavg(),
            "idle": os.getloadavg()[0] < max_load}


# The bench shape of benchmarks/cpu/ and the default `keel train` job's (preset cpu-demo): (model overrides, batch, seq)
CPU_SHAPES = {"bench": ({"n_blocks": 8, "max_seq_len": 64}, 4, 64), "train-default": ({"max_seq_len": 128}, 16, 128)}
CPU_TARGETS = {"compiled_keel_over_pre_ln_at_most": 1.03, "compiled_speedup_at_least": 1.3}


def cpu_suite(steps: int, warmup: int, write, max_load: float = 0.5, wait_s: float = 900, shapes=None,
              compile_backend: str = "inductor") -> dict:
    """Eager and compiled, Keel and Pre-LN: four models stepping alternately in this process, per shape.
    `shapes` (default CPU_SHAPES) and `compile_backend` are for tests."""
    device, shapes = torch.device("cpu"), shapes or CPU_SHAPES
    result = {"suite": "cpu", "machine": machine(device), "settings": {
        "shapes": {k: {"model": asdict(cpu_demo(**o)), "batch_size": b, "seq_len": t}
                   for k, (o, b, t) in shapes.items()}, "steps": steps, "warmup": warmup, "dtype": "float32",
        "compile_backend": compile_backend},
        "idle_check": wait_for_idle(max_load, wait_s) | {"max_load": max_load}, "shapes": {}}
    for name, (overrides, batch, seq) in shapes.items():
        torch._dynamo.reset()  # each shape compiles afresh, well inside Dynamo's recompile limit
        load_before = os.getloadavg()
        benches = {f"{s}/{v}": Bench(replace(cpu_demo(**overrides), scheme=s), batch, seq, device,
                                     compile=v == "compiled", fused_junction="off", compile_backend=compile_backend)
                   for s in ("keel", "pre_ln") for v in ("eager", "compiled")}
        warm = alternate(benches, steps, warmup)
        rows = {k: summarize(b, batch, seq) | {"warmup_s": warm[k]} for k, b in benches.items()}
        time_of = {k: r["step_time_s"] for k, r in rows.items()}
        ratio = {v: time_of[f"keel/{v}"] / time_of[f"pre_ln/{v}"] for v in ("eager", "compiled")}
        speedup = {s: time_of[f"{s}/eager"] / time_of[f"{s}/compiled"] for s in ("keel", "pre_ln")}
        result["shapes"][name] = {"results": rows, "keel_over_pre_ln_step_time": ratio, "compiled_speedup": speedup,
                                  "load_average": {"before": load_before, "after": os.getloadavg()}}
        del benches
        write(result)
    met = {f"compiled_keel_over_pre_ln_{k}": v["keel_over_pre_ln_step_time"]["compiled"]
           <= CPU_TARGETS["compiled_keel_over_pre_ln_at_most"] for k, v in result["shapes"].items()}
    if "train-default" in result["shapes"]:
        met["compiled_speedup_train_default_keel"] = (result["shapes"]["train-default"]["compiled_speedup"]["keel"]
                                                      >= CPU_TARGETS["compiled_speedup_at_least"])
    result["targets"] = CPU_TARGETS | {"met": met}
    write(result)
    return result


def cpu_markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# keel bench --suite cpu ({m['cpu']}, {m['cpu_count']} cores, {m['torch_threads']} torch threads, "
             f"torch {m['torch_version']})", "",
             f"Four models step alternately in one process (Keel and Pre-LN, eager and compiled), "
             f"{result['settings']['steps']} timed steps each after {result['settings']['warmup']} warm-up steps "
             f"(compilation happens there), float32. Load average before timing: "
             f"{result['idle_check']['load_average'][0]:.2f} (waited {result['idle_check']['waited_s']} s)."
             + ("" if result["idle_check"]["idle"] else " **The machine never became idle: other work is in these "
                "times.**"), ""]
    for name, shape in result["shapes"].items():
        cfg = result["settings"]["shapes"][name]
        lines += [f"## {name}: d_model={cfg['model']['d_model']}, {2 * cfg['model']['n_blocks']} sub-layers, "
                  f"batch {cfg['batch_size']} x {cfg['seq_len']}", "",
                  "| model | step time (ms, median) | tokens/s | warm-up (s) |", "|---|---|---|---|"]
        lines += [f"| {k} | {1e3 * r['step_time_s']:.1f} | {r['tokens_per_s']:,.0f} | {r['warmup_s']:.1f} |"
                  for k, r in shape["results"].items()]
        ratio, speedup = shape["keel_over_pre_ln_step_time"], shape["compiled_speedup"]
        lines += ["", f"Keel / Pre-LN step time: eager **{ratio['eager']:.3f}**, compiled **{ratio['compiled']:.3f}**. "
                  f"Compiled over eager (tokens/s): Keel **{speedup['keel']:.2f}x**, Pre-LN {speedup['pre_ln']:.2f}x. "
                  f"Load average {shape['load_average']['before'][0]:.2f} before, "
                  f"{shape['load_average']['after'][0]:.2f} after (this process included).", ""]
    if "targets" in result:
        t = result["targets"]
        lines += [f"Targets (issue 12): compiled Keel/Pre-LN <= {t['compiled_keel_over_pre_ln_at_most']}, compiled >= "
                  f"{t['compiled_speedup_at_least']}x eager for the default job: "
                  + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in t["met"].items()) + "."]
    return "\n".join(lines) + "\n"


@dataclass
class GpuSuite:
    """Sizes and time boxes (seconds) of `keel bench --suite gpu`; `toy()` is the same campaign at CPU-test size.

    The defaults fit one 10-minute call on an 80 GB GPU: compare runs the paper's d=1024 shape (16 heads, 8 KV
    heads, FFN 3x, vocabulary 32000) at seq 4096; from `ac_from` sub-layers on it checkpoints every block and
    holds one model at a time (two 512-sub-layer models with AdamW state do not fit together). The depth
    series runs at `depth_d_model` with checkpointing, so 1024 sub-layers fit too.
    """

    d_model: int = 1024
    n_heads: int = 16
    n_kv_heads: int = 8
    vocab_size: int = 32000
    seq_len: int = 4096
    batch_size: int = 1
    dtype: str = "bfloat16"
    compile_backend: str = "inductor"
    steps: int = 5
    warmup: int = 2
    compare_sublayers: tuple[int, ...] = (64, 512)
    ac_from: int = 256
    together_upto: int = 128
    kernel_rows: int = 16384
    kernel_widths: tuple[int, ...] = (1024, 2048, 4096)
    kernel_calls: int = 20  # back-to-back calls per timing, `kernel_repeats` timings (median)
    kernel_repeats: int = 5
    depth_d_model: int = 512
    depth_sublayers: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    depth_steps: int = 3
    max_depth_from: int = 256
    max_depth_upto: int = 4096
    max_depth_resolution: int = 32
    test_args: tuple[str, ...] = ("-m", "gpu", "tests")
    boxes: dict[str, float] = field(default_factory=lambda: {
        "tests": 150, "kernel": 50, "compare": 230, "depth": 50, "max_depth": 60})

    @classmethod
    def toy(cls) -> GpuSuite:
        return cls(d_model=32, n_heads=2, n_kv_heads=1, vocab_size=256, seq_len=16, batch_size=2, dtype="auto",
                   compile_backend="aot_eager", steps=2, warmup=1, compare_sublayers=(4, 8), ac_from=8,
                   together_upto=4, kernel_rows=64, kernel_widths=(32, 48), kernel_calls=1, kernel_repeats=1,
                   depth_d_model=32,
                   depth_sublayers=(4, 8, 16), depth_steps=1, max_depth_from=4, max_depth_upto=16,
                   max_depth_resolution=4, test_args=("-m", "gpu", "tests/test_junction.py"))

    def model(self, n_sublayers: int, scheme: str = "keel", d_model: int | None = None) -> ModelConfig:
        d = d_model or self.d_model
        return ModelConfig(vocab_size=self.vocab_size, d_model=d, n_blocks=n_sublayers // 2,
                           n_heads=self.n_heads * d // self.d_model, n_kv_heads=self.n_kv_heads * d // self.d_model,
                           max_seq_len=self.seq_len, scheme=scheme)

    def bench_options(self, device: torch.device) -> dict:
        return {"dtype": self.dtype, "compile_backend": self.compile_backend, "init_on_device": device.type == "cuda"}


GPU_SECTIONS = ("tests", "kernel", "compare", "depth", "max_depth")
VARIANTS = {"eager": (False, "off"), "compiled": (True, "off"), "compiled+fused": (True, "on")}


def gpu_suite(suite: GpuSuite, device: torch.device, write, sections=GPU_SECTIONS) -> dict:
    """Run `sections` in order, each within its time box plus whatever earlier sections left unused."""
    result = {"suite": "gpu", "machine": machine(device), "settings": asdict(suite), "status": {}, "sections": {}}
    budget = 0.0
    for name in sections:
        budget += suite.boxes[name]
        start = time.monotonic()
        result["status"][name] = "running"
        write(result)
        status = SECTIONS[name](suite, device, result["sections"], start + budget, lambda: write(result))
        result["status"][name] = status or "done"
        budget -= time.monotonic() - start
        write(result)
    return result


def _section_tests(suite, device, out, deadline, save):
    """The `gpu`-marked tests, in a child process (they set up CUDA, compile and triton state of their own)."""
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", *suite.test_args, "-q", "-p", "no:cacheprovider"],
                              capture_output=True, text=True, timeout=max(1.0, deadline - start))
    except subprocess.TimeoutExpired as err:
        partial = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else err.stdout or ""
        out["tests"] = {"args": list(suite.test_args), "summary": "timed out", "seconds": time.monotonic() - start,
                        "output_tail": partial[-2000:]}
        return "time box reached"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    out["tests"] = {"args": list(suite.test_args), "returncode": proc.returncode, "seconds": time.monotonic() - start,
                    "summary": lines[-1].strip("= ") if lines else proc.stderr[-500:],
                    "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))]}


def _section_kernel(suite, device, out, deadline, save):
    """The junction alone at `kernel_rows` rows of each width: fused, unfused and torch.compile'd."""
    out["kernel"] = {"copy_GBps": copy_bandwidth(device, 1 << (30 if device.type == "cuda" else 24)) / 1e9, "rows": []}
    for width in suite.kernel_widths:
        if time.monotonic() > deadline:
            return "time box reached"
        f_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        out["kernel"]["rows"].append(junction_bandwidth(suite.kernel_rows, width, device, f_dtype,
                                                        calls=suite.kernel_calls, repeats=suite.kernel_repeats,
                                                        compile_backend=suite.compile_backend))
        save()


def _section_compare(suite, device, out, deadline, save):
    """Keel against Pre-LN at each depth: eager, compiled, compiled with the fused junction."""
    out["compare"] = {}
    for n in suite.compare_sublayers:
        torch._dynamo.reset()  # new constants (alpha = L) at each depth: keep well inside the recompile limit
        rows = out["compare"][str(n)] = {"ac_every": 1 if n >= suite.ac_from else 0}
        for variant, (compile, fused) in VARIANTS.items():
            if time.monotonic() > deadline:
                rows[variant] = {"skipped": "time box reached"}
                continue
            if fused == "on" and not can_fuse(device, suite.d_model):
                rows[variant] = {"skipped": f"the fused junction cannot run on {device}"}
                continue
            def pair(n=n, ac_every=rows["ac_every"], compile=compile, fused=fused):
                return compare(suite.model(n), ["keel", "pre_ln"], suite.batch_size, suite.seq_len, suite.steps,
                               suite.warmup, device, ac_every=ac_every, compile=compile, fused_junction=fused,
                               together=n <= suite.together_upto, **suite.bench_options(device))

            r = attempt(pair, device)
            rows[variant] = r if isinstance(r, dict) else {"failed": r}
            save()
    if any(v == {"skipped": "time box reached"} for rows in out["compare"].values() for v in rows.values()):
        return "time box reached"


def _section_depth(suite, device, out, deadline, save):
    """Time per sub-layer from the shallowest to the deepest model, eager, checkpointing every block."""
    def on_row(rows):
        out["depth"] = {"d_model": suite.depth_d_model, "ac_every": 1, "rows": rows}
        save()

    rows = depth_series(suite.model(2, d_model=suite.depth_d_model), list(suite.depth_sublayers), suite.batch_size,
                        suite.seq_len, suite.depth_steps, device, deadline=deadline, on_row=on_row, ac_every=1,
                        **suite.bench_options(device))
    on_row(rows)
    if any("skipped" in r for r in rows):
        return "time box reached"


def _section_max_depth(suite, device, out, deadline, save):
    """The most sub-layers that train (two steps) at d_model with checkpointing: doubling, then bisection."""
    trials = []
    out["max_depth"] = {"d_model": suite.d_model, "ac_every": 1, "trials": trials, "largest": None}

    def trains(n):
        def two_steps():
            b = Bench(suite.model(n), suite.batch_size, suite.seq_len, device, ac_every=1,
                      **suite.bench_options(device))
            b.step()
            b.step()
            return {"n_sublayers": n, "trains": True, "step_time_s": b.times[-1], "peak_memory_bytes": b.peak,
                    "n_params": count_params(b.config)}
        r = attempt(two_steps, device)
        trials.append(r if isinstance(r, dict) else {"n_sublayers": n, "trains": False, "failed": r})
        save()
        return isinstance(r, dict)

    good, bad, n = 0, None, suite.max_depth_from
    while n <= suite.max_depth_upto and time.monotonic() < deadline:
        if trains(n):
            good, n = n, 2 * n
        else:
            bad = n
            break
    if good == 0 and bad is not None:  # even the first failed: halve down
        n = bad // 2
        while n >= 2 and time.monotonic() < deadline and not trains(n):
            bad, n = n, n // 2
        good = n if n >= 2 and trials[-1]["trains"] else 0
    while bad is not None and good and bad - good > suite.max_depth_resolution and time.monotonic() < deadline:
        mid = (good + bad) // 4 * 2  # an even number of sub-layers: whole blocks
        good, bad = (mid, bad) if trains(mid) else (good, mid)
    out["max_depth"]["largest"] = good or None
    out["max_depth"]["first_failing"] = bad
    if time.monotonic() > deadline:
        return "time box reached"


SECTIONS = {"tests": _section_tests, "kernel": _section_kernel, "compare": _section_compare,
            "depth": _section_depth, "max_depth": _section_max_depth}


def gpu_markdown(result: dict) -> str:
    m, s, sec = result["machine"], result["settings"], result["sections"]
    lines = [f"# keel bench --suite gpu ({m['gpu'] or m['cpu']}, torch {m['torch_version']})", "",
             "Status: " + ", ".join(f"{k} {v}" for k, v in result["status"].items()), ""]
    if "tests" in sec:
        t = sec["tests"]
        lines += [f"## Tests (`pytest {' '.join(t['args'])}`)", "", f"{t['summary']} ({t['seconds']:.0f} s)", ""]
        lines += [f"- {f}" for f in t.get("failures", [])]
    if "kernel" in sec:
        k = sec["kernel"]
        lines += ["## Junction kernel alone", "", f"Device copy bandwidth: {k['copy_GBps']:,.0f} GB/s. Effective "
                  "GB/s = bytes that must move / time (forward: x, f read, y, u written).", "",
                  "| rows x width | impl | forward (us) | forward GB/s | fwd+bwd (us) | fwd+bwd GB/s | fwd % of copy |",
                  "|---|---|---|---|---|---|---|"]
        for row in k["rows"]:
            for impl in ("fused", "unfused", "compiled"):
                if impl in row:
                    r = row[impl]
                    lines.append(f"| {row['rows']} x {row['width']} | {impl} | {1e6 * r['fwd_s']:.1f} | "
                                 f"{r['fwd_GBps']:,.1f} | {1e6 * r['fwd_bwd_s']:.1f} | {r['fwd_bwd_GBps']:,.1f} | "
                                 f"{r['fwd_GBps'] / k['copy_GBps']:.0%} |")
        lines.append("")
    if "compare" in sec:
        lines += [f"## Keel vs Pre-LN, d={s['d_model']}, seq {s['seq_len']}, batch {s['batch_size']}, {s['dtype']}",
                  "", "| sub-layers | variant | scheme | step (ms) | tokens/s | MFU | peak memory (GiB) | warm-up (s) |"
                  " Keel/Pre-LN |", "|---|---|---|---|---|---|---|---|---|"]
        for n, rows in sec["compare"].items():
            for variant, r in rows.items():
                if variant == "ac_every":
                    continue
                if "keel" not in r:
                    lines.append(f"| {n} | {variant} | - | {r.get('skipped') or r.get('failed')} | | | | | |")
                    continue
                for scheme in ("keel", "pre_ln"):
                    x = r[scheme]
                    mfu = f"{x['mfu']:.1%}" if x["mfu"] is not None else "n/a"
                    mem = f"{x['peak_memory_bytes'] / 2**30:.1f}" if x["peak_memory_bytes"] else "n/a"
                    ratio = f"**{r['keel_over_pre_ln_step_time']:.3f}**" if scheme == "keel" else ""
                    lines.append(f"| {n}{' (AC)' if rows['ac_every'] else ''} | {variant} | {scheme} | "
                                 f"{1e3 * x['step_time_s']:.1f} | {x['tokens_per_s']:,.0f} | {mfu} | {mem} | "
                                 f"{x['warmup_s']:.1f} | {ratio} |")
        lines.append("")
    if "depth" in sec:
        lines += [f"## Time per sub-layer (Keel, d={sec['depth']['d_model']}, eager, AC every block)", "",
                  "| sub-layers | step (ms) | ms per sub-layer |", "|---|---|---|"]
        lines += [f"| {r['n_sublayers']} | {1e3 * r['step_time_s']:.1f} | {r['ms_per_sublayer']:.3f} |"
                  if "step_time_s" in r else f"| {r['n_sublayers']} | {r.get('skipped') or r.get('failed')} | |"
                  for r in sec["depth"]["rows"]]
        lines.append("")
    if "max_depth" in sec:
        d = sec["max_depth"]
        lines += [f"## Deepest Keel that trains (d={d['d_model']}, AC every block)", "",
                  f"Largest: **{d['largest']}** sub-layers; first failing: {d.get('first_failing')}. Trials: "
                  + ", ".join(f"{t['n_sublayers']} {'ok' if t['trains'] else t['failed']}" for t in d["trials"]), ""]
    return "\n".join(lines) + "\n"


def _writer(out: Path | None, markdown):
    def write(result: dict) -> None:
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench.json").write_text(json.dumps(result, indent=1))
            (out / "bench.md").write_text(markdown(result))
    return write


def run_suite(args) -> dict:
    out = Path(args.out) if args.out else None
    device = resolve_device(args.device)
    if args.suite == "cpu":
        result = cpu_suite(args.steps, args.warmup, _writer(out, cpu_markdown), args.idle_load, args.idle_wait)
        print(cpu_markdown(result))
        return result
    if device.type != "cuda" and not args.toy:
        raise ConfigError("--suite gpu: needs a CUDA device (its sizes are a GPU's); --toy runs it at toy size here")
    sections = args.sections.split(",") if args.sections else list(GPU_SECTIONS)
    unknown = set(sections) - set(GPU_SECTIONS)
    if unknown:
        raise ConfigError(f"--sections: unknown {', '.join(sorted(unknown))}; allowed: {', '.join(GPU_SECTIONS)}")
    result = gpu_suite(GpuSuite.toy() if args.toy else GpuSuite(), device, _writer(out, gpu_markdown), sections)
    print(gpu_markdown(result))
    return result


def run(args) -> dict:
    if args.suite:
        return run_suite(args)
    train_config = load_config(args.overrides, getattr(args, "config", None), args.preset)
    config = train_config.model
    device = resolve_device(args.device)
    schemes = args.schemes.split(",")
    result = {"machine": machine(device), "settings": {
        "preset": args.preset, "overrides": args.overrides, "d_model": config.d_model,
        "n_sublayers": config.n_sublayers, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "steps": args.steps, "warmup": args.warmup, "schemes": schemes, "dtype": args.dtype,
        "ac_every": args.ac_every, "compile": args.compile or train_config.run.compile,
        "fused_junction": train_config.run.fused_junction}}
    result["compare"] = compare(config, schemes, args.batch_size, args.seq_len, args.steps, args.warmup, device,
                                args.dtype, args.ac_every, args.compile or train_config.run.compile,
                                train_config.run.fused_junction)
    depths = [int(d) for d in args.depths.split(",")] if args.depths else []
    result["depth"] = depth_series(config, depths, args.batch_size, args.seq_len, args.depth_steps, device,
                                   args.dtype)
    table = to_markdown(result)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(result, indent=1))
        (out / "bench.md").write_text(table)
        print(f"written: {out / 'bench.json'}, {out / 'bench.md'}")
    else:
        print(json.dumps(result, indent=1))
    return result


def cmd_bench(args) -> int:
    run(args)
    return 0


def register(subparsers) -> None:
    """Add `keel bench` to the `keel` command's subparsers."""
    p = subparsers.add_parser("bench", help="time Keel against Pre-LN at identical shapes, and against depth",
                              description="Alternating training steps of each scheme after warm-up; JSON and a table.")
    add_config_arguments(p)
    p.add_argument("--schemes", default="keel,pre_ln")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="timed steps per scheme")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--depths", default="16,32,64,128,256,512,1024",
                   help="sub-layer counts for the depth series (empty: none)")
    p.add_argument("--depth-steps", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto (bf16 autocast on cuda), float32, bfloat16")
    p.add_argument("--ac-every", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--out", help="directory for bench.json and bench.md")
    p.add_argument("--suite", choices=["cpu", "gpu"],
                   help="a fixed campaign instead: cpu (compile and Keel/Pre-LN on CPU; uses --steps/--warmup), "
                        "gpu (tests, d=1024 comparison, kernel, depth, deepest model; time-boxed)")
    p.add_argument("--toy", action="store_true", help="--suite gpu at toy sizes, on any device (what CI runs)")
    p.add_argument("--sections", help=f"--suite gpu: a comma-separated subset of {','.join(GPU_SECTIONS)}")
    p.add_argument("--idle-load", type=float, default=0.5,
                   help="--suite cpu: wait until the 1-minute load average is below this before timing")
    p.add_argument("--idle-wait", type=float, default=900, help="--suite cpu: wait at most this many seconds")
    p.set_defaults(func=cmd_bench)
