"""What one science point (rule 21's depth sweep, results/README.md) costs on a GPU: the time per training step of
`keel experiment depth-sweep`'s own point (d=64, 8 x 64 tokens a step, its model at each depth) on this machine's
device, float32 as on the CPU (TF32 off) and bf16 autocast, compiled as the sweep runs and eager; then the same point
in several processes at once (one GPU shared; the first depth only), the throughput a window would get running
many points side by side.

No point is trained to the end and nothing feeds a result: it measures how many of the sweep's remaining points a
GPU window could run. Usage: python benchmarks/gpu/science_probe.py OUT [--steps 150] [--depths 128,256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import keel  # noqa: F401  (before torch: keel sets the thread and allocator environment first)


def one(depth: int, scheme: str, steps: int, dtype: str, compile_: bool, device: str, mode: str = "") -> dict:
    """Train the sweep's point for `steps` steps; the median step time after the first tenth (compile, warm-up).
    `mode`: torch.compile's mode for each block's compile (e.g. reduce-overhead: CUDA graphs), patched in here only."""
    import functools

    import torch

    from keel.experiments.common import point_config, train_curve
    from keel_studies.depth_sweep import DepthSweepConfig

    if mode:
        torch.nn.Module.compile = functools.partialmethod(torch.nn.Module.compile, mode=mode)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = DepthSweepConfig()
    sweep_steps = cfg.run.steps
    cfg = replace(cfg, run=replace(cfg.run, steps=steps, device=device, dtype=dtype, compile=compile_))
    config = point_config(cfg, cfg.point_model(scheme, depth), seed=0, lr=3e-3)
    stamps = []

    def on_step(i, model, result):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())

    t0 = time.perf_counter()
    curve, _ = train_curve(config, eval_batches=1, on_step=on_step)
    total = time.perf_counter() - t0
    gaps = sorted(b - a for a, b in zip(stamps[steps // 10:], stamps[steps // 10 + 1:]))
    return {"depth": depth, "scheme": scheme, "steps": steps, "dtype": dtype, "compile": compile_, "mode": mode,
            "step_s": gaps[len(gaps) // 2], "first_step_s": stamps[0] - t0, "wall_s": total,
            "final_loss": float(curve.losses[-1]),
            "sweep_point_h": gaps[len(gaps) // 2] * sweep_steps / 3600}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--depths", default="128,256")
    p.add_argument("--parallel", type=int, default=4, help="processes sharing the GPU in the throughput part")
    p.add_argument("--specs", default="", help="instead of the default grid: depth,scheme,dtype,compile[,mode];...")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # one spec in a child process, JSON out
    a = p.parse_args()
    device = "cuda" if os.environ.get("KEEL_PROBE_DEVICE", "cuda") == "cuda" else "cpu"
    if a.one:
        depth, scheme, dtype, comp, *mode = a.one.split(",")
        print(json.dumps(one(int(depth), scheme, a.steps, dtype, comp == "1", device, *mode)), flush=True)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []

    def child(spec: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, __file__, str(a.out), "--steps", str(a.steps), "--one", spec],
                                stdout=subprocess.PIPE, text=True)

    def collect(procs, label):
        for spec, pr in procs:
            out, _ = pr.communicate()
            line = (out.strip().splitlines() or [""])[-1]
            row = json.loads(line) if line.startswith("{") else {"spec": spec, "error": pr.returncode}
            row["setting"] = label
            rows.append(row)
            print(json.dumps(row), flush=True)
            (a.out / "science_probe.json").write_text(json.dumps(rows, indent=1))

    if a.specs:
        for spec in a.specs.split(";"):
            collect([(spec, child(spec))], "alone")
        return
    depths = [int(d) for d in a.depths.split(",")]
    for depth in depths:
        alone = [f"{depth},keel,float32,1", f"{depth},pre_ln,float32,1", f"{depth},keel,float32,0",
                 f"{depth},keel,bfloat16,1"]
        for spec in alone if depth == depths[0] else alone[:1]:
            collect([(spec, child(spec))], "alone")
        if a.parallel > 1 and depth == depths[0]:
            t0 = time.perf_counter()
            collect([(s, child(s)) for s in [f"{depth},keel,float32,1"] * a.parallel], f"{a.parallel} at once")
            rows.append({"depth": depth, "setting": f"{a.parallel} at once, wall", "wall_s": time.perf_counter() - t0})
            (a.out / "science_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
