"""Where a training step's time goes, by kind of kernel: Keel against Pre-LN under torch.profiler.

At 32k tokens a step on one H100 (2026-11-26) compiled Keel took 1.041x Pre-LN's step where the calibrated
performance model predicts 1.018, and Inductor's byte count on CPU 1.02-1.03: the step time alone cannot say which
kernels carry the rest. `profile_schemes` builds each scheme's model alone (the one before freed), runs its
warm-up steps (compiles), then profiles `steps` training steps and sums the time of every kernel by category
(`category`: matmul, attention, Inductor's reductions and pointwise kernels, the optimizer, copies, other), with
kernel counts, so a window on a GPU prints Keel - Pre-LN per category, and per kernel name (Inductor's names list
the ops each kernel fuses: which work the extra kernels do). `phase_times` then splits further steps
into forward, backward and the rest (clip and optimizer) by wall time, each phase ended by a device sync, so the
same table says whether Keel's extra time is in its forward (the junction), its backward (two norms' gradients and
the checkpointed recomputation) or its optimizer.

On CUDA the time is each device kernel's own time; on a CPU, where there are no device kernels, each ATen
operator's self time on the host (the same table, read as host work).
"""

from __future__ import annotations

import re
import time

import torch
from torch._inductor import config as inductor_config
from torch.profiler import ProfilerActivity, profile

from keel.bench.core import Bench, free, fresh_compile_state, scheme_config
from keel.config import OptimConfig, RunConfig
from keel.model import ModelConfig

# (category, pattern on the kernel or operator name), the first match wins. Inductor's kernels first: their names
# list the ops fused into them (`triton_poi_fused__scaled_dot_product_efficient_attention__to_copy_...` is a
# pointwise kernel feeding attention, not attention). On a CPU only the leaf products (aten::mm, not aten::linear
# or aten::matmul, which call it) count as matmul, so counts are calls of the kernel, not of its wrappers.
CATEGORIES = (
    ("matmul", r"triton_tem_"),
    ("reduction (compiled)", r"triton_(?:red|per)_|cpp_fused.*(?:sum|mean|rsqrt|pow)"),
    ("pointwise (compiled)", r"triton_poi_|cpp_fused"),
    ("attention", r"flash|fmha|attention|sdpa|scaled_dot_product|cudnn::fusion"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|aten::(?:mm|addmm|bmm|baddbmm)\b"),
    ("optimizer", r"adam|multi_tensor|foreach|optimizer"),
    ("copy", r"memcpy|memset|copy_|aten::(?:to|_to_copy|clone|contiguous|fill_|zero_)\b|elementwise_kernel.*copy"),
    ("norm (eager)", r"rms_norm|layer_norm|rsqrt|aten::(?:pow|mean)\b"),
)
NAMES = tuple(dict.fromkeys(c for c, _ in CATEGORIES)) + ("other",)
_COMPILED = tuple((c, re.compile(p, re.IGNORECASE)) for c, p in CATEGORIES)


def category(name: str) -> str:
    """The category of a kernel or operator, by its name."""
    return next((c for c, p in _COMPILED if p.search(name)), "other")


def kernel_name(name: str) -> str:
    """A kernel's name without the numbers Inductor adds to tell kernels and graphs apart
    (`triton_red_fused_add_mul_rsqrt_sum_7` -> `triton_red_fused_add_mul_rsqrt_sum`; on a CPU
    `graph_1_cpp_fused_add_mean_mul_pow_rsqrt_3` -> `cpp_fused_add_mean_mul_pow_rsqrt`): what it fuses, so the same
    work in Keel's graphs and Pre-LN's shares a name."""
    return re.sub(r"_\d+$", "", re.sub(r"^graph_\d+_", "", name))


def kernel_times(prof, cuda: bool, by: str = "category") -> dict[str, dict[str, float]]:
    """Per category (`by="name"`: per `kernel_name`): milliseconds (device kernels' own time on CUDA, operators'
    self time on the host otherwise) and the number of kernels or operators, over everything `prof` recorded."""
    out = {c: {"ms": 0.0, "count": 0} for c in NAMES} if by == "category" else {}
    for e in prof.key_averages():
        if cuda:  # kernels only: not host operators, nor the annotations (Optimizer.step#AdamW.step) shown on the
            # device's timeline, which span kernels already counted (torch's own table skips them too)
            if e.device_type != torch.autograd.DeviceType.CUDA or e.is_user_annotation:
                continue
            us = e.self_device_time_total
        else:
            if e.device_type != torch.autograd.DeviceType.CPU or e.key.startswith(("ProfilerStep", "## ")):
                continue
            us = e.self_cpu_time_total
        row = out[category(e.key)] if by == "category" else out.setdefault(kernel_name(e.key), {"ms": 0.0, "count": 0})
        row["ms"] += us / 1e3
        row["count"] += e.count
    return out


PHASES = ("forward", "backward", "rest")


class PhaseClock:
    """Wall time of each phase of a TrainStep, each phase ended by a device sync: forward (the model's call, loss
    included: from its forward pre-hook to its forward hook), backward (from there to the next micro-batch's forward,
    or to `after_backward` after the last), and the rest (clip, the guard, the optimizer step, zeroing gradients: to
    the end of the step). The syncs keep the device from running ahead of the host, which costs a little overlap, so
    the phases add up to somewhat more than an unsynced step."""

    def __init__(self, bench: Bench):
        self.bench, self.ms = bench, dict.fromkeys(PHASES, 0.0)
        self._phase, self._mark = None, 0.0

    def _sync(self) -> None:
        if self.bench.device.type == "cuda":
            torch.cuda.synchronize(self.bench.device)

    def _switch(self, phase: str | None) -> None:
        self._sync()
        now = time.perf_counter()
        if self._phase is not None:
            self.ms[self._phase] += 1e3 * (now - self._mark)
        self._phase, self._mark = phase, now

    def run(self, steps: int) -> dict[str, float]:
        """Per phase, milliseconds per step over `steps` training steps."""
        model, step = self.bench.model, self.bench.train_step
        hooks = [model.register_forward_pre_hook(lambda *_: self._switch("forward")),
                 model.register_forward_hook(lambda *_: self._switch("backward"))]
        before, step.after_backward = step.after_backward, lambda _model: self._switch("rest")
        try:
            for _ in range(steps):
                step(lambda: self.bench.batch, self.bench.lr)
                self._switch(None)
        finally:
            step.after_backward = before
            for hook in hooks:
                hook.remove()
        return {p: ms / steps for p, ms in self.ms.items()}


def phase_times(bench: Bench, steps: int) -> dict[str, float]:
    """Milliseconds per step in forward, backward and the rest (`PhaseClock`), over `steps` more training steps."""
    return PhaseClock(bench).run(steps)


def profile_scheme(config: ModelConfig, run: RunConfig, device: torch.device, steps: int = 2, warmup: int = 2,
                   optim: OptimConfig | None = None, **bench_options) -> dict:
    """One scheme's model built alone, `warmup` untimed steps, then `steps` profiled: per category the
    milliseconds and kernel count per step, and the step's total."""
    fresh_compile_state()
    # on a CPU Inductor's C++ kernels are recorded only when compiled to be (else their time is the self time of
    # the whole graph's call)
    with inductor_config.patch({"cpp.enable_kernel_profile": device.type != "cuda"}):
        bench = Bench(config, run, optim, device, **bench_options)
        for _ in range(warmup):
            bench.step(record=False)
        result = profile_steps(bench, steps)
    del bench
    free(device)
    return result


def profile_steps(bench: Bench, steps: int = 2) -> dict:
    """`steps` training steps of a built and warmed-up Bench under torch.profiler: per category and per kernel name
    (`kernel_name`) the milliseconds and kernel count per step, the step's total, then `phase_times` over `steps`
    more steps."""
    cuda = bench.device.type == "cuda"
    bench.times.clear()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            bench.step()
    times = kernel_times(prof, cuda)
    per_step = {c: {"ms": t["ms"] / steps, "count": t["count"] / steps} for c, t in times.items()}
    names = sorted(kernel_times(prof, cuda, by="name").items(), key=lambda kv: -kv[1]["ms"])
    del prof
    return {"categories": per_step, "total_ms": sum(t["ms"] for t in per_step.values()),
            "by_name": {n: {"ms": t["ms"] / steps, "count": t["count"] / steps} for n, t in names},
            "step_time_ms": 1e3 * min(bench.times), "kernels": "device" if cuda else "host operators",
            "phases_ms": phase_times(bench, steps)}


def profile_schemes(config: ModelConfig, run: RunConfig, schemes: list[str], device: torch.device,
                    steps: int = 2, warmup: int = 2, **bench_options) -> dict:
    """`profile_scheme` for each scheme in turn (each model freed before the next is built); `bench_options`:
    Bench's compile_backend and init_on_device (GpuSuite.bench_options names the device too)."""
    return {"d_model": config.d_model, "n_sublayers": config.n_sublayers, "batch_size": run.batch_size,
            "seq_len": run.seq_len, "ac_every": run.ac_every, "compile": run.compile,
            "fused_junction": run.fused_junction, "steps": steps,
            "schemes": {s: profile_scheme(scheme_config(config, s), run, device, steps, warmup, **bench_options)
                        for s in schemes}}


def profile_markdown(result: dict, top: int = 12) -> str:
    """Per category, each scheme's milliseconds and count per step, and Keel - Pre-LN; then the `top` kernels by
    name whose Keel - Pre-LN time is largest either way."""
    schemes = result["schemes"]
    names = list(schemes)
    pair = "keel" in schemes and "pre_ln" in schemes
    kind = next(iter(schemes.values()))["kernels"]
    lines = [f"Time per training step by kind of kernel ({kind}; d={result['d_model']}, {result['n_sublayers']} "
             f"sub-layers, batch {result['batch_size']} x {result['seq_len']}"
             + (", AC every block" if result["ac_every"] == 1 else "")
             + (f", compiled ({result['fused_junction']})" if result["compile"] else ", eager")
             + f"; {result['steps']} profiled steps, per step):", "",
             "| category | " + " | ".join(f"{s} ms (kernels)" for s in names)
             + (" | Keel - Pre-LN ms |" if pair else " |"),
             "|---" * (len(names) + 1 + pair) + "|"]
    for c in NAMES + ("total",):
        cells = []
        for s in names:
            r = schemes[s]
            cells.append(f"{r['total_ms']:.2f}" if c == "total" else
                         f"{r['categories'][c]['ms']:.2f} ({r['categories'][c]['count']:.0f})")
        row = f"| {c} | " + " | ".join(cells)
        if pair:
            k, p = schemes["keel"], schemes["pre_ln"]
            diff = (k["total_ms"] - p["total_ms"] if c == "total" else
                    k["categories"][c]["ms"] - p["categories"][c]["ms"])
            row += f" | {diff:+.2f}"
        lines.append(row + " |")
    lines += ["", "Step time while profiled (fastest step, ms): " + ", ".join(
        f"{s} {schemes[s]['step_time_ms']:.1f}" for s in names) + "."]
    if all("phases_ms" in schemes[s] for s in names):
        lines += ["", "Wall time per step by phase (ms; each phase ended by a device sync, not profiled):", "",
                  "| phase | " + " | ".join(names) + (" | Keel - Pre-LN | Keel / Pre-LN |" if pair else " |"),
                  "|---" * (len(names) + 1 + 2 * pair) + "|"]
        for phase in (*PHASES, "total"):
            ms = {s: sum(schemes[s]["phases_ms"].values()) if phase == "total" else schemes[s]["phases_ms"][phase]
                  for s in names}
            row = f"| {phase} | " + " | ".join(f"{ms[s]:.2f}" for s in names)
            if pair:
                ratio = f"{ms['keel'] / ms['pre_ln']:.3f}" if ms["pre_ln"] > 0 else "n/a"
                row += f" | {ms['keel'] - ms['pre_ln']:+.2f} | {ratio}"
            lines.append(row + " |")
    if pair and all("by_name" in schemes[s] for s in names):
        k, p = schemes["keel"]["by_name"], schemes["pre_ln"]["by_name"]
        zero = {"ms": 0.0, "count": 0}
        diffs = sorted(set(k) | set(p), key=lambda n: -abs(k.get(n, zero)["ms"] - p.get(n, zero)["ms"]))[:top]
        lines += ["", f"The {len(diffs)} kernels (by name, Inductor's number dropped: what each fuses) whose time "
                  "differs most:", "", "| kernel | keel ms (kernels) | pre_ln ms (kernels) | Keel - Pre-LN ms |",
                  "|---|---|---|---|"]
        for n in diffs:
            a, b = k.get(n, zero), p.get(n, zero)
            lines.append(f"| `{n[:100]}` | {a['ms']:.2f} ({a['count']:.0f}) | {b['ms']:.2f} ({b['count']:.0f}) | "
                         f"{a['ms'] - b['ms']:+.2f} |")
    return "\n".join(lines) + "\n"
