"""The performance model (keel.bench.perf_model) fitted to one GPU window's step times and checked on the others.

`measured_gpu.json` beside this script holds every GPU measurement of the project (step times of Keel and
Pre-LN per variant and shape, kernel time by category under torch.profiler, the junction kernel alone). What the
model takes from the measurements, and how:

- measured, not fitted: the matmul and attention efficiencies, the kernel time of every GEMM (and of SDPA) in a
  profiled step over the FLOPs the model counts for that step (`profiled`), from the device's newest profiled run;
  the fused junction kernel's bandwidth, as timed alone;
- fitted (least squares on log(predicted / measured) over every step time of one run, each point weighted
  alike): the memory-bound kernels' fraction of the bandwidth, the host's time per kernel launch and per sub-layer
  pass, eager and compiled, and per eager checkpointed sub-layer's recompute where the run has such points
  (FITTED);
- checked, not fitted: every step time of the device's other windows, against the fit (`out_of_sample`).

The scheme, fixed before the fit it gives was seen: the H100 is fitted on the 6167e3a window alone, all 32 of its
step times (the compare and tokens sections, and its depth section: d=512, batch 1 x 4096, checkpointing every
block, 128 to 1024 sub-layers, eager and compiled per block, each the mean of its two timed steps as
h100-2026-11-26/2-depth.json records it), and checked on the b85f36c and 8d2b061 windows, every error printed,
whether or not within 5% and 1 point.

A prediction from the calibrated model is still a PREDICTION.

    python benchmarks/gpu/calibrate.py > benchmarks/gpu/calibrated.md   # the fits and checks calibrated.md holds
    python benchmarks/gpu/calibrate.py --validate   # the fit's and the out-of-sample errors, in a few lines
    python benchmarks/gpu/calibrate.py --store      # refit the coefficients the package ships (perf_model.FITS)
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

from keel.bench.perf_model import (
    DEVICES,
    FITS,
    Code,
    DeviceSpec,
    paper_config,
    predict,
    predict_pair,
    step_ops,
)
from keel.model import ModelConfig
from keel.model.counting import count_params

MEASURED = Path(__file__).with_name("measured_gpu.json")
# (field, lower bound, upper bound) of what is fitted; host times in seconds per kernel / per sub-layer pass; the
# last (an eager checkpointed sub-layer's recompute) only where a run has eager checkpointed points to pin it
FITTED = (("memory_eff", 0.2, 0.95), ("launch_eager", 0.0, 60e-6), ("launch_compiled", 0.0, 60e-6),
          ("sublayer_eager", 0.0, 3e-3), ("sublayer_compiled", 0.0, 3e-3), ("sublayer_recompute", 0.0, 6e-3))
SCALE = (1.0, 1e-6, 1e-6, 1e-4, 1e-4, 1e-4)  # the solver steps in units of about one


def modelled(variant: str, code: Code | None = None) -> tuple[str, Code]:
    """The model's impl and code for a bench variant (the GPU campaign's VARIANTS): "compiled+composed" is "compiled"
    with the sum handoff; "compiled" is the junction inside each block, so under AC a Keel block ends with LN_out
    (no handoff)."""
    composed = variant == "compiled+composed"
    return ("compiled" if composed else variant), replace(code or Code(), sum_handoff=composed)


def measured_runs(device: str | None = None) -> list[dict]:
    runs = json.loads(MEASURED.read_text())["runs"]
    return [r for r in runs if device is None or r["device"] == device]


def is_fitted(run: dict) -> bool:
    """Whether `run` is the one its device's model is fitted to (`"fitted": false`: a window checked against the
    fit of its device's newest fitted run, out of sample)."""
    return run.get("fitted", True)


def fitted_runs(device: str | None = None) -> list[dict]:
    return [r for r in measured_runs(device) if is_fitted(r)]


def with_params(spec: DeviceSpec, values) -> DeviceSpec:
    memory, eager, compiled, sub_eager, sub_compiled, *recompute = values  # none given: an eager pass's
    sublayer = {"eager": sub_eager, "compiled": sub_compiled, "recompute": (recompute or [sub_eager])[0]}
    return replace(spec, memory_eff=memory, launch_s={"eager": eager, "compiled": compiled}, sublayer_s=sublayer)


def n_fitted(run: dict) -> int:
    """How many of FITTED a fit to `run` takes: all, or all but the recompute where no point is eager and
    checkpointed (nothing pins it; it is then an eager pass's time)."""
    return len(FITTED) - (not any(v == "eager" and shape["ac_every"] for v, _, _, shape in points(run)))


def points(run: dict) -> list[tuple[str, str, float, dict]]:
    """(variant, scheme, measured seconds, shape) of every step time of one run: its `step_time_ms` at its
    `shape`, its `more_points` and its `checked_points` (each a shape that overrides some of the run's)."""
    groups = [(run["shape"], run.get("step_time_ms", {}))]
    groups += [({**run["shape"], **m["shape"]}, m["step_time_ms"]) for m in run.get("more_points", [])]
    groups += [({**run["shape"], **m["shape"]}, {m["variant"]: m["step_time_ms"]})
               for m in run.get("checked_points", [])]
    return [(v, s, ms / 1e3, shape) for shape, times in groups for v, pair in times.items() for s, ms in pair.items()]


@functools.cache
def _config(d_model: int, n_sublayers: int, scheme: str) -> ModelConfig:
    from keel.bench.core import scheme_config  # noqa: PLC0415 (core imports the training stack)

    return scheme_config(paper_config(d_model, n_sublayers), scheme)


def _predicted(spec: DeviceSpec, run: dict, variant: str, scheme: str, shape: dict | None = None) -> float:
    shape = shape or run["shape"]
    config = _config(shape["d_model"], shape["n_sublayers"], scheme)
    impl, code = modelled(variant, Code(**run.get("code", {})))
    return predict(config, shape["batch_size"], shape["seq_len"], spec, impl, shape["dtype"] == "bfloat16",
                   shape["ac_every"], code)["step_time_s"]


def profiled(run: dict, base: DeviceSpec) -> tuple[float, float]:
    """The matmul and attention efficiencies a profiled step measured: each category's kernel time
    (`profile_ms_per_step`) against the FLOPs the model counts for that step at the bf16 peak, averaged over Keel
    and Pre-LN (the same GEMMs and attention in both)."""
    from keel.bench.core import scheme_config  # noqa: PLC0415

    prof, shape = run["profile_ms_per_step"], {**run["shape"], **run["profile_shape"]}
    impl, code = modelled(run["profile_variant"], Code(**run.get("code", {})))
    out = {"matmul": [], "attention": []}
    for scheme in ("keel", "pre_ln"):
        config = scheme_config(paper_config(shape["d_model"], shape["n_sublayers"]), scheme)
        ops = step_ops(config, shape["batch_size"], shape["seq_len"], True, impl, shape["ac_every"], code)
        for kind in out:
            flops = sum(o.flops for o in ops if o.kind == kind)
            out[kind].append(flops / (prof[scheme][kind] / 1e3 * base.bf16_flops))
    return sum(out["matmul"]) / 2, sum(out["attention"]) / 2


def profile_run(device: str) -> dict:
    """The run whose profile gives `device`'s matmul and attention efficiencies: its newest profiled run (an H200
    has none: it has the H100's compute, so the H100's)."""
    runs = [r for r in measured_runs(device) if "profile_shape" in r] or [
        r for r in measured_runs("H100") if "profile_shape" in r]
    return runs[-1]


_FITS: dict = {}  # (device, commit) -> a fit already made in this process


def calibrate(run: dict, base: DeviceSpec | None = None) -> tuple[DeviceSpec, list[dict]]:
    """The device spec with the profiled efficiencies (`profiled`), the kernel's measured bandwidth and the FITTED
    fields fitted to `run`'s step times, and per point the measured time, the time predicted with the datasheet's
    assumed efficiencies and with the calibrated ones, and the fitted model's error."""
    from scipy.optimize import least_squares  # noqa: PLC0415

    key = (run["device"], run["commit"], json.dumps(run["step_time_ms"], sort_keys=True))
    if base is None and key in _FITS:
        return _FITS[key]
    cache = base is None
    base = base or DEVICES[run["device"]]
    kernel = run.get("junction_kernel") or {}
    if "fused_fwd_bwd_GBps" in kernel:
        base = replace(base, fused_junction_bw=kernel["fused_fwd_bwd_GBps"] * 1e9)
    source = profile_run(run["device"])
    matmul, attention = profiled(source, base)
    base = replace(base, matmul_eff=matmul, attention_eff=attention)
    pts = points(run)
    n = n_fitted(run)
    lo, hi = [f[1] / s for f, s in zip(FITTED[:n], SCALE)], [f[2] / s for f, s in zip(FITTED[:n], SCALE)]

    def residuals(x):
        spec = with_params(base, [v * s for v, s in zip(x, SCALE)])
        return [math.log(_predicted(spec, run, v, s, shape) / t) for v, s, t, shape in pts]
    # the host term is a max (hidden under the device, or not): flat where it is hidden, so the solver starts from
    # each corner of a small grid and keeps the best
    starts = itertools.product(*((0.6,), (5.0, 20.0), (3.0, 15.0), (1.0, 6.0), (1.0,), (6.0,))[:n])
    fit = min((least_squares(residuals, x0, bounds=(lo, hi)) for x0 in starts), key=lambda f: f.cost)
    spec = replace(with_params(base, [v * s for v, s in zip(fit.x, SCALE)]),
                   calibrated=f"{run['device']} {run['date']} ({run['commit']})")
    out = spec, rows(run, spec)
    if cache:
        _FITS[key] = out
    return out


def rows(run: dict, spec: DeviceSpec) -> list[dict]:
    """Each of `run`'s step times beside `spec`'s prediction and the datasheet model's."""
    out = []
    for v, s, t, shape in points(run):
        before, after = _predicted(DEVICES[run["device"]], run, v, s, shape), _predicted(spec, run, v, s, shape)
        out.append({"variant": v, "scheme": s, "measured_s": t, "assumed_model_s": before, "calibrated_s": after,
                    "error": after / t - 1, "batch_size": shape["batch_size"], "ac_every": shape["ac_every"],
                    "d_model": shape["d_model"], "n_sublayers": shape["n_sublayers"]})
    return out


def ratios(point_rows: list[dict]) -> list[dict]:
    """Keel/Pre-LN measured and predicted, for each shape and variant with both schemes."""
    by = {}
    for r in point_rows:
        by.setdefault((r["d_model"], r["n_sublayers"], r["batch_size"], r["ac_every"], r["variant"]), {})[
            r["scheme"]] = r
    return [{"key": k, "measured": p["keel"]["measured_s"] / p["pre_ln"]["measured_s"],
             "predicted": p["keel"]["calibrated_s"] / p["pre_ln"]["calibrated_s"]}
            for k, p in by.items() if set(p) == {"keel", "pre_ln"}]


def out_of_sample(device: str) -> list[tuple[dict, list[dict]]]:
    """Each window of `device` not fitted, its step times against the fit of the device's newest fitted run
    before it."""
    runs = measured_runs(device)
    out = []
    for i, run in enumerate(runs):
        before = [r for r in runs[:i] if is_fitted(r)]
        if not is_fitted(run) and before:
            out.append((run, rows(run, calibrate(before[-1])[0])))
    return out


def _settled(x: float) -> float:
    """`x` without the last bits a least-squares fit moves with the BLAS that numpy links (an exact fit's errors
    are then +0.0, not -1e-16 one day and 1e-16 the next), so the text below is the same on every machine."""
    return round(x, 9) + 0.0


def summary(point_rows: list[dict]) -> str:
    worst = max(point_rows, key=lambda r: _settled(abs(r["error"])))  # ties: the first
    rs = ratios(point_rows)
    text = (f"{len(point_rows)} step times, largest |error| {abs(worst['error']):.1%} ({worst['variant']} "
            f"{worst['scheme']}, d={worst['d_model']}, {worst['n_sublayers']} sub-layers, batch "
            f"{worst['batch_size']}), mean |error| {sum(abs(r['error']) for r in point_rows) / len(point_rows):.1%}")
    if rs:
        w = max(rs, key=lambda r: _settled(abs(r["predicted"] - r["measured"])))
        text += (f"; {len(rs)} Keel/Pre-LN ratios, largest |error| {100 * abs(w['predicted'] - w['measured']):.1f} "
                 f"points ({w['key'][4]}, d={w['key'][0]}, {w['key'][1]} sub-layers, batch {w['key'][2]}: "
                 f"measured {w['measured']:.3f}, PREDICTED {w['predicted']:.3f})")
    return text


def validation_text() -> str:
    """The fit's errors on the run it is fitted to, and the out-of-sample errors on every later window."""
    lines = []
    for device in sorted({r["device"] for r in fitted_runs()}):
        run = fitted_runs(device)[-1]
        spec, fit_rows = calibrate(run)
        lines.append(f"{device}: fitted on {spec.calibrated}: {summary(fit_rows)}")
        for window, window_rows in out_of_sample(device):
            lines.append(f"{device}: out of sample, {window['date']} ({window['commit']}) against that fit: "
                         f"{summary(window_rows)}")
    return "\n".join(lines) + "\n"


def fits_json() -> str:
    """FITS' contents (what keel.bench.perf_model.calibrated reads): for each measured device, its newest fitted
    run's profiled and fitted fields."""
    out = {}
    for device in sorted({r["device"] for r in fitted_runs()}):
        spec = calibrate(fitted_runs(device)[-1])[0]
        out[device] = {"calibrated": spec.calibrated, "matmul_eff": spec.matmul_eff,
                       "attention_eff": spec.attention_eff, "memory_eff": spec.memory_eff,
                       "launch_eager": spec.launch_s["eager"], "launch_compiled": spec.launch_s["compiled"],
                       "sublayer_eager": spec.sublayer_s["eager"], "sublayer_compiled": spec.sublayer_s["compiled"],
                       "sublayer_recompute": spec.sublayer_s["recompute"],
                       "fused_junction_bw": spec.fused_junction_bw}
    return json.dumps(out, indent=1) + "\n"


def _shape_text(r: dict) -> str:
    return f"| {r['d_model']} | {r['n_sublayers']} | {r['batch_size']}{' (AC)' if r['ac_every'] else ''} | "


def _rows_table(point_rows: list[dict], assumed: bool = True) -> list[str]:
    head = ("| d | sub-layers | batch (AC) | variant | scheme | measured (ms) | "
            + ("assumed model (ms) | " if assumed else "") + "calibrated model, PREDICTED (ms) | error |")
    lines = [head, "|---|---|---|---|---|---|" + ("---|" if assumed else "") + "---|---|"]
    lines += [_shape_text(r) + f"{r['variant']} | {r['scheme']} | {1e3 * r['measured_s']:.1f} | "
              + (f"{1e3 * r['assumed_model_s']:.1f} | " if assumed else "")
              + f"{1e3 * r['calibrated_s']:.1f} | {_settled(r['error']):+.1%} |" for r in point_rows]
    rs = ratios(point_rows)
    if rs:
        lines += ["", "| d | sub-layers | batch (AC) | variant | Keel/Pre-LN measured | PREDICTED | error (points) |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {k[0]} | {k[1]} | {k[2]}{' (AC)' if k[3] else ''} | {k[4]} | {r['measured']:.3f} | "
                  f"{r['predicted']:.3f} | {_settled(100 * (r['predicted'] - r['measured'])):+.1f} |"
                  for r in rs for k in [r["key"]]]
    return lines


def fit_markdown(run: dict) -> str:
    spec, fit_rows = calibrate(run)
    source = profile_run(run["device"])
    lines = [f"# The performance model calibrated on {run['device']} ({run['date']}, {run['commit']}, "
             f"{run['software']})", "",
             f"Measured, not fitted: matmul {spec.matmul_eff:.1%} and attention {spec.attention_eff:.1%} of the "
             f"bf16 peak (the profiled step of {source['device']} {source['date']} ({source['commit']}): "
             f"{source['profile_ms_per_step']['shape']}); the fused junction "
             + (f"at its measured {spec.fused_junction_bw / 1e9:,.0f} GB/s." if spec.fused_junction_bw else
                "at the datasheet's bandwidth (its kernel was not timed alone in this run).")
             + f" Fitted (least squares on log step time, {n_fitted(run)} numbers to {len(fit_rows)} step times): "
             "memory-bound "
             f"kernels {spec.memory_eff:.0%} of the bandwidth; host {1e6 * spec.launch_s['eager']:.1f} us per eager "
             f"and {1e6 * spec.launch_s['compiled']:.1f} us per compiled kernel, "
             f"{1e6 * spec.sublayer_s['eager']:.0f} us per eager and {1e6 * spec.sublayer_s['compiled']:.0f} us "
             "per compiled sub-layer pass (forward, backward), "
             + (f"{1e6 * spec.sublayer_s['recompute']:.0f} us per eager checkpointed sub-layer's recompute"
                if n_fitted(run) == len(FITTED) else "an eager recompute as an eager pass (no eager checkpointed "
                "point to fit it)") + "; the host's time and the device's meet in each pass (forward, backward, "
             "optimizer step). The code each run measured is the "
             "model's (measured_gpu.json's \"code\": chained junction norms in every run).", "",
             f"Fit: {summary(fit_rows)}.", "", *_rows_table(fit_rows)]
    fitted = [spec.memory_eff, spec.launch_s["eager"], spec.launch_s["compiled"], spec.sublayer_s["eager"],
              spec.sublayer_s["compiled"], spec.sublayer_s["recompute"]]
    at_bound = [name for (name, lo, hi), v in zip(FITTED[:n_fitted(run)], fitted) if min(v - lo, hi - v) < 1e-3 * hi]
    if at_bound:
        lines += ["", f"At a bound of the fit: {', '.join(at_bound)} (the points do not pin it; read it as a limit)."]
    if run.get("unfitted_step_time_ms"):
        unfitted = run["unfitted_step_time_ms"].items()
        lines += ["", "Measured but not fitted: " + "; ".join(
            f"{v} {', '.join(f'{s} {ms} ms' for s, ms in pair.items())}" for v, pair in unfitted)
            + (f" ({run['note']})" if run.get("note") else "") + "."]
    return "\n".join(lines) + "\n"


def checked_markdown(run: dict, point_rows: list[dict], spec: DeviceSpec) -> str:
    """A window not fitted (`"fitted": false`): its step times against the fit of its device's newest fitted run
    before it, out of sample."""
    return "\n".join([f"# {run['device']} ({run['date']}, {run['commit']}, {run['software']}): out of sample",
                      "", f"Measured step times against the model calibrated on {spec.calibrated} (a PREDICTION "
                      f"for these points). {run.get('note', '')}", "", f"Out of sample: {summary(point_rows)}.", "",
                      *_rows_table(point_rows, assumed=False)]) + "\n"


def targets_markdown(spec: DeviceSpec, tokens_per_step: int = 32768, seq: int = 4096) -> str:
    """PREDICTED by the calibrated model: Keel/Pre-LN and MFU, compiled default, at the tokens per step users train
    with (batch x seq with activation checkpointing every block), at d=1024 and 2048, with the junction's norms
    chained (as measured) and as one pair (keel.kernels.norm_pair, today's default)."""
    lines = [f"PREDICTED by the model calibrated on {spec.calibrated}: compiled default (sum handoff), "
             f"{tokens_per_step:,} tokens per step (batch {tokens_per_step // seq} x {seq}), AC every block, bf16; "
             "the junction's norms chained (what every window ran) and as one pair with a one-pass backward "
             "(keel.kernels.norm_pair, today's default: one backward kernel per junction, PREDICTED, not measured).",
             "", "| d | sub-layers | parameters | Keel/Pre-LN chained | Keel/Pre-LN one pass | Keel MFU one pass | "
             "Pre-LN MFU |", "|---|---|---|---|---|---|---|"]
    for d, n in ((1024, 64), (1024, 512), (2048, 64), (2048, 512)):
        chained = predict_pair(paper_config(d, n), tokens_per_step // seq, seq, spec, "compiled", True, 1,
                               Code(one_pass_norms=False))
        p = predict_pair(paper_config(d, n), tokens_per_step // seq, seq, spec, "compiled", True, 1)
        lines.append(f"| {d} | {n} | {count_params(paper_config(d, n)) / 1e9:.2f}B | "
                     f"{chained['keel_over_pre_ln_step_time']:.3f} | {p['keel_over_pre_ln_step_time']:.3f} | "
                     f"{p['keel']['mfu']:.1%} | {p['pre_ln']['mfu']:.1%} |")
    return "\n".join(lines) + "\n"


def report() -> str:
    """benchmarks/gpu/calibrated.md: each device's fit, its other windows out of sample, the newest fit's
    targets."""
    parts = []
    for device in sorted({r["device"] for r in fitted_runs()}, key=lambda d: d != "H100"):
        parts.append(fit_markdown(fitted_runs(device)[-1]))
        runs = measured_runs(device)
        for window, window_rows in out_of_sample(device):
            before = [r for r in runs[:runs.index(window)] if is_fitted(r)][-1]
            parts.append(checked_markdown(window, window_rows, calibrate(before)[0]))
    return ("\n".join(parts) + "\n" + targets_markdown(calibrate(fitted_runs("H100")[-1])[0])
            + "\nGenerated by `python benchmarks/gpu/calibrate.py` from benchmarks/gpu/measured_gpu.json (older fits, "
            "on the 2026-11-24 H100 run, are in git history); tests/test_gpu_calibration.py checks that this file is "
            "what the code generates.\n")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--store"]:
        FITS.write_text(fits_json())
    elif sys.argv[1:] == ["--validate"]:
        print(validation_text(), end="")
    else:
        print(report(), end="")
