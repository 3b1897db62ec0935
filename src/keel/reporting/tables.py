"""Human-readable output: short aligned tables for train's end, `keel eval` and `keel runs` (`--json` for
machines), and the flat `task/<name>/<metric>` keys task scores take in metrics.jsonl and summary.json."""

from __future__ import annotations

import math


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
            return f"{value:.3g}"
        return f"{value:,.4f}".rstrip("0").rstrip(".") if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows of dicts as an aligned plain-text table."""
    if not rows:
        return "(none)"
    columns = columns or list(rows[0])
    text = [list(columns)] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in text) for i in range(len(columns))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in text]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def key_values(record: dict, keys: list[str] | None = None) -> str:
    """One `key  value` line per field, aligned."""
    keys = [k for k in (keys or list(record)) if k in record]
    width = max(len(k) for k in keys) if keys else 0
    return "\n".join(f"{k.ljust(width)}  {cell(record[k])}" for k in keys)


SUMMARY_KEYS = ["run_dir", "steps", "tokens", "final_train_loss", "final_val_loss", "final_val_bits_per_byte",
                "tokens_per_second", "n_params", "n_sublayers", "scheme", "diverged", "interrupted", "rollbacks",
                "wall_seconds"]
EVAL_KEYS = ["checkpoint", "split", "val_loss", "val_ppl", "val_bits_per_byte", "val_tokens"]

# task scores (keel.evals) are flat keys, `task/<name>/<metric>`, in metrics.jsonl, summary.json and the trackers
TASK_PREFIX = "task/"
TASK_METRICS = ("acc", "acc_norm", "n", "chance")


def flat_scores(scores: dict[str, dict]) -> dict:
    """keel.evals.score's `{task: {"acc": .., ...}}` as flat `task/<task>/<metric>` keys (numbers only)."""
    return {f"{TASK_PREFIX}{name}/{metric}": result[metric] for name, result in scores.items()
            for metric in TASK_METRICS if isinstance(result.get(metric), (int, float))}


def task_scores(record: dict) -> dict[str, dict]:
    """The reverse of `flat_scores`: `{task: {metric: value}}` from one record (a task name may hold '/')."""
    out: dict[str, dict] = {}
    for key, value in record.items():
        if key.startswith(TASK_PREFIX) and key.count("/") >= 2:
            name, metric = key[len(TASK_PREFIX):].rsplit("/", 1)
            out.setdefault(name, {})[metric] = value
    return out


def task_columns(records: list[dict]) -> dict:
    """`keel runs`' task column: the mean accuracy over the tasks last scored (one narrow column however many
    tasks there are), and each task's in `task_scores` for --json."""
    scores = next((s for s in map(task_scores, reversed(records)) if s), {})  # of the last record holding any
    accs = {name: s["acc"] for name, s in scores.items() if "acc" in s}
    return {"task_acc": round(sum(accs.values()) / len(accs), 4) if accs else None, "task_scores": accs}


def task_line(step: int, scores: dict[str, dict], seconds: float) -> str:
    """The progress line of one evaluation: each task's accuracy against chance, the items and the seconds."""
    parts = [f"{name} {s['acc']:.3f}" + (f" (chance {s['chance']:.2f})" if s.get("chance") is not None else "")
             for name, s in scores.items()]
    items = sum(int(s.get("n", 0)) for s in scores.values())
    return f"step {step}: tasks: {', '.join(parts)}; {items} items in {seconds:.1f}s"
