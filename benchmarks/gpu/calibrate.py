"""The performance model (keel.bench.perf_model) fitted to every GPU step time the project measured.

`measured_gpu.json` beside this script holds every GPU measurement of the project (step times of Keel and
Pre-LN per variant, the junction kernel alone). `calibrate` fits the model's achievable fractions of a device's
datasheet rates (matmul and memory efficiency, host time per eager op and per compiled kernel) to a run's six
step times by least squares on log(predicted / measured), with the junction kernel's own measured bandwidth
taken as it was measured rather than fitted. Four numbers fitted to six points: the fit's error at each point
is printed with it (`fit_markdown`), and a prediction from the calibrated model is still a PREDICTION.

    python benchmarks/gpu/calibrate.py > benchmarks/gpu/calibrated.md   # every run's fit, as calibrated.md holds
    python benchmarks/gpu/calibrate.py --store   # refit the coefficients the package ships (perf_model.FITS)
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from keel.bench.perf_model import DEVICES, FITS, Code, DeviceSpec, modelled, paper_config, predict, predict_pair
from keel.model.counting import count_params

MEASURED = Path(__file__).with_name("measured_gpu.json")
# (field, lower bound, upper bound) of what is fitted; launch times in seconds per op / kernel
FITTED = (("matmul_eff", 0.2, 0.95), ("memory_eff", 0.2, 0.95), ("launch_eager", 1e-6, 60e-6),
          ("launch_compiled", 1e-6, 60e-6))


def measured_runs(device: str | None = None) -> list[dict]:
    runs = json.loads(MEASURED.read_text())["runs"]
    return [r for r in runs if device is None or r["device"] == device]


def is_fitted(run: dict) -> bool:
    """Whether `run` has step times to fit (a run with `"fitted": false` holds only points checked against the fit
    of its device's newest fitted run before it, and other measured data)."""
    return run.get("fitted", True)


def fitted_runs(device: str | None = None) -> list[dict]:
    return [r for r in measured_runs(device) if is_fitted(r)]


def with_params(spec: DeviceSpec, values) -> DeviceSpec:
    matmul, memory, eager, compiled = values
    return replace(spec, matmul_eff=matmul, memory_eff=memory, launch_s={"eager": eager, "compiled": compiled})


def points(run: dict) -> list[tuple[str, str, float, dict]]:
    """(variant, scheme, measured seconds, shape) of one run: its `step_time_ms` at its `shape`, then each of its
    `more_points` (a shape that overrides some of the run's, and step times) at theirs."""
    groups = [(run["shape"], run["step_time_ms"])]
    groups += [({**run["shape"], **m["shape"]}, m["step_time_ms"]) for m in run.get("more_points", [])]
    return [(v, s, ms / 1e3, shape) for shape, times in groups for v, pair in times.items() for s, ms in pair.items()]


def _predicted(spec: DeviceSpec, run: dict, variant: str, scheme: str, shape: dict | None = None) -> float:
    from keel.bench.core import scheme_config  # noqa: PLC0415 (core imports the training stack)

    shape = shape or run["shape"]
    config = scheme_config(paper_config(shape["d_model"], shape["n_sublayers"]), scheme)
    impl, code = modelled(variant, Code(**run.get("code", {})))
    return predict(config, shape["batch_size"], shape["seq_len"], spec, impl, shape["dtype"] == "bfloat16",
                   shape["ac_every"], code)["step_time_s"]


def checked(run: dict, spec: DeviceSpec) -> list[dict]:
    """`run`'s `checked_points` (measured, not fitted: the compiled default, which the model's compiled row does not
    tell from the junction inside each block at batch 1) against `spec`'s prediction: per point the error and
    Keel/Pre-LN measured and predicted."""
    rows = []
    for m in run.get("checked_points", []):
        shape, times = {**run["shape"], **m["shape"]}, m["step_time_ms"]
        pred = {s: _predicted(spec, run, m["variant"], s, shape) for s in times}
        rows.append({"variant": m["variant"], "shape": shape, "measured_ms": times,
                     "predicted_ms": {s: 1e3 * t for s, t in pred.items()},
                     "error": {s: pred[s] * 1e3 / times[s] - 1 for s in times},
                     "ratio": (times["keel"] / times["pre_ln"], pred["keel"] / pred["pre_ln"])})
    return rows


def calibrate(run: dict, base: DeviceSpec | None = None, matmul_eff: float | None = None
              ) -> tuple[DeviceSpec, list[dict]]:
    """The device spec with FITTED fields fitted to `run`'s step times (and its kernel's measured bandwidth),
    and per point the measured time, the time predicted before and after, and the fitted model's error.
    `matmul_eff` given: held there, the other three fitted (`profile`)."""
    from scipy.optimize import least_squares  # noqa: PLC0415

    base = base or DEVICES[run["device"]]
    kernel = run.get("junction_kernel") or {}
    if "fused_fwd_bwd_GBps" in kernel:
        base = replace(base, fused_junction_bw=kernel["fused_fwd_bwd_GBps"] * 1e9)
    pts = points(run)
    start = [base.matmul_eff, base.memory_eff, base.launch_s["eager"], base.launch_s["compiled"]]
    lo, hi = [f[1] for f in FITTED], [f[2] for f in FITTED]
    if matmul_eff is not None:  # a bound of zero width pins it (the solver needs lo < hi: a hair apart)
        start[0], lo[0], hi[0] = matmul_eff, matmul_eff * (1 - 1e-9), matmul_eff * (1 + 1e-9)
    scale = [1.0, 1.0, 1e-6, 1e-6]  # the solver steps in units of about one

    def residuals(x):
        spec = with_params(base, [v * s for v, s in zip(x, scale)])
        return [math.log(_predicted(spec, run, v, s, shape) / t) for v, s, t, shape in pts]
    fit = least_squares(residuals, [v / s for v, s in zip(start, scale)],
                        bounds=([a / s for a, s in zip(lo, scale)], [b / s for b, s in zip(hi, scale)]))
    spec = replace(with_params(base, [v * s for v, s in zip(fit.x, scale)]),
                   calibrated=f"{run['device']} {run['date']} ({run['commit']})")
    rows = []
    for v, s, t, shape in pts:
        before, after = _predicted(DEVICES[run["device"]], run, v, s, shape), _predicted(spec, run, v, s, shape)
        rows.append({"variant": v, "scheme": s, "measured_s": t, "assumed_model_s": before, "calibrated_s": after,
                     "error": after / t - 1, "batch_size": shape["batch_size"], "ac_every": shape["ac_every"],
                     "d_model": shape["d_model"]})
    return spec, rows


def fits_json() -> str:
    """FITS' contents (what keel.bench.perf_model.calibrated reads): for each measured device, its newest fitted
    run's fitted fields."""
    out = {}
    for device in sorted({r["device"] for r in fitted_runs()}):
        spec = calibrate(fitted_runs(device)[-1])[0]
        out[device] = {"calibrated": spec.calibrated, "matmul_eff": spec.matmul_eff, "memory_eff": spec.memory_eff,
                       "launch_eager": spec.launch_s["eager"], "launch_compiled": spec.launch_s["compiled"],
                       "fused_junction_bw": spec.fused_junction_bw}
    return json.dumps(out, indent=1) + "\n"


def profile(run: dict, values=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8), tokens_per_step: int = 32768) -> list[dict]:
    """The fit with the matmul efficiency held at each of `values`: how well each explains the run, and what each
    predicts for Keel's MFU at `tokens_per_step` (d=1024, 512 sub-layers, compiled, AC every block). One shape's six
    step times cannot tell a slow GEMM from host time per kernel; the two predict differently at larger batches."""
    out = []
    for m in values:
        spec, rows = calibrate(run, matmul_eff=m)
        p = predict_pair(paper_config(1024, 512), tokens_per_step // 4096, 4096, spec, "compiled", True, 1)
        out.append({"matmul_eff": m, "max_error": max(abs(r["error"]) for r in rows), "spec": spec,
                    "keel_mfu": p["keel"]["mfu"], "keel_over_pre_ln": p["keel_over_pre_ln_step_time"]})
    return out


def fit_markdown(run: dict) -> str:
    spec, rows = calibrate(run)
    shape = run["shape"]
    lines = [f"# The performance model calibrated on {run['device']} ({run['date']}, {run['commit']}, "
             f"{run['software']})", "",
             f"Shape: d={shape['d_model']}, {shape['n_sublayers']} sub-layers, batch {shape['batch_size']} x "
             f"{shape['seq_len']}, {shape['dtype']}"
             + "".join("; and " + (f"d={m['shape']['d_model']}, " if "d_model" in m["shape"] else "")
                       + f"batch {m['shape'].get('batch_size', shape['batch_size'])}"
                       + (" with AC every block" if m["shape"].get("ac_every") == 1 else
                          f" with AC every {m['shape']['ac_every']} blocks" if m["shape"].get("ac_every") else "")
                       for m in run.get("more_points", []))
             + f". Fitted (least squares on log step time, 4 numbers to "
             f"{len(rows)} points): matmul {spec.matmul_eff:.0%} of the bf16 peak, memory-bound kernels "
             f"{spec.memory_eff:.0%} of the bandwidth, host {1e6 * spec.launch_s['eager']:.1f} us per eager op and "
             f"{1e6 * spec.launch_s['compiled']:.1f} us per compiled kernel; the fused junction "
             + (f"at its measured {spec.fused_junction_bw / 1e9:,.0f} GB/s." if spec.fused_junction_bw else
                "at the datasheet's bandwidth (its kernel was not timed alone in this run)."), "",
             "| d | batch (AC) | variant | scheme | measured (ms) | assumed model (ms) | calibrated model (ms) | "
             "error of the fit |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['d_model']} | {r['batch_size']}{' (AC)' if r['ac_every'] else ''} | {r['variant']} | "
              f"{r['scheme']} | "
              f"{1e3 * r['measured_s']:.1f} | {1e3 * r['assumed_model_s']:.1f} | {1e3 * r['calibrated_s']:.1f} | "
              f"{r['error']:+.1%} |" for r in rows]
    fitted = (spec.matmul_eff, spec.memory_eff, spec.launch_s["eager"], spec.launch_s["compiled"])
    at_bound = [name for (name, lo, hi), v in zip(FITTED, fitted) if min(v - lo, hi - v) < 1e-3 * hi]
    if at_bound:
        lines += ["", f"At a bound of the fit: {', '.join(at_bound)} (the points do not pin it; read it as a limit)."]
    if run.get("checked_points"):
        lines += ["", "Measured, not fitted, against the calibrated model (the compiled default: under AC Keel hands "
                  "on its sum):", "", *_checked_table(run, spec)]
    if run.get("unfitted_step_time_ms"):
        unfitted = run["unfitted_step_time_ms"].items()
        lines += ["", "Measured but not fitted: " + "; ".join(
            f"{v} {', '.join(f'{s} {ms} ms' for s, ms in pair.items())}" for v, pair in unfitted)
            + (f" ({run['note']})" if run.get("note") else "") + "."]
    lines += ["", ("The fit is not unique: one shape cannot tell slow GEMMs from host time per kernel. " if not
                   run.get("more_points") else "Points at more than one batch size constrain the matmul efficiency "
                   "more than one shape does, not uniquely. ") + "Held at each "
              "matmul efficiency, the other three fitted again (PREDICTED Keel MFU and Keel/Pre-LN at d=1024, "
              "512 sub-layers, 32,768 tokens per step, compiled, AC every block):", "",
              "| matmul efficiency held at | largest error of the fit | host us per compiled kernel | Keel MFU | "
              "Keel/Pre-LN |", "|---|---|---|---|---|"]
    lines += [f"| {p['matmul_eff']:.0%} | {p['max_error']:.1%} | {1e6 * p['spec'].launch_s['compiled']:.1f} | "
              f"{p['keel_mfu']:.1%} | {p['keel_over_pre_ln']:.3f} |" for p in profile(run)]
    return "\n".join(lines) + "\n"


def _checked_table(run: dict, spec: DeviceSpec) -> list[str]:
    lines = ["| d | sub-layers | batch (AC) | variant | Keel measured [model] (ms) | error | "
             "Pre-LN measured [model] (ms) | error | Keel/Pre-LN measured [model] |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in checked(run, spec):
        shape, ms, model, err = r["shape"], r["measured_ms"], r["predicted_ms"], r["error"]
        lines.append(f"| {shape['d_model']} | {shape['n_sublayers']} | "
                     f"{shape['batch_size']}{' (AC)' if shape['ac_every'] else ''} | "
                     f"{r['variant']} | {ms['keel']:.1f} [{model['keel']:.1f}] | {err['keel']:+.1%} | "
                     f"{ms['pre_ln']:.1f} [{model['pre_ln']:.1f}] | {err['pre_ln']:+.1%} | "
                     f"{r['ratio'][0]:.3f} [{r['ratio'][1]:.3f}] |")
    return lines


def checked_markdown(run: dict) -> str:
    """A run that is not fitted (`"fitted": false`): its points against the model calibrated on its device's newest
    fitted run before it."""
    runs = measured_runs(run["device"])
    before = [r for r in runs[:runs.index(run)] if is_fitted(r)]
    spec = calibrate(before[-1])[0]
    return "\n".join([f"# {run['device']} ({run['date']}, {run['commit']}, {run['software']}): checked, not fitted",
                      "", f"Measured step times against the model calibrated on {spec.calibrated} (a PREDICTION "
                      f"for these points). {run.get('note', '')}", "", *_checked_table(run, spec)]) + "\n"


def targets_markdown(spec: DeviceSpec, tokens_per_step: int = 32768, seq: int = 4096) -> str:
    """PREDICTED by the calibrated model: Keel/Pre-LN and MFU, compiled, at the tokens per step users train with
    (batch x seq with activation checkpointing every block), at d=1024 and 2048."""
    lines = [f"PREDICTED by the model calibrated on {spec.calibrated}: compiled, {tokens_per_step:,} tokens per step "
             f"(batch {tokens_per_step // seq} x {seq}), AC every block, bf16.", "",
             "| d | sub-layers | parameters | Keel/Pre-LN | Keel MFU | Pre-LN MFU |", "|---|---|---|---|---|---|"]
    for d, n in ((1024, 64), (1024, 512), (2048, 64), (2048, 512)):
        p = predict_pair(paper_config(d, n), tokens_per_step // seq, seq, spec, "compiled", True, 1)
        lines.append(f"| {d} | {n} | {count_params(paper_config(d, n)) / 1e9:.2f}B | "
                     f"{p['keel_over_pre_ln_step_time']:.3f} | {p['keel']['mfu']:.1%} | {p['pre_ln']['mfu']:.1%} |")
    return "\n".join(lines) + "\n"


def report() -> str:
    """benchmarks/gpu/calibrated.md: the fit on each measured run, and the calibrated targets of the newest."""
    text = "\n".join(fit_markdown(r) if is_fitted(r) else checked_markdown(r) for r in measured_runs())
    return (text + "\n" + targets_markdown(calibrate(fitted_runs()[-1])[0])
            + "\nGenerated by `python benchmarks/gpu/calibrate.py` from benchmarks/gpu/measured_gpu.json; "
            "tests/test_gpu_calibration.py checks that this file is what the code generates.\n")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--store"]:
        FITS.write_text(fits_json())
    else:
        print(report(), end="")
