"""`keel bench`: Keel's training-step cost against Pre-LN at identical shapes, and against depth.

Both schemes train in one process on the same synthetic batches, one step each in turn (the order
flipped every round, so neither always runs on a warmer cache), after warm-up steps that are not
timed. Reported per scheme: median step time, tokens/s, peak memory (CUDA: measured; CPU: the
keel.scale.memory estimate), MFU on GPUs with a known bf16 peak, and the Keel/Pre-LN step-time ratio. The
depth series times a Keel step from 16 to 1024 sub-layers to show cost per sub-layer stays flat.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from keel.model import ModelConfig, flops_per_token
from keel.runtime import autocast_for, machine, peak_flops, resolve_device
from keel.scale.memory import estimate_memory
from keel.train.config import OptimConfig, Runtime, add_config_arguments, load_config
from keel.train.optim import build_optimizer
from keel.train.step import TrainStep, build_model


class Bench:
    """One model, its optimiser and a fixed synthetic batch; `step()` times one training step, the same
    TrainStep (forward, backward, clip, AdamW) that `keel train` and the experiments take."""

    def __init__(self, config: ModelConfig, batch_size: int, seq_len: int, device: torch.device, dtype: str = "auto",
                 ac_every: int = 0, compile: bool = False):
        torch.manual_seed(0)
        self.config, self.device, self.tokens = config, device, batch_size * seq_len
        runtime = Runtime(device=str(device), dtype=dtype, compile=compile, ac_every=ac_every)
        self.model = build_model(config, runtime, device)
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


def compare(config: ModelConfig, schemes: list[str], batch_size: int, seq_len: int, steps: int, warmup: int,
            device: torch.device, dtype: str = "auto", ac_every: int = 0, compile: bool = False) -> dict:
    """Alternate training steps of each scheme at `config`'s shape; per-scheme results and ratios."""
    from dataclasses import replace

    benches = {s: Bench(replace(config, scheme=s, **_scheme_defaults(config, s)), batch_size, seq_len, device, dtype,
                        ac_every, compile) for s in schemes}
    for i in range(warmup + steps):
        for scheme in (schemes if i % 2 == 0 else schemes[::-1]):
            benches[scheme].step(record=i >= warmup)
    peak = peak_flops(device)
    out = {}
    for scheme, b in benches.items():
        step = statistics.median(b.times)
        tps = b.tokens / step
        estimate = estimate_memory(b.config, batch_size, seq_len, ac_every)["total"]
        out[scheme] = {
            "step_time_s": step, "step_time_min_s": min(b.times), "tokens_per_s": tps,
            "peak_memory_bytes": b.peak, "memory_estimate_bytes": estimate,
            "mfu": tps * flops_per_token(b.config, seq_len) / peak if peak else None,
        }
    if "keel" in out and "pre_ln" in out:
        out["keel_over_pre_ln_step_time"] = out["keel"]["step_time_s"] / out["pre_ln"]["step_time_s"]
    return out


def _scheme_defaults(config: ModelConfig, scheme: str) -> dict:
    """Clear options the target scheme does not read (ModelConfig rejects them)."""
    return {name: None for name in ("alpha", "first_layer", "mix_ln_fraction", "deepnorm_beta")
            if getattr(config, name) is not None and scheme != config.scheme}


def depth_series(config: ModelConfig, sublayers: list[int], batch_size: int, seq_len: int, steps: int,
                 device: torch.device, dtype: str = "auto") -> list[dict]:
    """Median Keel step time at each depth, and per sub-layer."""
    from dataclasses import replace

    rows = []
    for n in sublayers:
        b = Bench(replace(config, n_blocks=n // 2), batch_size, seq_len, device, dtype)
        b.step(record=False)
        for _ in range(steps):
            b.step()
        step = statistics.median(b.times)
        rows.append({"n_sublayers": n, "step_time_s": step, "ms_per_sublayer": 1e3 * step / n})
        del b
    return rows


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


def run(args) -> dict:
    train_config = load_config(args.overrides, getattr(args, "config", None), args.preset)
    config = train_config.model
    device = resolve_device(args.device)
    schemes = args.schemes.split(",")
    result = {"machine": machine(device), "settings": {
        "preset": args.preset, "overrides": args.overrides, "d_model": config.d_model,
        "n_sublayers": config.n_sublayers, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "steps": args.steps, "warmup": args.warmup, "schemes": schemes, "dtype": args.dtype,
        "ac_every": args.ac_every, "compile": args.compile}}
    result["compare"] = compare(config, schemes, args.batch_size, args.seq_len, args.steps, args.warmup, device,
                                args.dtype, args.ac_every, args.compile)
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
    p.set_defaults(func=cmd_bench)
