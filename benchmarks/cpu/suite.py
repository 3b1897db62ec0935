"""The project's CPU suite: compiled against eager, Keel against Pre-LN, four models stepping alternately in one
process, at the bench shape and at the default `keel train` job's shape; compile warm-up from nothing; the science
shape's depth series; and time per sub-layer of Keel and Pre-LN from 128 to 1024 sub-layers (flatness.py, shared
with the GPU campaign), each against this project's targets (CPU_TARGETS). It waits for an idle machine first and
records the load average: on a small shared machine any other job's work lands in the step times.

    python benchmarks/cpu/suite.py --out DIR [--sections compare,cold_warmup,science,flatness] [--steps 10]
        [--warmup 3] [--idle-load 0.5] [--idle-wait 900] [run.threads=N]

writes DIR/bench.json and DIR/bench.md after every part (each folder of benchmarks/cpu/ says how it ran).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from keel.launch import launcher_environment

if __name__ == "__main__":  # as keel's own commands do, before torch loads (keel.launch)
    launcher_environment()
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))  # flatness.py, cold_compile.py: shared

import torch  # noqa: E402
from cold_compile import cold_warmup  # noqa: E402
from flatness import FLAT_SUBLAYERS, FLAT_TARGET, flatness_markdown, flatness_series  # noqa: E402

from keel import runtime  # noqa: E402
from keel.bench.core import Bench, alternate, scheme_config, summarize  # noqa: E402
from keel.cli.bench import writer  # noqa: E402
from keel.config import RunConfig, add_config_arguments, load_config  # noqa: E402
from keel.config.reads import Reads  # noqa: E402
from keel.errors import ConfigError, KeelError  # noqa: E402
from keel.model import ModelConfig  # noqa: E402
from keel.model.sizes import cpu_demo, science  # noqa: E402
from keel.runtime import machine  # noqa: E402

CPU_PARTS = ("compare", "cold_warmup", "science", "flatness")  # in the order they run


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
# What Keel may cost on a CPU, so that its second norm is no reason to pick Pre-LN: compiled Keel within 2% of
# compiled Pre-LN, and compiling worth it for the default job (1.3x eager); at the science shape (SCIENCE_DEPTHS),
# compile time at the deepest depth within 2x of the shallowest and time per sub-layer within +-10% of the
# shallowest's (a deep sweep point costs its layers, no more); a cold compile of Keel within 1.3x of Pre-LN's (the
# wait before a first step); time per sub-layer within 10% from 128 to 1024 sub-layers (flatness.FLAT_TARGET)
CPU_TARGETS = {"compiled_keel_over_pre_ln_at_most": 1.02, "compiled_speedup_at_least": 1.3,
               "compile_time_deep_over_shallow_at_most": 2.0, "ms_per_sublayer_spread_at_most": 0.10,
               "keel_warmup_over_pre_ln_at_most": 1.3, "ms_per_sublayer_flat_128_1024_at_most": FLAT_TARGET}
WARMUP_SUBLAYERS = 64
VARIANTS = ("eager", "compiled")
# the science experiments' shape (keel.experiments.common: d=64, 8 x 64 tokens a step, one thread per point)
SCIENCE_DEPTHS = (16, 64, 256, 1024)
SCIENCE_BATCH = (8, 64)
# flatness at a width a 2-core CPU steps through quickly (about a minute idle for 3 passes over
# 128-1024 sub-layers, both schemes), eager, one thread: at d=32 the step is host work (dispatch, autograd,
# optimizer bookkeeping), what grows with depth if anything does
CPU_FLATNESS = {"model": {"vocab_size": 256, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "max_seq_len": 16},
                "batch_size": 1, "seq_len": 16, "sublayers": FLAT_SUBLAYERS, "steps": 5, "warmup": 1, "repeats": 3,
                "threads": 1}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "each": values}


def cpu_suite(steps: int, warmup: int, write, max_load: float = 0.5, wait_s: float = 900, shapes=None,
              compile_backend: str = "inductor", repeats: int = 3, depths=SCIENCE_DEPTHS,
              science_steps: int = 5, warmup_sublayers: int = WARMUP_SUBLAYERS, parts=CPU_PARTS,
              flatness: dict | None = None, cold_repeats: int = 2, cold_processes: bool = True) -> dict:
    """Eager and compiled, Keel and Pre-LN: four models stepping alternately in this process, per shape, the timed
    steps taken `repeats` times (each repeat's ratios reported, and their median and range) ("compare"); each
    scheme's compile warm-up from nothing ("cold_warmup"); the science shape's depth series (`science_series`,
    "science"); Keel and Pre-LN per sub-layer from 128 to 1024 sub-layers (`cpu_flatness`, "flatness"). Only
    `parts` run. `shapes`, `depths`, `flatness`, `compile_backend` and `cold_processes` are for tests."""
    device, shapes, flat = torch.device("cpu"), shapes or CPU_SHAPES, flatness or CPU_FLATNESS
    models = {name: cpu_demo(**overrides) for name, (overrides, _, _) in shapes.items()}
    result = {"suite": "cpu", "machine": machine(device), "settings": {
        "shapes": {k: {"model": asdict(models[k]), "n_sublayers": models[k].n_sublayers, "batch_size": b,
                       "seq_len": t} for k, (_, b, t) in shapes.items()},
        "steps": steps, "warmup": warmup, "repeats": repeats, "dtype": "float32", "compile_backend": compile_backend,
        "science": {"depths": list(depths), "batch_size": SCIENCE_BATCH[0], "seq_len": SCIENCE_BATCH[1],
                    "steps": science_steps, "threads": 1},
        "flatness": {k: list(v) if isinstance(v, tuple) else v for k, v in flat.items()}, "parts": list(parts)},
        "idle_check": wait_for_idle(max_load, wait_s) | {"max_load": max_load}, "shapes": {}}
    for name, (_, batch, seq) in shapes.items() if "compare" in parts else ():
        torch._dynamo.reset()  # each shape compiles afresh, well inside Dynamo's recompile limit
        load_before = os.getloadavg()
        benches = {f"{s}/{v}": Bench(scheme_config(models[name], s),
                                     RunConfig(batch_size=batch, seq_len=seq, dtype="float32", compile=v == "compiled"),
                                     device=device, compile_backend=compile_backend)
                   for s in ("keel", "pre_ln") for v in VARIANTS}
        warm = alternate(benches, steps, warmup)
        for _ in range(repeats - 1):
            alternate(benches, steps, 0)
        rows = {k: summarize(b) | {"warmup_s": warm[k]} for k, b in benches.items()}
        per_repeat = [{k: statistics.median(b.times[r * steps:(r + 1) * steps]) for k, b in benches.items()}
                      for r in range(repeats)]
        ratio = {v: spread([t[f"keel/{v}"] / t[f"pre_ln/{v}"] for t in per_repeat]) for v in VARIANTS}
        speedup = {s: spread([t[f"{s}/eager"] / t[f"{s}/compiled"] for t in per_repeat]) for s in ("keel", "pre_ln")}
        result["shapes"][name] = {"results": rows, "keel_over_pre_ln_step_time": ratio, "compiled_speedup": speedup,
                                  "fused_junctions": {k: b.fused for k, b in benches.items()},
                                  "load_average": {"before": load_before, "after": os.getloadavg()}}
        del benches
        write(result)
    if warmup_sublayers and "cold_warmup" in parts:  # each scheme from nothing (fresh Dynamo state and caches)
        shape = next(iter(shapes.values()))
        config = cpu_demo(**(shape[0] | {"n_blocks": warmup_sublayers // 2}))
        run = RunConfig(batch_size=shape[1], seq_len=shape[2], dtype="float32", compile=True)
        # each measurement in a fresh process, the order alternating (benchmarks/gpu/cold_compile.py); Keel with its
        # junction inside blocks too (one graph fewer than the compiled CPU default's junction across blocks)
        cold = cold_warmup(config, run, ["keel", "pre_ln"], device=device, compile_backend=compile_backend,
                           repeats=cold_repeats, processes=cold_processes)
        cold["keel, junction off"] = cold_warmup(config, replace(run, fused_junction="off"), ["keel"], device=device,
                                                 compile_backend=compile_backend, processes=cold_processes)["keel"]
        result["cold_warmup"] = {"n_sublayers": warmup_sublayers, "schemes": cold, "repeats": cold_repeats,
                                 "fresh_processes": cold_processes,
                                 "keel_over_pre_ln": cold["keel"]["first_step_s"] / cold["pre_ln"]["first_step_s"],
                                 "keel_off_over_pre_ln": (cold["keel, junction off"]["first_step_s"]
                                                          / cold["pre_ln"]["first_step_s"])}
        write(result)
    if depths and "science" in parts:
        result["science"] = science_series(depths, science_steps, compile_backend)
        write(result)
    if "flatness" in parts:
        result["flatness"] = {"load_average": {"before": os.getloadavg()}}

        def on_row(summary):
            result["flatness"] |= summary
            write(result)
        cpu_flatness(flat, on_row)
        result["flatness"]["load_average"]["after"] = os.getloadavg()
    met = {f"compiled_keel_over_pre_ln_{k}": v["keel_over_pre_ln_step_time"]["compiled"]["median"]
           <= CPU_TARGETS["compiled_keel_over_pre_ln_at_most"] for k, v in result["shapes"].items()}
    if "train-default" in result["shapes"]:
        met["compiled_speedup_train_default_keel"] = (
            result["shapes"]["train-default"]["compiled_speedup"]["keel"]["median"]
            >= CPU_TARGETS["compiled_speedup_at_least"])
    if "science" in result:
        sci = result["science"]
        met["compile_time_flat_in_depth"] = sci["compile_s_deep_over_shallow"] <= CPU_TARGETS[
            "compile_time_deep_over_shallow_at_most"]
        for v in VARIANTS:
            met[f"ms_per_sublayer_flat_{v}"] = sci["ms_per_sublayer_spread"][v] <= CPU_TARGETS[
                "ms_per_sublayer_spread_at_most"]
    for scheme, r in result.get("flatness", {}).get("per_scheme", {}).items():
        if r["flat"] is not None:  # None: not every depth was measured, so no verdict
            met[f"ms_per_sublayer_flat_128_1024_{scheme}"] = bool(r["flat"])
    if "cold_warmup" in result:
        met["keel_warmup_within_1_3x_pre_ln"] = result["cold_warmup"]["keel_over_pre_ln"] <= CPU_TARGETS[
            "keel_warmup_over_pre_ln_at_most"]
    result["targets"] = CPU_TARGETS | {"met": met}
    write(result)
    return result


def cpu_flatness(flat: dict, on_row=None) -> dict:
    """flatness_series at the `flat` shape (CPU_FLATNESS), eager, float32, on `flat["threads"]` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(flat["threads"])
    try:
        return flatness_series(ModelConfig(**flat["model"]),
                               RunConfig(batch_size=flat["batch_size"], seq_len=flat["seq_len"], dtype="float32"),
                               tuple(flat["sublayers"]), steps=flat["steps"], warmup=flat["warmup"],
                               repeats=flat["repeats"], device=torch.device("cpu"), on_row=on_row)
    finally:
        torch.set_num_threads(before)


def science_series(depths, steps: int, compile_backend: str = "inductor") -> dict:
    """Keel at the science experiments' shape, one thread (as a sweep point runs), eager and compiled stepping
    alternately at each depth: ms per sub-layer, the compiled speedup, and the compile time (the warm-up step's
    time less an ordinary step's). Inductor's and AOTAutograd's on-disk caches are off here, so every depth
    compiles from scratch and the compile times compare."""
    import torch._functorch.config as functorch_config  # noqa: PLC0415
    import torch._inductor.config as inductor_config  # noqa: PLC0415

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            for n in depths:
                torch._dynamo.reset()
                config = science(n_blocks=n // 2)
                run = {v: RunConfig(batch_size=SCIENCE_BATCH[0], seq_len=SCIENCE_BATCH[1], dtype="float32",
                                    compile=v == "compiled") for v in VARIANTS}
                benches = {v: Bench(config, run[v], device=torch.device("cpu"), compile_backend=compile_backend)
                           for v in VARIANTS}
                warm = alternate(benches, steps, 1)
                step = {v: statistics.median(b.times) for v, b in benches.items()}
                rows.append({"n_sublayers": n, "step_time_s": step,
                             "ms_per_sublayer": {v: 1e3 * t / n for v, t in step.items()},
                             "compile_s": max(0.0, warm["compiled"] - step["compiled"]),
                             "compiled_speedup": step["eager"] / step["compiled"],
                             "fused_junctions": benches["compiled"].fused})
                del benches
    finally:
        torch.set_num_threads(before)
    first = rows[0]
    return {"rows": rows, "compile_s_deep_over_shallow": rows[-1]["compile_s"] / max(first["compile_s"], 1e-9),
            "ms_per_sublayer_spread": {v: max(abs(r["ms_per_sublayer"][v] / first["ms_per_sublayer"][v] - 1)
                                              for r in rows) for v in VARIANTS}}


def _spread_text(x: dict, fmt: str = "{:.3f}") -> str:
    return f"**{fmt.format(x['median'])}** ({fmt.format(x['min'])}-{fmt.format(x['max'])})"


def cpu_markdown(result: dict) -> str:
    m, st = result["machine"], result["settings"]
    compared = "compare" in st.get("parts", ["compare"])
    lines = [f"# CPU suite ({m['cpu']}, {m['cpu_count']} cores, {m['torch_threads']} torch threads, "
             f"torch {m['torch_version']})", "",
             (f"Four models step alternately in one process (Keel and Pre-LN, eager and compiled), "
              f"{st['steps']} timed steps each, {st['repeats']} times over, after {st['warmup']} warm-up steps "
              f"(compilation happens there), float32; ratios are per repeat, shown as median (min-max). Compiled "
              f"Keel fuses its junctions across blocks (`run.fused_junction=auto`). " if compared else
              f"Parts run: {', '.join(st['parts'])}. ")
             + f"Load average before timing: {result['idle_check']['load_average'][0]:.2f} (waited "
             f"{result['idle_check']['waited_s']} s)."
             + ("" if result["idle_check"]["idle"] else " **The machine never became idle: other work is in these "
                "times.**"), ""]
    for name, shape in result["shapes"].items():
        cfg = st["shapes"][name]
        lines += [f"## {name}: d_model={cfg['model']['d_model']}, {cfg['n_sublayers']} sub-layers, "
                  f"batch {cfg['batch_size']} x {cfg['seq_len']}", "",
                  "| model | step time (ms, median) | tokens/s | warm-up (s) |", "|---|---|---|---|"]
        lines += [f"| {k} | {1e3 * r['step_time_s']:.1f} | {r['tokens_per_s']:,.0f} | {r['warmup_s']:.1f} |"
                  for k, r in shape["results"].items()]
        ratio, speedup = shape["keel_over_pre_ln_step_time"], shape["compiled_speedup"]
        lines += ["", f"Keel / Pre-LN step time: eager {_spread_text(ratio['eager'])}, compiled "
                  f"{_spread_text(ratio['compiled'])}. Compiled over eager (step time): Keel "
                  f"{_spread_text(speedup['keel'], '{:.2f}x')}, Pre-LN {_spread_text(speedup['pre_ln'], '{:.2f}x')}. "
                  f"Load average {shape['load_average']['before'][0]:.2f} before, "
                  f"{shape['load_average']['after'][0]:.2f} after (this process included).", ""]
    if "science" in result:
        sci, ss = result["science"], st["science"]
        lines += [f"## science shape: d_model=64, batch {ss['batch_size']} x {ss['seq_len']}, one thread, Keel", "",
                  f"Eager and compiled step alternately, {ss['steps']} timed steps each at every depth; compile time "
                  "= the first step's time less an ordinary step's, with Inductor's and AOTAutograd's on-disk caches "
                  "off (every depth compiles from scratch).", "",
                  "| sub-layers | eager (ms/sub-layer) | compiled (ms/sub-layer) | compiled speedup | compile (s) |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['n_sublayers']} | {r['ms_per_sublayer']['eager']:.3f} | "
                  f"{r['ms_per_sublayer']['compiled']:.3f} | {r['compiled_speedup']:.2f}x | {r['compile_s']:.1f} |"
                  for r in sci["rows"]]
        lines += ["", f"Compile time at {sci['rows'][-1]['n_sublayers']} over {sci['rows'][0]['n_sublayers']} "
                  f"sub-layers: **{sci['compile_s_deep_over_shallow']:.2f}x**. Largest departure of ms per sub-layer "
                  f"from the shallowest depth's: eager {sci['ms_per_sublayer_spread']['eager']:.1%}, compiled "
                  f"{sci['ms_per_sublayer_spread']['compiled']:.1%}.", ""]
    if "cold_warmup" in result:
        cw = result["cold_warmup"]
        where = ("in a fresh process (as `keel train` starts), " if cw.get("fresh_processes") else "")
        order = (f"{cw['repeats']} times, the order alternating; the median, " if cw.get("repeats", 1) > 1 else "")
        lines += [f"## Compile warm-up from nothing, {cw['n_sublayers']} sub-layers", "",
                  f"Each scheme alone {where}after a Dynamo reset, with an empty Inductor cache of its own (no scheme "
                  f"reuses another's kernels or an earlier run's); {order}first step = compile + one step.", "",
                  "| scheme | first step (s) | each (s) | second step (s) | graphs | recompiles |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {k} | {r['first_step_s']:.2f} | "
                  f"{', '.join(f'{x:.2f}' for x in r.get('each_first_step_s', [r['first_step_s']]))} | "
                  f"{r['second_step_s']:.3f} | {r['graphs']} | {r['recompiles']} |" for k, r in cw["schemes"].items()]
        lines += ["", f"Keel / Pre-LN warm-up: **{cw['keel_over_pre_ln']:.2f}x** (the compiled default)"
                  + (f"; with Keel's junction off, {cw['keel_off_over_pre_ln']:.2f}x" if "keel_off_over_pre_ln" in cw
                     else "") + ".", ""]
    if "per_scheme" in result.get("flatness", {}):
        f, fs = result["flatness"], st["flatness"]
        lines += flatness_markdown(f, f"## Time per sub-layer against depth: d_model={fs['model']['d_model']}, batch "
                                      f"{fs['batch_size']} x {fs['seq_len']}, eager, {fs['threads']} thread(s)")
        lines[-1:-1] = [f"Each model built, timed ({fs['steps']} steps after {fs['warmup']} warm-up; median) and "
                        f"freed alone; {fs['repeats']} passes over the depths, every other one deepest first; the "
                        f"median of the passes. Load average {f['load_average']['before'][0]:.2f} before"
                        + (f", {f['load_average']['after'][0]:.2f} after." if "after" in f["load_average"] else ".")]
    if "targets" in result:
        t = result["targets"]
        lines += [f"Targets: compiled Keel/Pre-LN <= {t['compiled_keel_over_pre_ln_at_most']} (median "
                  f"of the repeats), compiled >= {t['compiled_speedup_at_least']}x eager for the default job, compile "
                  f"time deepest/shallowest <= {t['compile_time_deep_over_shallow_at_most']}, ms per sub-layer within "
                  f"+-{t['ms_per_sublayer_spread_at_most']:.0%}, cold Keel/Pre-LN warm-up <= "
                  f"{t.get('keel_warmup_over_pre_ln_at_most', '-')}, ms per sub-layer from 128 to 1024 "
                  f"sub-layers within +-{t.get('ms_per_sublayer_flat_128_1024_at_most', 0.1):.0%}: "
                  + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in t["met"].items()) + "."]
    return "\n".join(lines) + "\n"


COMMAND = "benchmarks/cpu/suite.py"
READS = Reads(COMMAND, ("run.threads",), "a fixed campaign")  # of keel's merged config: run.threads, applied first


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=COMMAND, description="The project's CPU suite: Keel against Pre-LN, compiled "
                                "against eager, compile warm-up, and time per sub-layer against depth.")
    add_config_arguments(p)
    p.add_argument("--out", help="directory for bench.json and bench.md, rewritten after every part")
    p.add_argument("--sections", help=f"a comma-separated subset of {','.join(CPU_PARTS)} (default: all; flatness: "
                                      "time per sub-layer from 128 to 1024 sub-layers, Keel and Pre-LN)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model first")
    p.add_argument("--idle-load", type=float, default=0.5,
                   help="wait until the 1-minute load average is below this before timing")
    p.add_argument("--idle-wait", type=float, default=900, help="wait at most this many seconds")
    return p


def run(args) -> dict:
    if args.preset:
        raise ConfigError(f"--preset: not used by {COMMAND} ({READS.why})")
    for name, low in (("steps", 1), ("warmup", 0)):  # a negative count has no median; a huge one times for ever
        if not low <= getattr(args, name) <= 100_000:
            raise ConfigError(f"--{name}: got {getattr(args, name)}; allowed: an integer in [{low}, 100,000]")
    config = load_config(args.overrides, args.config, None, READS)
    runtime.set_threads(config.run.threads)
    sections = args.sections.split(",") if args.sections else list(CPU_PARTS)
    unknown = set(sections) - set(CPU_PARTS)
    if unknown:
        raise ConfigError(f"--sections: unknown {', '.join(sorted(unknown))}; allowed: {', '.join(CPU_PARTS)}")
    result = cpu_suite(args.steps, args.warmup, writer(Path(args.out) if args.out else None, cpu_markdown),
                       args.idle_load, args.idle_wait, parts=sections)
    print(cpu_markdown(result))
    return result


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_intermixed_args(argv)
    try:
        run(args)
    except KeelError as err:  # a field or flag it does not take: one line, as keel's own commands answer
        print(f"{COMMAND}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
