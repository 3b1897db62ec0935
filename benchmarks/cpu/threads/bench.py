"""Tokens/s of a short `keel train` by thread setting, on an idle machine and with two busy processes beside
it, and the start-up time of commands that need no torch; writes README.md here.

    benchmarks/cpu/threads/run.sh            # or: python benchmarks/cpu/threads/bench.py --steps 30 --repeats 2

Each measurement is a fresh `keel train` process (so OpenMP reads its environment anew); tokens/s is the
run's own summary (steps after start-up, evaluation off, one checkpoint at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KEEL = [sys.executable, "-m", "keel.cli"]

# (label, run.threads override or None, OMP_WAIT_POLICY or None for keel's default, passive)
SETTINGS = [
    ("default (keel: one per physical core, passive)", None, None),
    ("run.threads=1", 1, None),
    ("run.threads=2", 2, None),
    ("run.threads=2, OMP_WAIT_POLICY=active (torch's own default before run.threads)", 2, "active"),
]


def clean_env(policy: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    return env


def train_once(steps: int, threads: int | None, policy: str | None, out: Path, max_seconds: float) -> tuple:
    """(tokens/s, torch threads recorded in run.json, steps done) of one short cpu-demo run; a run still going
    after `max_seconds` is interrupted (Ctrl-C: keel writes its summary) and measured on the steps it did."""
    name = f"t{time.time_ns()}"
    cmd = [*KEEL, "train", "--json", f"run.steps={steps}", "run.eval_every=0", "run.ckpt_every=0",
           "run.telemetry_every=0", "run.progress=false", f"run.out_dir={out}", f"run.name={name}"]
    if threads is not None:
        cmd.append(f"run.threads={threads}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(policy))
    try:
        _, err = proc.communicate(timeout=max_seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate()
    finally:  # this script stopped (Ctrl-C, SIGTERM): no training left behind
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    summary_path = out / name / "summary.json"
    if not summary_path.exists():
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    summary = json.loads(summary_path.read_text())
    recorded = json.loads((out / name / "run.json").read_text())["torch_threads"]
    return summary["tokens_per_second"], recorded, summary["steps"]


def startup_seconds(argv: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True, env=clean_env(None))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Busy:
    """`n` processes spinning on a CPU each (other jobs on a shared machine); stopped by their ids on exit."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(2)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps per measurement")
    parser.add_argument("--repeats", type=int, default=2, help="measurements per cell (the median is shown)")
    parser.add_argument("--max-seconds", type=float, default=120,
                        help="a run still going after this is stopped and measured on the steps it did")
    parser.add_argument("--out", default=str(HERE / "README.md"))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the busy processes are stopped on the way out

    loads = [("no added load", 0), ("+ 2 busy processes", 2)]
    rows, raw = [], {}
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="keel-threads-") as tmp:
        for label, n_busy in loads:
            with Busy(n_busy):
                for setting, threads, policy in SETTINGS:
                    results = [train_once(args.steps, threads, policy, Path(tmp), args.max_seconds)
                               for _ in range(args.repeats)]
                    tps = [r[0] for r in results]
                    raw[f"{label} | {setting}"] = tps
                    steps = min(r[2] for r in results)
                    rows.append((label, setting, results[0][1], statistics.median(tps), min(tps), max(tps),
                                 "" if steps == args.steps else f"; stopped at step {steps}"))
                    print(f"{label:18} {setting:80} {results[0][1]} threads  {statistics.median(tps):8,.0f} tok/s",
                          flush=True)
        start = {"keel --version": startup_seconds([*KEEL, "--version"], 3),
                 "keel --help": startup_seconds([*KEEL, "--help"], 3),
                 "python -c 'import torch'": startup_seconds([sys.executable, "-c", "import torch"], 3)}

    lines = [
        "# Threads on a shared CPU: `run.threads` and OpenMP's wait policy",
        "",
        __doc__.split("\n\n", 1)[1].strip(),
        "",
        f"Machine: {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} usable CPUs, "
        f"load average {before:.1f} before the first measurement; {args.steps} steps of the `cpu-demo` model "
        f"(2,048 tokens each), median of {args.repeats} runs (min-max in brackets); a run still going after "
        f"{args.max_seconds:.0f} s is stopped with Ctrl-C and measured on the steps it did.",
        "",
        "| load | setting | torch threads | tokens/s |",
        "|---|---|---:|---:|",
        *[f"| {load} | {setting} | {threads} | {tps:,.0f} ({lo:,.0f}-{hi:,.0f}{note}) |"
          for load, setting, threads, tps, lo, hi, note in rows],
        "",
        "Start-up (median of 3, after the measurements above):",
        "",
        "| command | seconds |",
        "|---|---:|",
        *[f"| `{cmd}` | {sec:.2f} |" for cmd, sec in start.items()],
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    (Path(args.out).parent / "threads.json").write_text(json.dumps({"tokens_per_second": raw, "startup_s": start},
                                                                   indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
