"""The GPU campaign's time, PREDICTED before it runs: does each part of campaign.py (GPU_PARTS) fit its time
boxes, and the boxes its 8-minute window? `python benchmarks/gpu/plan.py` prints the table benchmarks/gpu/README.md
holds.

Every figure here is a prediction. A timed cell costs (warm-up + timed steps) x the step time predicted by the
performance model calibrated on the newest measured H100 run (keel.bench.perf_model.calibrated), plus a build
allowance per model and a compile allowance per compiled model. Stated assumptions, from that run
(measured_gpu.json) where it measured them:
- compile: the first compile of a variant in a part's fresh process takes the larger of the schemes' measured cold
  warm-ups (Keel 14.1 s, Pre-LN 8.8 s on 2026-11-26); a later compile of the same variant at another depth or batch
  finds its kernels in Inductor's and Triton's on-disk caches and is given Pre-LN's measured warm-up (a cold
  figure since 2026-11-26, so an upper bound); Pre-LN has no junction to fuse, so its compiled variants compile the
  same graphs;
- the depth series at d=512: the model predicts less than the measured eager time per sub-layer, so its step times
  are multiplied by the worst measured/predicted ratio of that series (`depth_slowdown`, both variants);
- the warm-up section: every measurement is a fresh process (PROCESS_S, assumed: Python, torch, keel and CUDA set
  up) that builds one model and compiles it cold (the measured cold warm-up, as above);
- the deepest-model search: trials as its doubling and bisection would make them if the depth that trains were
  the measured one (800 sub-layers at d=1024 on 2026-11-26), each trial a build and two steps;
- the tests and the kernel section are not modelled: they are bounded by their boxes (`pytest -m gpu` took 102 s
  from cold caches on 2026-11-26).
"""

from __future__ import annotations

from calibrate import fitted_runs, modelled
from campaign import GPU_PARTS, VARIANTS, GpuSuite, compare_points

from keel.bench.perf_model import calibrated, predict
from keel.model.architecture import with_scheme

BUILD_S = 3.0  # assumed seconds to build a model on the GPU and free it again (initialised on the device)
PROCESS_S = 10.0  # assumed seconds to start a Python process that imports torch and keel and sets CUDA up
SCHEMES = ("keel", "pre_ln")


def _measured() -> dict:
    return fitted_runs("H100")[-1]


def compile_allowance(seen: set, scheme: str, variant: str) -> float:
    """Seconds of compile warm-up for one compiled model; `seen` holds the (scheme, variant)s compiled before."""
    warm = _measured()["compile_warmup_s"]
    cold = max(warm.values())
    key = (scheme, variant if scheme == "keel" else "compiled")  # Pre-LN: every compiled variant is one graph
    first = key not in seen
    seen.add(key)
    return cold if first else warm["pre_ln"]


def step_s(suite: GpuSuite, spec, n: int, scheme: str, variant: str, batch: int, ac_every: int,
           d_model: int | None = None) -> float:
    config = with_scheme(suite.model(n, d_model=d_model), scheme)
    impl, code = modelled(variant)
    return predict(config, batch, suite.seq_len, spec, impl, True, ac_every, code)["step_time_s"]


def depth_slowdown(suite: GpuSuite, spec) -> float:
    """The worst measured / predicted eager step time of the measured d=512 depth series (AC every block)."""
    measured = _measured()["eager_ms_per_sublayer_d512_ac"]
    return max(ms * int(n) / 1e3 / step_s(suite, spec, int(n), "keel", "eager", 1, 1, 512)
               for n, ms in measured.items())


def plan_compare(suite: GpuSuite, spec) -> float:
    seen, total = set(), 0.0
    for p in compare_points(suite):
        for variant in p["variants"]:
            for scheme in SCHEMES:
                total += BUILD_S + (suite.warmup + suite.steps) * step_s(
                    suite, spec, p["n_sublayers"], scheme, variant, p["batch_size"], p["ac_every"])
                if VARIANTS[variant][0]:
                    total += compile_allowance(seen, scheme, variant)
    return total


def plan_warmup(suite: GpuSuite, spec) -> float:
    cold = max(_measured()["compile_warmup_s"].values())
    return suite.warmup_repeats * sum(
        PROCESS_S + BUILD_S + cold + 2 * step_s(suite, spec, suite.warmup_sublayers, scheme, "compiled",
                                                suite.batch_size, 0)
        for scheme in SCHEMES)


def plan_depth(suite: GpuSuite, spec) -> float:
    seen, total, slow = set(), 0.0, depth_slowdown(suite, spec)
    for variant in suite.depth_variants:
        for n in suite.depth_sublayers:
            for scheme in SCHEMES:
                total += BUILD_S + slow * (suite.depth_warmup + suite.depth_steps) * step_s(
                    suite, spec, n, scheme, variant, suite.batch_size, 1, suite.depth_d_model)
                if VARIANTS[variant][0]:
                    total += compile_allowance(seen, scheme, variant)
    return total


def max_depth_trials(suite: GpuSuite, largest: int) -> list[int]:
    """The depths the campaign's max_depth search tries if `largest` sub-layers is the deepest that trains."""
    trials, good, bad, n = [], 0, None, suite.max_depth_from
    while n <= suite.max_depth_upto:
        trials.append(n)
        if n <= largest:
            good, n = n, 2 * n
        else:
            bad = n
            break
    while bad is not None and good and bad - good > suite.max_depth_resolution:
        mid = (good + bad) // 4 * 2
        trials.append(mid)
        good, bad = (mid, bad) if mid <= largest else (good, mid)
    return trials


def plan_max_depth(suite: GpuSuite, spec) -> float:
    largest = _measured()["max_trainable_sublayers_d1024_ac"]
    return sum(BUILD_S + 2 * step_s(suite, spec, n, "keel", "eager", suite.batch_size, 1)
               for n in max_depth_trials(suite, largest))


def plan(suite: GpuSuite | None = None) -> dict:
    """PREDICTED seconds per section and per part beside their boxes (tests and kernel: their boxes)."""
    suite = suite or GpuSuite()
    spec = calibrated("H100")
    sections = {"tests": float(suite.boxes["tests"]), "kernel": float(suite.boxes["kernel"]),
                "warmup": plan_warmup(suite, spec), "compare": plan_compare(suite, spec),
                "depth": plan_depth(suite, spec), "max_depth": plan_max_depth(suite, spec)}
    parts = {name: {"predicted_s": sum(sections[s] for s in part), "box_s": sum(suite.boxes[s] for s in part)}
             for name, part in GPU_PARTS.items()}
    return {"device": spec.calibrated, "sections": {s: {"predicted_s": t, "box_s": suite.boxes[s]}
                                                    for s, t in sections.items()},
            "parts": parts, "depth_slowdown": depth_slowdown(suite, spec), "build_s": BUILD_S,
            "modelled": ["warmup", "compare", "depth", "max_depth"], "process_s": PROCESS_S}


def plan_markdown(p: dict) -> str:
    lines = [f"PREDICTED time of each part (benchmarks/gpu/plan.py, the model calibrated on {p['device']}; tests and "
             "kernel are their boxes, not modelled):", "",
             "| part | sections | predicted (s) | boxes (s) |", "|---|---|---|---|"]
    lines += [f"| {name} | {', '.join(GPU_PARTS[name])} | {r['predicted_s']:.0f} | {r['box_s']:.0f} |"
              for name, r in p["parts"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import json

    result = plan()
    print(plan_markdown(result))
    print(json.dumps(result["sections"], indent=1), f"depth slowdown {result['depth_slowdown']:.2f}")
