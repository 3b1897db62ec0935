"""Re-judge every committed round-1/2 comparison by the round-3 rule (paired two-sided t-test, p < 0.05).

Reads only the committed per-seed numbers under results/ (no training) and prints a markdown table: the old
verdict ("beyond noise" = |mean| > 2 SE), the new one, t, p, the 95% interval, and which runs a row shares with
another row. Run from the repository root: `python results/rejudge.py > results/rejudge.md`.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from keel.experiments import stats

ROOT = Path(__file__).parent


def results(name: str) -> dict:
    return json.loads((ROOT / name / "results.json").read_text())["results"]


def arm(name: str, label: str) -> list[float]:
    return results(name)["arms"][label]["report_losses"]


def lr_sweep(scheme: str, lr: float) -> list[float]:
    pts = results("lr-sweep")["points"]
    return [pts[f"{scheme}-lr{lr:g}-seed{s}"]["report_loss"] for s in (0, 1, 2)]


def max_lr(folder: str, label: str, depth: int) -> list[float]:
    v = results(folder)["verdicts"]
    return [v[f"{label}-{depth}-seed{s}"]["max_lr"] for s in (0, 1, 2)]


def merged(folder: str, extra: str, label: str) -> list[float]:
    """Seeds 0, 1 from `folder` and seed 2 from its `-s2` companion where the sweep was split."""
    a, b = arm(folder, label), arm(extra, label)
    return a if len(a) == 3 else a[:2] + b[-1:]


def redundancy(scheme: str, mode: str, key: str) -> list[float]:
    return [r[key] for r in results("redundancy")["summary"][f"{scheme}-{mode}"]]


def old_verdict(a: list[float], b: list[float]) -> str:
    diffs = [x - y for x, y in zip(a, b) if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]
    if len(diffs) < 2:
        return "n/a"
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    return "beyond noise" if abs(statistics.fmean(diffs)) > 2 * se else "inconclusive"


def lr_sweep_best(scheme: str) -> tuple[float, list[float]]:
    """The lr-sweep LR with the lowest mean select-half loss over all seeds, and its report losses."""
    pts = results("lr-sweep")["points"]
    grid = sorted({p["lr"] for p in pts.values()})
    best = min(grid, key=lambda lr: statistics.fmean(pts[f"{scheme}-lr{lr:g}-seed{s}"]["select_loss"]
                                                     for s in (0, 1, 2)))
    return best, lr_sweep(scheme, best)


# (row of results/README.md, comparison, a, b, runs shared with another row)
ROWS = [
    ("max LR, Table 1", "Keel - Pre-LN, 16 sub-layers (Keel censored at 0.08 in 2 seeds)",
     max_lr("max-lr", "keel", 16), max_lr("max-lr", "pre_ln", 16), ""),
    ("max LR, Table 1", "Keel - Pre-LN, 64 sub-layers", max_lr("max-lr-64", "keel", 64),
     max_lr("max-lr-64", "pre_ln", 64), ""),
    ("max LR vs Post-LN", "Keel - Post-LN, 16", max_lr("max-lr", "keel", 16), max_lr("max-lr", "post_ln", 16),
     "Keel's max-lr runs (row above)"),
    ("max LR vs Post-LN", "DeepNorm - Post-LN, 16", max_lr("max-lr", "deepnorm", 16),
     max_lr("max-lr", "post_ln", 16), "Post-LN's runs (row above)"),
    ("clipping", "Pre-LN without - with clipping, 16", max_lr("max-lr", "pre_ln-noclip", 16),
     max_lr("max-lr", "pre_ln", 16), "Pre-LN's max-lr runs"),
    ("depth, Table 3", "Keel - Pre-LN, 8 sub-layers, 153,600 tokens", arm("depth", "keel-8"),
     arm("depth", "pre_ln-8"), ""),
    ("depth, Table 3", "Keel - Pre-LN, 32, 153,600 tokens", arm("depth", "keel-32"), arm("depth", "pre_ln-32"),
     "the same runs as lr-sweep at 3e-3 (Pre-LN seeds 1, 2), deep-vs-wide's deep arms and ablations' default arm"),
    ("depth, Table 3", "Keel - Pre-LN, 64, 153,600 tokens", arm("depth", "keel-64"), arm("depth", "pre_ln-64"), ""),
    ("depth, Table 3", "(Keel - Pre-LN at 64) - (at 8), 153,600 tokens",
     [k - p for k, p in zip(arm("depth", "keel-64"), arm("depth", "pre_ln-64"))],
     [k - p for k, p in zip(arm("depth", "keel-8"), arm("depth", "pre_ln-8"))], "the two rows above"),
    ("depth, Table 3", "Keel - Pre-LN, 8, 1.02M tokens", merged("depth-long", "depth-long-s2", "keel-8"),
     merged("depth-long", "depth-long-s2", "pre_ln-8"), ""),
    ("depth, Table 3", "Keel - Pre-LN, 32, 1.02M tokens", arm("depth-long-32", "keel-32"),
     arm("depth-long-32", "pre_ln-32"), ""),
    ("depth, Table 3", "Keel - Pre-LN, 64, 1.02M tokens", merged("depth-long", "depth-long-s2", "keel-64"),
     merged("depth-long", "depth-long-s2", "pre_ln-64"), ""),
    ("depth, Table 3", "(Keel - Pre-LN at 64) - (at 8), 1.02M tokens",
     [k - p for k, p in zip(merged("depth-long", "depth-long-s2", "keel-64"),
                            merged("depth-long", "depth-long-s2", "pre_ln-64"))],
     [k - p for k, p in zip(merged("depth-long", "depth-long-s2", "keel-8"),
                            merged("depth-long", "depth-long-s2", "pre_ln-8"))], "the rows above"),
    ("Keel vs Post-LN", "Keel - Post-LN, 8, 153,600 tokens", arm("depth", "keel-8"), arm("depth", "post_ln-8"),
     "Keel's depth runs"),
    ("Keel vs Post-LN", "Keel - Post-LN, 32, 153,600 tokens", arm("depth", "keel-32"),
     arm("depth", "post_ln-32"), "Keel's depth runs"),
    ("Keel vs Post-LN", "Keel - Post-LN, 64, 153,600 tokens", arm("depth", "keel-64"),
     arm("depth", "post_ln-64"), "Keel's depth runs"),
    ("Keel vs Post-LN", "Keel - Post-LN, 8, 1.02M tokens", merged("depth-long", "depth-long-s2", "keel-8"),
     merged("depth-long", "depth-long-s2", "post_ln-8"), "Keel's depth-long runs"),
    ("Keel vs Post-LN", "Keel - Post-LN, 64, 1.02M tokens", merged("depth-long", "depth-long-s2", "keel-64"),
     merged("depth-long", "depth-long-s2", "post_ln-64"), "Keel's depth-long runs"),
    ("Keel vs Post-LN", "Keel - Post-LN, 32, 3.07M tokens (regime)", merged("regime", "regime-s2", "keel"),
     merged("regime", "regime-s2", "post_ln"), "Keel's regime runs"),
    ("regime, section 5.4", "Keel - Pre-LN, final report loss, 3.07M tokens", merged("regime", "regime-s2", "keel"),
     merged("regime", "regime-s2", "pre_ln"), "Keel's regime runs"),
] + [
    ("lr-sweep, Table 2", f"Keel - Pre-LN at LR {lr:g}, 32 sub-layers", lr_sweep("keel", lr), lr_sweep("pre_ln", lr),
     "3e-3: the depth-32 runs" if lr == 3e-3 else "")
    for lr in (1.5e-3, 3e-3, 6e-3, 1.2e-2)
] + [
    ("depth, Table 3", "Keel - Pre-LN, 32, each at the lr-sweep LR chosen over all seeds (Keel {:g}, Pre-LN {:g})"
     .format(lr_sweep_best("keel")[0], lr_sweep_best("pre_ln")[0]), lr_sweep_best("keel")[1],
     lr_sweep_best("pre_ln")[1], "the lr-sweep runs at those LRs (round 3 method: LR over all seeds)"),
    ("lr-sweep, Table 2", "Keel at 6e-3 - Keel at 1.5e-3", lr_sweep("keel", 6e-3), lr_sweep("keel", 1.5e-3),
     "the lr-sweep rows above"),
    ("deep-vs-wide, Table 5", "deep Keel - deep Pre-LN", arm("deep-vs-wide", "deep-keel"),
     arm("deep-vs-wide", "deep-pre_ln"), "both arms are depth's 32-sub-layer runs"),
    ("deep-vs-wide, Table 5", "deep Keel - wide Pre-LN", arm("deep-vs-wide", "deep-keel"),
     arm("deep-vs-wide", "wide-pre_ln"), "deep Keel = depth's Keel at 32"),
    ("Keel uses its depth", "Keel at 64 - Keel at 8, 1.02M tokens",
     merged("depth-long", "depth-long-s2", "keel-64"), merged("depth-long", "depth-long-s2", "keel-8"),
     "Keel's depth-long runs"),
    ("redundancy, Appendix A", "Pre-LN upper-half - lower-half delta (whole sub-layer)",
     redundancy("pre_ln", "sublayer", "upper"), redundancy("pre_ln", "sublayer", "lower"), ""),
    ("redundancy, Appendix A", "Keel upper-half - lower-half delta (whole sub-layer)",
     redundancy("keel", "sublayer", "upper"), redundancy("keel", "sublayer", "lower"), ""),
    ("redundancy, Appendix A", "Keel upper-half - lower-half delta (branch only)",
     redundancy("keel", "branch", "upper"), redundancy("keel", "branch", "lower"), "Keel's redundancy models"),
    ("redundancy, Appendix A", "lower-half delta, Keel - Pre-LN (whole sub-layer)",
     redundancy("keel", "sublayer", "lower"), redundancy("pre_ln", "sublayer", "lower"), "the rows above"),
    ("bf16 stream", "Keel bf16 - float32 stream, 64 sub-layers", arm("stream-precision", "keel-bfloat16"),
     arm("stream-precision", "keel-float32"), ""),
    ("bf16 stream", "Pre-LN bf16 - float32 stream, 64", arm("stream-precision", "pre_ln-bfloat16"),
     arm("stream-precision", "pre_ln-float32"), ""),
    ("bf16 stream", "Keel bf16 - float32 stream, 256",
     merged("stream-precision-256", "stream-precision-256-s2", "keel-bfloat16"),
     merged("stream-precision-256", "stream-precision-256-s2", "keel-float32"), ""),
    ("ablations", "alpha = sqrtL - alpha = L", arm("ablations", "alphasqrtL"), arm("ablations", "keelalphaL-v2"),
     "alpha = L is depth's Keel at 32 (same LR 3e-3)"),
    ("ablations", "alpha = 2 - alpha = L", arm("ablations", "alpha2"), arm("ablations", "keelalphaL-v2"), "as above"),
    ("ablations", "first_layer = v1 - v2", arm("ablations", "first_layerv1"), arm("ablations", "keelalphaL-v2"),
     "as above"),
    ("ablations", "first_layer = none - v2", arm("ablations", "first_layernone"),
     arm("ablations", "keelalphaL-v2"), "as above"),
]


def main() -> None:
    print("| row | comparison (a - b, per seed) | old rule (2 SE) | new verdict (p < 0.05) | mean [95% CI], p |"
          " runs shared with |")
    print("|---|---|---|---|---|---|")
    for row, what, a, b, shared in ROWS:
        test = stats.paired(a, b)
        new = stats.verdict(test, "a < b", "a > b")
        print(f"| {row} | {what} | {old_verdict(a, b)} | {new} | {stats.describe(test, 4)} | {shared or '-'} |")


if __name__ == "__main__":
    main()
