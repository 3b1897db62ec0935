"""`keel bench --suite cpu`: compiled against eager, Keel against Pre-LN, four models stepping alternately in
one process, at the bench shape and at the default `keel train` job's shape. It waits for an idle machine first
and records the load average: on a small shared machine any other job's work lands in the step times."""

from __future__ import annotations

import os
import time
from dataclasses import asdict

import torch

from keel.bench.core import Bench, alternate, scheme_config, summarize
from keel.model.presets import cpu_demo
from keel.runtime import machine
from keel.train.config import RunConfig


def wait_for_idle(max_load: float, timeout_s: float) -> dict:
    """Wait (up to `timeout_s`) until the 1-minute load average is below `max_load`. Returns the seconds waited
    and the load average then."""
    start = time.monotonic()
    while os.getloadavg()[0] >= max_load and time.monotonic() - start < timeout_s:
        time.sleep(15)
    return {"waited_s": round(time.monotonic() - start), "load_average": os.getloadavg(),
            "idle": os.getloadavg()[0] < max_load}


# The bench shape of benchmarks/cpu/ and the default `keel train` job's (preset cpu-demo): (model overrides, batch, seq)
CPU_SHAPES = {"bench": ({"n_blocks": 8, "max_seq_len": 64}, 4, 64), "train-default": ({"max_seq_len": 128}, 16, 128)}
CPU_TARGETS = {"compiled_keel_over_pre_ln_at_most": 1.03, "compiled_speedup_at_least": 1.3}
VARIANTS = ("eager", "compiled")


def cpu_suite(steps: int, warmup: int, write, max_load: float = 0.5, wait_s: float = 900, shapes=None,
              compile_backend: str = "inductor") -> dict:
    """Eager and compiled, Keel and Pre-LN: four models stepping alternately in this process, per shape.
    `shapes` (default CPU_SHAPES) and `compile_backend` are for tests."""
    device, shapes = torch.device("cpu"), shapes or CPU_SHAPES
    models = {name: cpu_demo(**overrides) for name, (overrides, _, _) in shapes.items()}
    result = {"suite": "cpu", "machine": machine(device), "settings": {
        "shapes": {k: {"model": asdict(models[k]), "n_sublayers": models[k].n_sublayers, "batch_size": b,
                       "seq_len": t} for k, (_, b, t) in shapes.items()},
        "steps": steps, "warmup": warmup, "dtype": "float32", "compile_backend": compile_backend},
        "idle_check": wait_for_idle(max_load, wait_s) | {"max_load": max_load}, "shapes": {}}
    for name, (_, batch, seq) in shapes.items():
        torch._dynamo.reset()  # each shape compiles afresh, well inside Dynamo's recompile limit
        load_before = os.getloadavg()
        benches = {f"{s}/{v}": Bench(scheme_config(models[name], s),
                                     RunConfig(batch_size=batch, seq_len=seq, dtype="float32", compile=v == "compiled",
                                               fused_junction="off"), device=device, compile_backend=compile_backend)
                   for s in ("keel", "pre_ln") for v in VARIANTS}
        warm = alternate(benches, steps, warmup)
        rows = {k: summarize(b) | {"warmup_s": warm[k]} for k, b in benches.items()}
        time_of = {k: r["step_time_s"] for k, r in rows.items()}
        ratio = {v: time_of[f"keel/{v}"] / time_of[f"pre_ln/{v}"] for v in VARIANTS}
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
        lines += [f"## {name}: d_model={cfg['model']['d_model']}, {cfg['n_sublayers']} sub-layers, "
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
