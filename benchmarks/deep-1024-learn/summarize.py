"""results.md for the 1024-sub-layer runs: final validation loss against the byte-unigram level, and how much
gradient the bottom 64 sub-layers receive compared with the top 64 (last telemetry record), per scheme.
Usage: python benchmarks/deep-1024-learn/summarize.py RUNS_DIR OUT.md"""

import math
import statistics
import sys
from pathlib import Path

from keel.runs.run_dir import RunDir

UNIGRAM = 3.3  # nats: the byte-unigram entropy of the stdlib corpus, measured in the max-lr experiment


def row(run: RunDir) -> dict:
    summary = run.summary() or {}
    telemetry = run.telemetry()
    last = telemetry[-1] if telemetry else {}
    grads = last.get("grad_norm", [])
    ratio = statistics.mean(grads[:64]) / statistics.mean(grads[-64:]) if len(grads) >= 128 else float("nan")
    val = summary.get("final_val_loss")
    return {"scheme": run.name, "steps": summary.get("steps"), "val": val,
            "learns": val is not None and val <= UNIGRAM - 0.5, "ratio": ratio, "at": last.get("step"),
            "diverged": summary.get("diverged"), "reason": summary.get("divergence_reason"),
            "seconds": summary.get("wall_seconds")}


def main(runs_dir: str, out: str) -> None:
    rows = [row(RunDir(Path(runs_dir) / s)) for s in ("keel", "pre_ln", "post_ln") if (Path(runs_dir) / s).exists()]
    lines = ["# Results: 1024 sub-layers, d=64, 300 steps (CPU, one seed)", "",
             "| scheme | steps | final val loss (nats) | learns (<= 2.8) | bottom-64 / top-64 grad norm | at step | "
             "diverged | wall (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        val = f"{r['val']:.4f}" if isinstance(r["val"], float) else "-"
        ratio = f"{r['ratio']:.3g}" if math.isfinite(r["ratio"]) else "-"
        lines.append(f"| {r['scheme']} | {r['steps']} | {val} | {'yes' if r['learns'] else 'no'} | {ratio} | "
                     f"{r['at']} | {r['reason'] or 'no'} | {(r['seconds'] or 0):.0f} |")
    Path(out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:3])
