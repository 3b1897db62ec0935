"""A study's points on disk: one gzip-compressed JSON file per point, `points/<key>.json.gz`."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from keel import safe_io
from keel.errors import ConfigError

SUFFIX = ".json.gz"
STEP_SERIES = ("losses", "train_losses")  # per-step training losses: kept to SERIES_DIGITS
SERIES_DIGITS = 6


def path_of(points: Path, key: str) -> Path | None:
    """The file holding point `key` in the folder `points`, or None if it is not there."""
    path = points / f"{key}{SUFFIX}"
    return path if path.is_file() else None


def exists(points: Path, key: str) -> bool:
    return path_of(points, key) is not None


def read(path: Path) -> dict:
    """A point file, checked: a damaged one (not gzip or JSON, not a mapping, nested past reason, a loss that is not
    a number) is one ConfigError naming it, never a traceback in the report that reads it."""
    try:
        data = path.read_bytes()
        point = json.loads(gzip.decompress(data))
    except (OSError, EOFError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise _damaged(path, type(err).__name__) from None
    if not isinstance(point, dict):
        raise _damaged(path, f"a JSON {type(point).__name__}, not a mapping")
    for name, value in point.items():
        if name.endswith("_loss") and not _losses(value):
            raise _damaged(path, f"{name} is {type(value).__name__}, not a number")
    return point


def _losses(value, depth: int = 2) -> bool:  # a number or None, in lists and mappings two deep at most
    if isinstance(value, (list, dict)) and depth > 0:
        return all(_losses(v, depth - 1) for v in (value.values() if isinstance(value, dict) else value))
    return value is None or type(value) in (int, float)


def _damaged(path: Path, why: str) -> ConfigError:
    return ConfigError(f"{path}: damaged point file ({why}); delete it and the sweep runs that point again")


def load(points: Path, key: str) -> dict:
    path = path_of(points, key)
    if path is None:
        raise FileNotFoundError(points / f"{key}{SUFFIX}")
    return read(path)


def keys(points: Path) -> list[str]:
    """Every point saved in the folder."""
    return sorted(p.name.removesuffix(SUFFIX) for p in points.glob(f"*{SUFFIX}"))


def encode(point: dict) -> bytes:
    """The point's bytes on disk: its step series rounded, compact JSON, gzip without a timestamp."""
    out = dict(point)
    for name in STEP_SERIES:
        if isinstance(out.get(name), list):
            out[name] = [float(f"{v:.{SERIES_DIGITS}g}") if isinstance(v, float) else v for v in out[name]]
    return gzip.compress(json.dumps(out, separators=(",", ":")).encode(), compresslevel=9, mtime=0)


def write(points: Path, key: str, point: dict) -> Path:
    """Writes point `key` whole (a reader never sees half a point) and returns its path."""
    return safe_io.write_bytes(points, points / f"{key}{SUFFIX}", encode(point), fsync=True)  # never through a link


def read_results(folder: Path) -> dict:
    """A study's results.json with its points filled in from `points/` (results.json names them, it does not
    repeat them); each point without its step series, as reports read it."""
    payload = json.loads((folder / "results.json").read_text())
    res = payload.get("results")
    if isinstance(res, dict) and isinstance(res.get("points"), list):
        res["points"] = {k: {f: v for f, v in load(folder / "points", k).items() if f not in STEP_SERIES}
                         for k in res["points"]}
    return payload
