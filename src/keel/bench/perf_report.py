"""The performance model's outputs (keel.bench.perf_model): its PREDICTED step table (`keel bench --model-gpu`) and a
run's predicted time on a GPU (`time_lines`). Its CPU twin is benchmarks/gpu/validate_model.py."""

from __future__ import annotations

from keel.bench.perf_model import DEVICES, IMPLS, DeviceSpec, calibrated, fits, predict, predict_pair
from keel.model import ModelConfig


def prediction_markdown(config: ModelConfig, batch: int, seq: int, device: DeviceSpec, bf16: bool = True,
                        ac_every: int = 0, memory: int | None = None) -> str:
    """The PREDICTED step of Keel and Pre-LN at one shape on `device`, per implementation and per op group.
    `memory`: the run's bytes by its memory plan (keel.reporting.plan.memory_plan: its weights, optimizer and
    checkpointing as configured); without it, float32 weights and AdamW moments."""
    pairs = {impl: predict_pair(config, batch, seq, device, impl, bf16, ac_every) for impl in IMPLS}
    basis = ("its efficiencies calibrated on the measured run " + device.calibrated + ", whose step times were "
             "taken at batch 1 x 4096 (and, in the later runs, at 8 x 4096): at another batch the split "
             "between host time and matmul efficiency is "
             "extrapolated" if device.calibrated else "datasheet peaks and assumed efficiencies, not calibrated")
    lines = [f"# PREDICTED (keel.bench.perf_model, not measured): {device.name}, d={config.d_model}, "
             f"{config.n_sublayers} sub-layers, batch {batch} x {seq}, {'bf16 autocast' if bf16 else 'float32'}"
             f"{f', AC every {ac_every} blocks' if ac_every else ''}", "", f"Basis: {basis}.", "",
             "| implementation | Keel step (ms) | Pre-LN step (ms) | Keel tokens/s | Keel MFU | Pre-LN MFU "
             "| Keel/Pre-LN |",
             "|---|---|---|---|---|---|---|"]
    for impl, p in pairs.items():
        k, r = p["keel"], p["pre_ln"]
        lines.append(f"| {impl} | {1e3 * k['step_time_s']:.1f} | {1e3 * r['step_time_s']:.1f} | "
                     f"{k['tokens_per_s']:,.0f} | {k['mfu']:.1%} | {r['mfu']:.1%} | "
                     f"{p['keel_over_pre_ln_step_time']:.3f} |")
    groups = list(pairs["eager"]["keel"]["groups"])
    lines += ["", "Time per op group (ms), Keel / Pre-LN:", "", "| op group | " + " | ".join(IMPLS) + " |",
              "|---|" + "---|" * len(IMPLS)]
    for g in groups:
        lines.append(f"| {g} | " + " | ".join(f"{1e3 * p['keel']['groups'][g]['time_s']:.2f} / "
                                              f"{1e3 * p['pre_ln']['groups'][g]['time_s']:.2f}"
                                              for p in pairs.values()) + " |")
    if memory is None:
        fit = fits(config, batch, seq, device, ac_every, bf16_autocast=bf16)
        lines += ["", f"Training memory (keel.scale.memory estimate, float32 weights and AdamW moments) "
                  f"{'fits' if fit else 'does NOT fit'} in {device.memory / 2**30:.1f} GiB."]
    else:
        lines += ["", f"Training memory (the run's memory plan, as configured: keel train --dry-run), "
                  f"{memory / 2**30:.1f} GiB: {'fits' if memory <= device.memory else 'does NOT fit'} in "
                  f"{device.memory / 2**30:.1f} GiB."]
    return "\n".join(lines) + "\n"


def time_lines(config, gpu: str = "H100") -> list[str]:
    """The run's time on one `gpu` (bf16, compiled or eager as configured, its batch, sequence and checkpointing),
    by keel.bench.perf_model calibrated on the project's measured GPU figures (perf_model.calibrated): a
    prediction, labelled as one."""
    r = config.run
    spec = calibrated(gpu) or DEVICES[gpu]
    fitted = f"calibrated on {spec.calibrated}" if spec.calibrated else "uncalibrated datasheet figures"
    p = predict(config.model, r.batch_size, r.seq_len, spec, "compiled" if r.compile else "eager", True, r.ac_every)
    optimizer = p["groups"].get("optimizer", {}).get("time_s", 0.0)  # once a step, not once a micro-batch
    step = (p["step_time_s"] - optimizer) * r.grad_accum + optimizer
    hours = step * r.steps / 3600
    mfu = p["mfu"] * p["step_time_s"] * r.grad_accum / step
    took = f"{hours:,.1f} hours" if hours < 48 else f"{hours:,.0f} hours ({hours / 24:,.0f} days)"
    return [f"time on one {gpu} (PREDICTED by keel.bench.perf_model, {fitted}): {took}, {step:,.2f} s a step of "
            f"{r.grad_accum} micro-batches at MFU {mfu:.0%}"]
