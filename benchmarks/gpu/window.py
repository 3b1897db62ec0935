"""The GPU campaign's most-needed cells in one short window (one `device` call of under 10 minutes).

A window of 15 minutes of device time does not hold the four parts of campaign.py (30 minutes of boxes). This
runs, most-needed first, each time-boxed and saved as it ends:

1. `tokens`: Keel against Pre-LN at 8 x 4096 = 32k tokens a step, 64 sub-layers, d=1024, activation checkpointing
   every block, compiled (the default, then the junction left inside each block): step time ratio and MFU at the
   tokens per step users train with;
2. `compare64`: the same at batch 1 x 4096 in every variant (eager, compiled, compiled+composed, compiled+fused);
3. `presets`: two training steps of `paper-1024` under a cap of 78.4 GiB of device memory (an 80 GB H100's usable
   memory, `torch.cuda.set_per_process_memory_fraction`) and of `paper-2048` on the whole card, each with its
   measured peak beside the memory plan's (do the presets fit the card they are sized for?), one
   gradient-accumulation micro-batch a step;
4. `tests`: `pytest -m gpu` with each test's time (the costly ones to split or shrink), in whatever time is left;
5. `profile`: two compiled steps of each scheme at the `tokens` shape under torch.profiler, the kernels' time by
   category (matmul, attention, Inductor's reductions and pointwise kernels, optimizer, copies) and Keel - Pre-LN
   per category (kernel_profile.py), then each scheme's wall time per step split into forward, backward and the
   rest (clip, optimizer): where Keel's remaining ~4% goes;
6. `bf16`: two steps of `paper-2048` with `run.weights=bfloat16` under the 78.4 GiB cap (what `keel train --preset
   paper-2048 --dry-run` plans for an 80 GB H100: 72.6 GiB), its peak beside the plan's;
7. `compare512`: Keel against Pre-LN at 512 sub-layers, batch 1 x 4096, checkpointing every block, compiled
   default, then compiled with the junction in each block, then eager, while the box lasts;
8. `tokens512`: the same at 4 x 4096 = 16,384 tokens a step (compiled default, then per block): is 512's batch-1
   ratio (1.26 on 2026-11-26, against 1.05 at 64 sub-layers and 32k tokens) host time that more tokens hide?

    python benchmarks/gpu/window.py OUT [--toy] [--seconds 560] [--parts tokens,compare64,presets,tests]

writes OUT/window.json and OUT/window.md after every cell. `--toy` runs it at CPU-test size.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch
from campaign import GpuSuite, freeze_imports, gpu_markdown, gpu_suite
from kernel_profile import profile_markdown, profile_schemes

from keel.bench.core import Bench, attempt
from keel.config.presets import train_preset
from keel.launch import expandable_segments
from keel.model import count_params
from keel.reporting.plan import memory_plan
from keel.runtime import GPU_MEMORY

GiB = 2**30
H100_USABLE_GIB = GPU_MEMORY["H100 80GB"] / 2**30  # what the memory plan takes as an 80 GB H100's


def preset_trial(name: str, device: torch.device, cap_gib: float | None, steps: int, toy: bool,
                 weights: str | None = None) -> dict:
    """Two steps of a preset as configured (one micro-batch a step), its peak against the plan's; `weights`
    overrides run.weights (bfloat16: the `bf16` part, paper-2048 under an 80 GB H100's cap, as `--dry-run` plans)."""
    config = train_preset(name)
    if toy:
        config = replace(config, model=replace(config.model, d_model=32, n_heads=2, n_kv_heads=1, d_ffn=96,
                                               vocab_size=256, max_seq_len=16, n_blocks=4),
                         optim=replace(config.optim, state="float32"))
    run = replace(config.run, grad_accum=1, seq_len=config.model.max_seq_len, device=str(device))
    if weights:
        run = replace(run, weights=weights, dtype="bfloat16" if device.type == "cpu" else run.dtype)
    config = replace(config, run=run)
    plan = memory_plan(config, device=device)
    row = {"preset": name, "cap_GiB": cap_gib, "optim_state": config.optim.state, "weights": run.weights,
           "compile": run.compile, "n_params": count_params(config.model), "plan_peak_bytes": plan["total"],
           "plan_peak_phase": plan.get("peak_phase")}
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GiB / total) if cap_gib else 1.0,
                                                  torch.cuda.current_device())

    def two_steps():
        start = time.monotonic()
        b = Bench(config.model, run, config.optim, device=device, init_on_device=device.type == "cuda",
                  compile_backend="inductor" if device.type == "cuda" else GpuSuite.toy().compile_backend)
        built = time.monotonic() - start
        for _ in range(steps):
            b.step()
        return {"trains": True, "build_s": built, "step_times_s": b.times, "peak_memory_bytes": b.peak}

    try:
        r = attempt(two_steps, device)
        row.update(r if isinstance(r, dict) else {"trains": False, "failed": r})
    except Exception as err:  # a library missing or broken on the device: recorded, the window goes on
        row.update({"trains": False, "failed": f"{type(err).__name__}: {err}"[:500],
                    "traceback": traceback.format_exc()[-1500:]})
    finally:
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
    if row.get("peak_memory_bytes"):
        row["measured_over_plan"] = row["peak_memory_bytes"] / row["plan_peak_bytes"]
    return row


def markdown(result: dict) -> str:
    lines = [f"# GPU window ({result['device']}, torch {torch.__version__})", "",
             "Status: " + ", ".join(f"{k} {v}" for k, v in result["status"].items()), ""]
    for name in ("tokens", "compare64", "compare512", "tokens512", "warmup", "tests"):
        if name in result:
            lines += [f"## {name}", "", gpu_markdown(result[name]), ""]
    if result.get("presets"):
        lines += ["## presets", "", "| preset | cap (GiB) | state | weights | trains | peak (GiB) | plan (GiB) |"
                  " measured/plan | step times (s) |", "|---|---|---|---|---|---|---|---|---|"]
        for r in result["presets"]:
            peak, steps = r.get("peak_memory_bytes"), ", ".join(f"{t:.2f}" for t in r.get("step_times_s", []))
            lines.append(f"| {r['preset']} | {r['cap_GiB'] or 'none'} | {r['optim_state']} | {r['weights']} | "
                         f"{'yes' if r['trains'] else r.get('failed')} | {f'{peak / GiB:.1f}' if peak else '-'} | "
                         f"{r['plan_peak_bytes'] / GiB:.1f} | {r.get('measured_over_plan', float('nan')):.3f} | "
                         f"{steps} |")
    if result.get("profile"):
        lines += ["", "## profile", "", profile_markdown(result["profile"])]
    return "\n".join(lines) + "\n"


def main() -> None:
    expandable_segments()  # before CUDA starts, as the keel command does: the bf16 part fits only with it
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--toy", action="store_true")
    p.add_argument("--seconds", type=float, default=560)
    p.add_argument("--parts", default="tokens,compare64,presets,tests",
                   help="a subset of tokens,compare64,compare512,tokens512,presets,tests,warmup,profile,bf16, run "
                        "in the order given (warmup: compile warm-up from nothing, each scheme once in a fresh "
                        "process)")
    p.add_argument("--tests", default="tests", help="the test paths of the tests part")
    args = p.parse_args()
    start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = GpuSuite.toy() if args.toy else GpuSuite()
    if args.toy:  # as campaign.py's toy run: each release's full collection walks the models' objects alone
        freeze_imports()
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "status": {},
              "seconds": args.seconds}
    args.out.mkdir(parents=True, exist_ok=True)

    def save():
        (args.out / "window.json").write_text(json.dumps(result, indent=1, default=str))
        (args.out / "window.md").write_text(markdown(result))

    def left() -> float:
        return args.seconds - (time.monotonic() - start)

    def part(name: str, suite: GpuSuite, section: str, box: float) -> None:
        box = min(box, left() - 5)
        if box <= 0:
            result["status"][name] = "no time left"
            return
        suite = replace(suite, boxes={**suite.boxes, section: box})

        def write(r):
            result[name] = r
            save()
        try:
            r = gpu_suite(suite, device, write, [section])
            result["status"][name] = r["status"][section]
        except Exception as err:
            result["status"][name] = f"failed: {type(err).__name__}: {err}"[:500]
        save()

    def presets():
        rows = result.setdefault("presets", [])  # the bf16 part's row, if it ran first, stays
        for done, (name, cap) in enumerate((("paper-1024", H100_USABLE_GIB), ("paper-2048", None)), 1):
            if left() < 40:
                result["status"]["presets"] = "no time left"
                break
            rows.append(preset_trial(name, device, cap, steps=2, toy=args.toy))
            result["status"]["presets"] = f"{done} done"
            save()

    def bf16():  # run.weights=bfloat16 on a GPU: paper-2048 inside an 80 GB H100, as `keel train --dry-run` plans
        if left() < 60:
            result["status"]["bf16"] = "no time left"
            return
        row = preset_trial("paper-2048", device, H100_USABLE_GIB, steps=2, toy=args.toy, weights="bfloat16")
        result.setdefault("presets", []).append(row)
        result["status"]["bf16"] = "done" if row["trains"] else "did not train"
        save()

    def profile():
        if left() < 60:
            result["status"]["profile"] = "no time left"
            return
        n, batch = base.tokens_points[0]
        # toy: one warm-up and one profiled step (a GPU: profile_schemes' two of each)
        steps = {"steps": 1, "warmup": 1} if args.toy else {}
        try:
            result["profile"] = profile_schemes(base.model(n), base.run(ac_every=1, compile=True, batch_size=batch),
                                                ["keel", "pre_ln"], **steps, **base.bench_options(device))
            result["status"]["profile"] = "done"
        except Exception as err:  # recorded, the window goes on
            result["status"]["profile"] = f"failed: {type(err).__name__}: {err}"[:500]
        save()

    deep = base.compare_sublayers[-1]  # 512 sub-layers (toy: its own deepest)
    runs = {  # in the order --parts names them
        "tokens": lambda: part("tokens", replace(base, compare_sublayers=(),
                                                 tokens_variants=("compiled+composed", "compiled")), "compare", 180),
        "compare64": lambda: part("compare64", replace(base, compare_sublayers=base.compare_sublayers[:1],
                                                       tokens_points=()), "compare", 170),
        "presets": presets,
        "profile": profile,
        "compare512": lambda: part("compare512", replace(base, compare_sublayers=(), tokens_points=((deep, 1),),
                                                         tokens_variants=("compiled+composed", "compiled", "eager")),
                                   "compare", 200),
        "tokens512": lambda: part("tokens512", replace(base, compare_sublayers=(), tokens_points=((deep, 4),),
                                                       tokens_variants=("compiled+composed", "compiled")),
                                  "compare", 200),
        "bf16": bf16,
        "warmup": lambda: part("warmup", replace(base, warmup_repeats=1), "warmup", 160),
        "tests": lambda: part("tests", replace(base, test_args=("-m", "gpu", *args.tests.split(","))), "tests", 130),
    }
    unknown = [name for name in args.parts.split(",") if name not in runs]
    if unknown:
        p.error(f"--parts: unknown {', '.join(unknown)}; allowed: {', '.join(runs)}")
    for name in args.parts.split(","):
        runs[name]()
    save()


if __name__ == "__main__":
    main()
