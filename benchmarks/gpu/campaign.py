"""The GPU campaign in time-boxed sections, each result written as soon as it exists.

    python benchmarks/gpu/campaign.py --out DIR [--sections tests,kernel,...] [--toy] [run.device=cuda:1]

Sections, in order: the `gpu` tests; the junction kernel alone; compile warm-up from nothing, Keel and Pre-LN,
each in a fresh process with empty caches of its own; Keel/Pre-LN eager, compiled and compiled+fused at
d=1024, batch 1 x 4096 and at the tokens per step users train with (8 x 4096 = 32k, activation checkpointing), each
beside the performance model's prediction (keel.bench.perf_model: step time, MFU, ratio), so a run says how far off
the model is; time per sub-layer against depth, Keel and Pre-LN, eager and compiled (flatness.py); and the deepest
model that trains. plan.py predicts each section's time before it runs. Each section is time-boxed and DIR/bench.json
and DIR/bench.md are rewritten after every cell, so a run cut off by its time limit still leaves data. `--toy` runs
the same campaign at toy sizes on a CPU in seconds (what CI runs). Run from the repository root: the `tests`
section runs `pytest -m gpu tests` there.
"""

from __future__ import annotations

import argparse
import gc
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from keel.launch import launcher_environment

if __name__ == "__main__":  # as keel's own commands do, before torch loads (keel.launch)
    launcher_environment()

import torch  # noqa: E402
from calibrate import modelled  # noqa: E402
from cold_compile import cold_warmup  # noqa: E402
from flatness import flatness_markdown, flatness_series  # noqa: E402
from junction_timing import copy_bandwidth, junction_bandwidth  # noqa: E402

from keel import runtime  # noqa: E402
from keel.bench.core import Bench, attempt, compare  # noqa: E402
from keel.bench.perf_model import DEVICES, TB, DeviceSpec, predict_pair  # noqa: E402
from keel.cli.bench import writer  # noqa: E402
from keel.config import RunConfig, add_config_arguments, load_config  # noqa: E402
from keel.config.reads import Reads  # noqa: E402
from keel.errors import ConfigError, KeelError  # noqa: E402
from keel.kernels.junction import can_fuse  # noqa: E402
from keel.model import ModelConfig, count_params  # noqa: E402
from keel.runtime import CUDA_NAMES, machine, resolve_device, use_bf16  # noqa: E402

GPU_SECTIONS = ("tests", "kernel", "warmup", "compare", "depth", "max_depth")
# the campaign in parts of at most 8 minutes each (their sections' time boxes add up to 420-480 s), for the short
# windows in which a GPU is lent: `python benchmarks/gpu/campaign.py --sections <part's sections> --out <dir per part>`
GPU_PARTS = {"tests": ("tests",), "kernel": ("kernel", "warmup"), "model": ("compare",),
             "depth": ("depth", "max_depth")}


@dataclass
class GpuSuite:
    """Sizes and time boxes (seconds) of the campaign; `toy()` is the same campaign at CPU-test size.

    The defaults fit one 10-minute call on an 80 GB GPU: compare runs the paper's d=1024 shape (16 heads, 8 KV
    heads, FFN 3x, vocabulary 32000) at seq 4096; from `ac_from` sub-layers on it checkpoints every block and
    holds one model at a time (two 512-sub-layer models with AdamW state do not fit together). `tokens_points`
    are (sub-layers, batch) compared at the tokens per step users train with, checkpointing every block, in
    `tokens_variants`. The depth series runs Keel and Pre-LN at `depth_d_model` with checkpointing, one model at a
    time, in `depth_variants`, so 1024 sub-layers fit too.
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
    tokens_points: tuple[tuple[int, int], ...] = ((64, 8),)  # 8 x 4096 = 32,768 tokens a step, as users train
    tokens_variants: tuple[str, ...] = ("eager", "compiled+composed", "compiled")  # the default first
    kernel_rows: int = 16384
    kernel_widths: tuple[int, ...] = (1024, 2048, 4096)
    kernel_calls: int = 20  # back-to-back calls per timing, `kernel_repeats` timings (median)
    kernel_repeats: int = 5
    warmup_sublayers: int = 64  # compile warm-up from nothing at d_model, batch_size x seq_len, compiled default
    warmup_repeats: int = 2  # each scheme this many times, the order alternating, each in a fresh process
    depth_d_model: int = 512
    depth_sublayers: tuple[int, ...] = (128, 256, 512, 1024)  # flatness.FLAT_TARGET holds over these
    depth_variants: tuple[str, ...] = ("eager", "compiled")
    depth_steps: int = 2
    depth_warmup: int = 1
    max_depth_from: int = 256
    max_depth_upto: int = 4096
    max_depth_resolution: int = 32
    test_args: tuple[str, ...] = ("-m", "gpu", "tests")
    predict_on: str | None = None  # the perf-model device printed beside measurements; None: the GPU's own by name
    # seconds per section; the campaign runs in parts of at most 8 minutes each (GPU_PARTS, benchmarks/gpu/README.md)
    boxes: dict[str, float] = field(default_factory=lambda: {
        "tests": 120, "kernel": 60, "warmup": 300, "compare": 450, "depth": 300, "max_depth": 180})

    @classmethod
    def toy(cls) -> GpuSuite:
        # compiled variants through Dynamo alone ("eager" backend): the graphs, recompiles and fused-junction counts
        # the toy runs check are Dynamo's and the model's; AOTAutograd's trace of the same model (with the fused
        # junction, under AC) is tests/test_fused_junction_model.py's and
        # test_compile.py's, and costs the toy campaign a fifth more CPU time. The fused junction runs in triton's
        # interpreter here, one program a row (its backward 4 programs, each looping over its rows): seq_len 8 and
        # kernel_rows 16 keep the rows few, one timed step after the warm-up one still alternates the order
        return cls(d_model=32, n_heads=2, n_kv_heads=1, vocab_size=256, seq_len=8, batch_size=2, dtype="auto",
                   compile_backend="eager", steps=1, warmup=1, compare_sublayers=(4, 8), ac_from=8,
                   together_upto=4, tokens_points=((4, 4),), kernel_rows=16, kernel_widths=(32, 48), kernel_calls=1,
                   kernel_repeats=1, warmup_sublayers=4, warmup_repeats=1, depth_d_model=32,
                   depth_sublayers=(4, 8, 16), depth_steps=1, max_depth_from=4,
                   max_depth_upto=16, max_depth_resolution=4, test_args=("-m", "gpu", "tests/test_junction.py"),
                   predict_on="H100")

    def model(self, n_sublayers: int, scheme: str = "keel", d_model: int | None = None) -> ModelConfig:
        d = d_model or self.d_model
        return ModelConfig(vocab_size=self.vocab_size, d_model=d, n_blocks=n_sublayers // 2,
                           n_heads=self.n_heads * d // self.d_model, n_kv_heads=self.n_kv_heads * d // self.d_model,
                           max_seq_len=self.seq_len, scheme=scheme)

    def run(self, ac_every: int = 0, compile: bool = False, fused_junction: str = "auto",
            batch_size: int | None = None) -> RunConfig:
        return RunConfig(batch_size=batch_size or self.batch_size, seq_len=self.seq_len, dtype=self.dtype,
                         compile=compile, fused_junction=fused_junction, ac_every=ac_every)

    def bench_options(self, device: torch.device) -> dict:
        return {"device": device, "compile_backend": self.compile_backend, "init_on_device": device.type == "cuda"}


# variant -> (run.compile, run.fused_junction). "compiled+composed" (Keel's junction fused across blocks by Inductor)
# is the default under compile (keel.scale.fused_junction.junction_impl), measured fastest on one H200 (2026-11-26);
# "compiled" leaves the junction to Inductor inside each block. The performance model's view of each:
# calibrate.modelled.
VARIANTS = {"eager": (False, "off"), "compiled": (True, "off"), "compiled+composed": (True, "composed"),
            "compiled+fused": (True, "on")}


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
    """The `gpu`-marked tests, in a child process (they set up CUDA, compile and triton state of their own), each
    test's time printed as it ends (pytest's `console_output_style=times`), so even a run cut off by its box says
    which tests cost what: the costly ones are the ones to split or shrink, so the suite fits a short window."""
    start = time.monotonic()
    args = [sys.executable, "-m", "pytest", *suite.test_args, "-v", "-o", "console_output_style=times", "-p",
            "no:cacheprovider"]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=max(1.0, deadline - start))
    except subprocess.TimeoutExpired as err:
        partial = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else err.stdout or ""
        out["tests"] = {"args": list(suite.test_args), "summary": "timed out", "seconds": time.monotonic() - start,
                        "slowest": pytest_times(partial), "output_tail": partial[-2000:]}
        return "time box reached"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    out["tests"] = {"args": list(suite.test_args), "returncode": proc.returncode, "seconds": time.monotonic() - start,
                    "summary": lines[-1].strip("= ") if lines else proc.stderr[-500:],
                    "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))],
                    "slowest": pytest_times(proc.stdout)}


_TEST_TIME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+([\d.]+)(us|ms|s)\b", re.M)
_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def pytest_times(output: str, keep: int = 15) -> list[dict]:
    """The `keep` slowest tests of a `pytest -v -o console_output_style=times` output, slowest first."""
    times = [{"test": m[1], "outcome": m[2], "seconds": float(m[3]) * _UNIT[m[4]]} for m in _TEST_TIME.finditer(output)]
    return sorted(times, key=lambda t: -t["seconds"])[:keep]


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


def _section_warmup(suite, device, out, deadline, save):
    """Compile warm-up from nothing, Keel against Pre-LN, at `warmup_sublayers` with the compiled default: each
    first training step in a fresh Python process with an empty Inductor (and Triton) cache of its own, the order
    alternating (cold_compile.py). The 2026-11-24 run compiled Keel first in one process (43 s) and
    Pre-LN second, reusing Keel's cached kernels (3.7 s): this is the fair comparison, with each scheme's graph and
    recompile counts."""
    out["warmup"] = {"n_sublayers": suite.warmup_sublayers, "repeats": suite.warmup_repeats, "schemes": {}}

    def progress(schemes):
        out["warmup"]["schemes"] = schemes
        save()
    schemes = cold_warmup(suite.model(suite.warmup_sublayers), suite.run(compile=True), ["keel", "pre_ln"],
                          device=device, repeats=suite.warmup_repeats, processes=True, deadline=deadline,
                          progress=progress, compile_backend=suite.compile_backend,
                          init_on_device=device.type == "cuda")
    out["warmup"]["schemes"] = schemes
    keel, pre_ln = schemes.get("keel", {}), schemes.get("pre_ln", {})
    if keel.get("n") and keel.get("n") == pre_ln.get("n"):  # the same number of each: the alternation stays fair
        out["warmup"]["keel_over_pre_ln"] = keel["first_step_s"] / pre_ln["first_step_s"]
    save()
    if any(r["n"] + len(r.get("failed", [])) < suite.warmup_repeats for r in schemes.values()) or len(schemes) < 2:
        return "time box reached"


# The other parts of those families, by the same datasheets (dense peaks): the PCIe and NVL cards share the name
# "H100" with the SXM part but not its clocks, power or memory, so a CUDA name is matched part by part (`gpu_spec`)
PARTS = {
    # H100 PCIe: BF16 756 TFLOPS dense, FP32 51 TFLOPS, HBM2e 2.0 TB/s, 80 GB
    "H100 PCIe": replace(DEVICES["H100"], name="H100 PCIe", bf16_flops=756 * TB, fp32_flops=51 * TB,
                         bandwidth=2.0 * TB, source="NVIDIA H100 datasheet (PCIe)"),
    # H100 NVL: BF16 835 TFLOPS dense, FP32 60 TFLOPS, HBM3 3.9 TB/s, 94 GB (memory: no usable figure measured,
    # so `fits` does not answer for it)
    "H100 NVL": replace(DEVICES["H100"], name="H100 NVL", bf16_flops=835 * TB, fp32_flops=60 * TB,
                        bandwidth=3.9 * TB, memory=float("nan"), source="NVIDIA H100 datasheet (NVL)"),
    # H200 NVL: BF16 835 TFLOPS dense, FP32 60 TFLOPS, HBM3e 4.8 TB/s, 141 GB
    "H200 NVL": replace(DEVICES["H200"], name="H200 NVL", bf16_flops=835 * TB, fp32_flops=60 * TB,
                        source="NVIDIA H200 datasheet (NVL)"),
    # A100 80GB PCIe: the SXM part's compute, HBM2e 1,935 GB/s
    "A100 PCIe": replace(DEVICES["A100"], name="A100 PCIe", bandwidth=1.935 * TB,
                         source="NVIDIA A100 datasheet (80GB PCIe)"),
}


def gpu_spec(name: str) -> DeviceSpec | None:
    """The spec of the part with this CUDA device name (e.g. "NVIDIA H100 80GB HBM3": the SXM part, "NVIDIA H100
    PCIe": the PCIe card), matched whole; None for a name not in CUDA_NAMES (no guess from a part of the name)."""
    key = CUDA_NAMES.get(name.strip())
    return None if key is None else DEVICES.get(key) or PARTS.get(key)


def predicted(suite: GpuSuite, device: torch.device, n_sublayers: int, variant: str, ac_every: int,
              batch_size: int | None = None) -> dict | None:
    """The performance model's step time, tokens/s and MFU of Keel and Pre-LN, and their ratio, for one compare
    cell; None on a device the model has no spec for."""
    name = suite.predict_on or (torch.cuda.get_device_name(device) if device.type == "cuda" else "")
    spec = DEVICES.get(name) or gpu_spec(name)
    if spec is None:
        return None
    impl, code = modelled(variant)
    p = predict_pair(suite.model(n_sublayers), batch_size or suite.batch_size, suite.seq_len, spec, impl,
                     use_bf16(device, suite.dtype), ac_every, code)
    keep = ("step_time_s", "tokens_per_s", "mfu")
    return {"device": spec.name, "keel_over_pre_ln_step_time": p["keel_over_pre_ln_step_time"],
            **{s: {k: p[s][k] for k in keep} for s in ("keel", "pre_ln")}}


def compare_points(suite: GpuSuite) -> list[dict]:
    """The compare cells in the order they run: each of `compare_sublayers` at batch `batch_size` in every
    variant (checkpointing from `ac_from` sub-layers), then each of `tokens_points` in `tokens_variants`,
    checkpointing every block. Keys of sections["compare"]: the sub-layers, and "<sub-layers>/batch<b>"."""
    points = [{"key": str(n), "n_sublayers": n, "batch_size": suite.batch_size,
               "ac_every": 1 if n >= suite.ac_from else 0, "variants": list(VARIANTS)}
              for n in suite.compare_sublayers]
    return points + [{"key": f"{n}/batch{b}", "n_sublayers": n, "batch_size": b, "ac_every": 1,
                      "variants": list(suite.tokens_variants)} for n, b in suite.tokens_points]


META = ("ac_every", "n_sublayers", "batch_size")  # what a row of sections["compare"] says besides its variants


def _section_compare(suite, device, out, deadline, save):
    """Keel against Pre-LN at each point of `compare_points`: eager, compiled, compiled with the fused junction;
    each beside its prediction."""
    out["compare"] = {}
    for point in compare_points(suite):
        torch._dynamo.reset()  # new constants (alpha = L) at each depth: keep well inside the recompile limit
        n, batch = point["n_sublayers"], point["batch_size"]
        rows = out["compare"][point["key"]] = {k: point[k] for k in META}
        for variant in point["variants"]:
            compile, fused = VARIANTS[variant]
            if time.monotonic() > deadline:
                rows[variant] = {"skipped": "time box reached"}
                continue
            if fused == "on" and not can_fuse(device, suite.d_model):
                rows[variant] = {"skipped": f"the fused junction cannot run on {device}"}
                continue
            def pair(n=n, ac_every=rows["ac_every"], compile=compile, fused=fused, batch=batch):
                together = n * batch <= suite.together_upto * suite.batch_size  # two models' activations fit
                return compare(suite.model(n), suite.run(ac_every, compile, fused, batch), ["keel", "pre_ln"],
                               suite.steps, suite.warmup, together=together, **suite.bench_options(device))

            r = attempt(pair, device)
            rows[variant] = r if isinstance(r, dict) else {"failed": r}
            rows[variant]["predicted"] = predicted(suite, device, n, variant, rows["ac_every"], batch)
            save()
    if any(v == {"skipped": "time box reached"} for rows in out["compare"].values() for v in rows.values()):
        return "time box reached"


def _section_depth(suite, device, out, deadline, save):
    """Time per sub-layer of Keel and Pre-LN at each of `depth_sublayers`, checkpointing every block, in each of
    `depth_variants` (eager first: the step without the compiler's help), one model at a time (flatness.py)."""
    out["depth"] = {"d_model": suite.depth_d_model, "ac_every": 1, "variants": {}}
    for variant in suite.depth_variants:
        compile, fused = VARIANTS[variant]

        def on_row(summary, variant=variant):
            out["depth"]["variants"][variant] = summary
            save()
        on_row(flatness_series(suite.model(2, d_model=suite.depth_d_model), suite.run(1, compile, fused),
                               suite.depth_sublayers, steps=suite.depth_steps, warmup=suite.depth_warmup,
                               deadline=deadline, on_row=on_row, **suite.bench_options(device)))
    if any("skipped" in r for v in out["depth"]["variants"].values() for r in v["rows"]):
        return "time box reached"


def _section_max_depth(suite, device, out, deadline, save):
    """The most sub-layers that train (two steps) at d_model with checkpointing: doubling, then bisection."""
    trials = []
    out["max_depth"] = {"d_model": suite.d_model, "ac_every": 1, "trials": trials, "largest": None}

    def trains(n):
        def two_steps():
            b = Bench(suite.model(n), suite.run(ac_every=1), **suite.bench_options(device))
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


SECTIONS = {"tests": _section_tests, "kernel": _section_kernel, "warmup": _section_warmup, "compare": _section_compare,
            "depth": _section_depth, "max_depth": _section_max_depth}


def gpu_markdown(result: dict) -> str:
    m, s, sec = result["machine"], result["settings"], result["sections"]
    lines = [f"# GPU campaign ({m['gpu'] or m['cpu']}, torch {m['torch_version']})", "",
             "Status: " + ", ".join(f"{k} {v}" for k, v in result["status"].items()), ""]
    if "tests" in sec:
        t = sec["tests"]
        lines += [f"## Tests (`pytest {' '.join(t['args'])}`)", "", f"{t['summary']} ({t['seconds']:.0f} s)", ""]
        lines += [f"- {f}" for f in t.get("failures", [])]
        if t.get("slowest"):
            lines += ["", "Slowest: " + ", ".join(f"{x['test'].split('::')[-1]} {x['seconds']:.1f} s"
                                                   for x in t["slowest"][:8]), ""]
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
    if "warmup" in sec:
        w = sec["warmup"]
        lines += [f"## Compile warm-up from nothing ({w['n_sublayers']} sub-layers, compiled default)", "",
                  f"Each scheme's first training step in a fresh process with empty caches of its own, {w['repeats']} "
                  "time(s), the order alternating; median.", "",
                  "| scheme | first step (s) | each (s) | second step (s) | graphs | recompiles |",
                  "|---|---|---|---|---|---|"]
        for scheme, r in w["schemes"].items():
            if not r["n"]:
                lines.append(f"| {scheme} | failed: {'; '.join(r['failed'])} | | | | |")
                continue
            each = ", ".join(f"{t:.1f}" for t in r.get("each_first_step_s", [r["first_step_s"]]))
            lines.append(f"| {scheme} | {r['first_step_s']:.1f} | {each} | {r['second_step_s']:.3f} | {r['graphs']} | "
                         f"{r['recompiles']} |")
        if "keel_over_pre_ln" in w:
            lines += ["", f"Keel / Pre-LN warm-up: **{w['keel_over_pre_ln']:.2f}x**"]
        lines.append("")
    if "compare" in sec:
        devices = {r["predicted"]["device"] for rows in sec["compare"].values() for k, r in rows.items()
                   if k not in META and r.get("predicted")}
        lines += [f"## Keel vs Pre-LN, d={s['d_model']}, seq {s['seq_len']}, batch {s['batch_size']} (and the "
                  f"points named with their batch), {s['dtype']}",
                  "", "Measured, and in brackets PREDICTED by keel.bench.perf_model "
                  f"({', '.join(sorted(devices)) or 'no spec for this device'}).", "",
                  "| sub-layers | variant | scheme | step (ms) [predicted] | measured/predicted | tokens/s | MFU "
                  "[predicted] | peak memory (GiB) | warm-up (s) | Keel/Pre-LN [predicted] |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for n, rows in sec["compare"].items():
            label = rows.get("n_sublayers", n)
            label = f"{label}{' (AC)' if rows['ac_every'] else ''}" + (
                f", batch {rows['batch_size']}" if rows.get("batch_size", s["batch_size"]) != s["batch_size"] else "")
            for variant, r in rows.items():
                if variant in META:
                    continue
                if "keel" not in r:
                    lines.append(f"| {label} | {variant} | - | {r.get('skipped') or r.get('failed')} | | | | | | |")
                    continue
                p = r.get("predicted")
                for scheme in ("keel", "pre_ln"):
                    x, px = r[scheme], (p or {}).get(scheme)
                    mfu = f"{x['mfu']:.1%}" if x["mfu"] is not None else "n/a"
                    mem = f"{x['peak_memory_bytes'] / 2**30:.1f}" if x["peak_memory_bytes"] else "n/a"
                    ratio = f"**{r['keel_over_pre_ln_step_time']:.3f}**" if scheme == "keel" else ""
                    if px:
                        mfu += f" [{px['mfu']:.1%}]"
                        ratio += f" [{p['keel_over_pre_ln_step_time']:.3f}]" if scheme == "keel" else ""
                    step = f"{1e3 * x['step_time_s']:.1f}" + (f" [{1e3 * px['step_time_s']:.1f}]" if px else "")
                    off = f"{x['step_time_s'] / px['step_time_s']:.2f}x" if px else "n/a"
                    lines.append(f"| {label} | {variant} | {scheme} | {step} | "
                                 f"{off} | {x['tokens_per_s']:,.0f} | {mfu} | {mem} | {x['warmup_s']:.1f} | {ratio} |")
        lines.append("")
    if "depth" in sec:
        for variant, summary in sec["depth"]["variants"].items():
            lines += flatness_markdown(summary, f"## Time per sub-layer ({variant}, d={sec['depth']['d_model']}, "
                                                f"seq {s['seq_len']}, batch {s['batch_size']}, AC every block)")
    if "max_depth" in sec:
        d = sec["max_depth"]
        lines += [f"## Deepest Keel that trains (d={d['d_model']}, AC every block)", "",
                  f"Largest: **{d['largest']}** sub-layers; first failing: {d.get('first_failing')}. Trials: "
                  + ", ".join(f"{t['n_sublayers']} {'ok' if t['trains'] else t['failed']}" for t in d["trials"]), ""]
    return "\n".join(lines) + "\n"


def freeze_imports() -> None:
    """For toy runs: what the imports made, out of Python's full collections (each model's release, keel.bench.core's
    `free`, collects in full). At toy size, walking those objects (about 400,000) was a tenth of the campaign's CPU
    time. Dynamo's own imports (sympy, networkx by way of functorch's partitioner: about 160,000 objects more) come
    with the first compile, after a freeze at start, so they are imported first: the toy runs compile anyway, and a
    GPU run never freezes."""
    import torch._dynamo  # noqa: F401, PLC0415
    import torch._functorch.partitioners  # noqa: F401, PLC0415

    gc.collect()
    gc.freeze()


COMMAND = "benchmarks/gpu/campaign.py"
# what the campaign reads of keel's merged config (a file or key=value overrides): its sizes are its own
READS = Reads(COMMAND, ("run.threads", "run.device"), "a fixed campaign; it takes run.device")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=COMMAND, description="The GPU campaign in time-boxed sections (run from the "
                                "repository root).")
    add_config_arguments(p)
    p.add_argument("--out", help="directory for bench.json and bench.md, rewritten as results come")
    p.add_argument("--sections", help=f"a comma-separated subset of {','.join(GPU_SECTIONS)}, run in the order given "
                                      "(default: all, in that order)")
    p.add_argument("--toy", action="store_true", help="the same campaign at toy sizes, on any device (what CI runs)")
    return p


def run(args) -> dict:
    if args.preset:
        raise ConfigError(f"--preset: not used by {COMMAND} ({READS.why})")
    config = load_config(args.overrides, args.config, None, READS)
    runtime.set_threads(config.run.threads)
    sections = args.sections.split(",") if args.sections else list(GPU_SECTIONS)
    unknown = set(sections) - set(GPU_SECTIONS)
    if unknown:
        raise ConfigError(f"--sections: unknown {', '.join(sorted(unknown))}; allowed: {', '.join(GPU_SECTIONS)}")
    device = resolve_device(config.run.device)
    if device.type != "cuda" and not args.toy:
        raise ConfigError("needs a CUDA device (its sizes are a GPU's); --toy runs it at toy size here")
    if args.toy:
        freeze_imports()
    result = gpu_suite(GpuSuite.toy() if args.toy else GpuSuite(), device,
                       writer(Path(args.out) if args.out else None, gpu_markdown), sections)
    print(gpu_markdown(result))
    return result


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_intermixed_args(argv)
    try:
        run(args)
    except KeelError as err:  # a field or flag it does not take: one line, as keel's own commands answer
        print(f"{COMMAND}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
