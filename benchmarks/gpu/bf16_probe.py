"""Where `paper-2048` with run.weights=bfloat16 runs out of memory on an 80 GB H100 (the GPU window of
2026-11-26 found that it does, against a plan of 72.6 GiB): device memory after each stage of two training steps
(build, each step's forward, backward and optimizer step), and the allocator's message where it fails.

    python benchmarks/gpu/bf16_probe.py [--toy]   (set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to compare)
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

import torch

from keel.bench.core import Bench
from keel.config.presets import train_preset
from keel.reporting.plan import memory_plan
from keel.runtime import GPU_MEMORY

GiB = 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--toy", action="store_true")
    p.add_argument("--preset", default="paper-2048")
    p.add_argument("--cap", type=float, default=GPU_MEMORY["H100 80GB"] / 2**30)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = train_preset(args.preset)
    if args.toy:
        config = replace(config, model=replace(config.model, d_model=32, n_heads=2, n_kv_heads=1, d_ffn=96,
                                               vocab_size=256, max_seq_len=16, n_blocks=4))
    run = replace(config.run, grad_accum=1, seq_len=config.model.max_seq_len, device=str(device), weights="bfloat16",
                  dtype="bfloat16" if device.type == "cpu" else config.run.dtype)
    config = replace(config, run=run)
    plan = memory_plan(config, device=device)
    print(f"alloc conf {os.environ.get('PYTORCH_CUDA_ALLOC_CONF')!r}; plan {plan['total'] / GiB:.1f} GiB at "
          f"{plan.get('peak_phase')}: " + ", ".join(f"{k} {v / GiB:.1f}" for k, v in plan.items()
                                                    if isinstance(v, int | float) and k != "total"), flush=True)
    cuda = device.type == "cuda"
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap * GiB / total), torch.cuda.current_device())

    def mem(stage: str) -> None:
        if cuda:
            torch.cuda.synchronize(device)
            print(f"{time.monotonic() - start:7.1f} s  {stage:28s} allocated {torch.cuda.memory_allocated() / GiB:6.1f}"
                  f"  peak {torch.cuda.max_memory_allocated() / GiB:6.1f}  reserved "
                  f"{torch.cuda.memory_reserved() / GiB:6.1f} GiB", flush=True)
        else:
            print(f"{stage}", flush=True)

    start = time.monotonic()
    try:
        b = Bench(config.model, run, config.optim, device=device, init_on_device=cuda,
                  compile_backend="inductor" if cuda else "aot_eager")
        mem("built")
        step = b.train_step
        b.model.register_forward_hook(lambda *_: mem("forward done"))
        optimizer_step = step.optimizer.step

        def logged_step(*a, **k):
            mem("backward done")
            out = optimizer_step(*a, **k)
            mem("optimizer step done")
            return out
        step.optimizer.step = logged_step
        for i in range(2):
            b.step()
            mem(f"step {i + 1} done ({b.times[-1]:.2f} s)")
        print("trains: yes", flush=True)
    except torch.OutOfMemoryError as err:
        mem("out of memory")
        print(f"out of memory: {str(err)[:600]}", flush=True)


if __name__ == "__main__":
    main()
