"""Human-readable output: short aligned tables for train's end, `keel eval` and `keel runs` (`--json` for
machines)."""

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
    text = [[c for c in columns]] + [[cell(r.get(c)) for c in columns] for r in rows]
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
