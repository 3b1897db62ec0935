"""Compile warm-up from nothing, Keel against Pre-LN: each scheme's first training step (compile + one step) with
empty caches of its own, optionally each in a fresh Python process. The CPU suite (benchmarks/cpu/suite.py) and
the GPU campaign (campaign.py) measure it; `python cold_compile.py` is the child process of one measurement (its
JSON spec on stdin, its result on the last line of stdout)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from keel.bench.core import Bench, compile_counts, free, fresh_compile_state, scheme_config
from keel.config import OptimConfig, RunConfig
from keel.model import ModelConfig
from keel.runtime import resolve_device


def cold_warmup(config: ModelConfig, run: RunConfig, schemes: list[str], optim: OptimConfig | None = None,
                device: torch.device | None = None, repeats: int = 1, processes: bool = False,
                deadline: float | None = None, progress=None, **bench_options) -> dict:
    """Compile warm-up of each scheme from nothing: its first training step (compile + one step), after a Dynamo
    reset and with an empty Inductor cache directory of its own, so no scheme reuses kernels another compiled
    (in one shared cache the scheme compiled second finds the first one's identical kernels, and on-disk caches
    from earlier runs make any order fast). Per scheme: the first step's seconds, the second step's, and Dynamo's
    graph and recompile counts.

    `processes`: each measurement in a fresh Python process, as a user's `keel train` starts. In one process the
    first compile also pays the process's own one-time costs (Inductor's lazy imports and set-up, the first C++
    build): on 2 loaded cores about 10 s, which whichever scheme went first was charged (Keel/Pre-LN 3.2x with
    Keel first, 0.91x with Pre-LN first, the same code). `repeats` > 1 alternates the order (each repeat
    reversed from the last) and reports each scheme's median, with every repeat's seconds in `each_first_step_s`.
    Per scheme also `n`, the measurements taken.

    A time-boxed campaign (`deadline`, time.monotonic()): no measurement starts after it, a fresh process is
    stopped `DEADLINE_GRACE_S` past it, and a measurement that fails or is stopped is recorded in the scheme's
    `failed` list instead of raising; a scheme never measured is left out. `progress(summary)` is called after
    every measurement with the summary so far (to save it as it grows).
    """
    device = device or resolve_device(run.device)
    each: dict[str, list[dict]] = {s: [] for s in schemes}
    failed: dict[str, list[str]] = {s: [] for s in schemes}
    order = [s for r in range(repeats) for s in (schemes if r % 2 == 0 else schemes[::-1])]
    for s in order:
        if deadline is not None and time.monotonic() > deadline:
            break
        timeout = None if deadline is None else max(1.0, deadline - time.monotonic()) + DEADLINE_GRACE_S
        try:
            with tempfile.TemporaryDirectory(prefix="keel-inductor-") as cache:
                if processes:
                    each[s].append(_first_steps_in_process(scheme_config(config, s), run, optim, device,
                                                           bench_options, cache, timeout))
                else:
                    with _inductor_cache(cache):
                        each[s].append(_first_steps(scheme_config(config, s), run, optim, device, bench_options))
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            if deadline is None:
                raise
            failed[s].append(str(err).splitlines()[0] if str(err) else type(err).__name__)
        if progress is not None:
            progress(_cold_summary(each, failed, repeats, processes))
    return _cold_summary(each, failed, repeats, processes)


DEADLINE_GRACE_S = 60.0  # how long past a time box a cold warm-up measurement that started inside it may run


def _cold_summary(each: dict, failed: dict, repeats: int, processes: bool) -> dict:
    out = {}
    for s, results in each.items():
        if not results:
            if failed[s]:
                out[s] = {"n": 0, "failed": failed[s]}
            continue
        firsts = [x["first_step_s"] for x in results]
        out[s] = {k: v for k, v in results[0].items() if k != "pid"} | {"first_step_s": statistics.median(firsts),
                               "second_step_s": statistics.median(x["second_step_s"] for x in results),
                               "n": len(results)}
        if repeats > 1:
            out[s]["each_first_step_s"] = firsts
        if processes:
            out[s]["processes"] = [x["pid"] for x in results]
        if failed[s]:
            out[s]["failed"] = failed[s]
    return out


def _first_steps_in_process(config, run, optim, device, bench_options, cache: str,
                            timeout: float | None = None) -> dict:
    """`_first_steps` in a new Python process (same interpreter, same thread count) with `cache` as its Inductor
    cache; the spec goes in on stdin and the result comes back as the last line of stdout."""
    spec = {"config": asdict(config), "run": asdict(run), "optim": None if optim is None else asdict(optim),
            "device": str(device), "bench_options": bench_options, "threads": torch.get_num_threads()}
    # Triton's cache too: without TRITON_CACHE_DIR it lives inside Inductor's (cache_dir_utils.triton_cache_dir)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"} | {"TORCHINDUCTOR_CACHE_DIR": cache}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve())], input=json.dumps(spec), env=env,
                          capture_output=True, text=True, check=False, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"cold warm-up of {config.scheme} in a fresh process failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _first_steps_main() -> None:
    """`python cold_compile.py`: one `_first_steps` from the JSON spec on stdin (`_first_steps_in_process`)."""
    spec = json.loads(sys.stdin.read())
    torch.set_num_threads(spec["threads"])
    optim = None if spec["optim"] is None else OptimConfig(**spec["optim"])
    result = _first_steps(ModelConfig(**spec["config"]), RunConfig(**spec["run"]), optim,
                          torch.device(spec["device"]), spec["bench_options"])
    print(json.dumps(result | {"pid": os.getpid()}))


def _first_steps(config, run, optim, device, bench_options) -> dict:
    fresh_compile_state()
    before = compile_counts()
    b = Bench(config, run, optim, device, **bench_options)
    b.step()  # compiles
    b.step()
    first = b.times[0]
    after = compile_counts()
    graphs = after["graphs"] - before["graphs"]
    result = {"first_step_s": first, "second_step_s": b.times[-1], "graphs": graphs, "recompiles": max(0, graphs - 1)}
    del b
    free(device)
    return result


def _inductor_cache(directory: str):
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir  # noqa: PLC0415

    return temporary_cache_dir(directory)


if __name__ == "__main__":
    _first_steps_main()
