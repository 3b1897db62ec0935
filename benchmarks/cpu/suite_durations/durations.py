"""Turn `python -m pytest --durations=0` output into tests/durations.json: seconds per test file, and every test
that took a second or more (setup, call and teardown together), with the load the machine was under.

    PYTEST_ADDOPTS=--durations=0 python -m pytest -q -m "not gpu" -n 2 --dist loadfile --no-loadscope-reorder \
        > durations.txt     # CI's command (.ci/run); `CI=true PYTEST_ADDOPTS=--durations=0 bash .ci/run` in a clone
    python benchmarks/cpu/suite_durations/durations.py durations.txt --load 4.2 6.9 > tests/durations.json

--load takes the 1-minute load averages seen during the run (sample /proc/loadavg); tests/test_test_tiers.py
scales the one-second limit by them. A test whose file was renamed since the run is filed under the file that
defines its function today (--moved), so the data follow a rename without a new run.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LINE = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S+)$")
COMMAND = 'PYTEST_ADDOPTS=--durations=0 python -m pytest -q -m "not gpu" -n 2 --dist loadfile --no-loadscope-reorder'
RESULT = re.compile(r"^=*\s*(\d+ (?:passed|failed).*) in ([\d.]+)s")


def where_defined() -> dict[str, str]:
    """Each test function's name -> the file under tests/ that defines it, for names defined once."""
    seen: dict[str, list[str]] = defaultdict(list)
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                seen[node.name].append(path.relative_to(ROOT).as_posix())
    return {name: files[0] for name, files in seen.items() if len(files) == 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="pytest's output with --durations=0")
    parser.add_argument("--load", type=float, nargs="+", required=True, help="1-minute load averages during the run")
    parser.add_argument("--moved", action="store_true", help="file tests of renamed files where they live today")
    parser.add_argument("--commit", help="the commit the run measured (default: HEAD)")
    parser.add_argument("--command", default=COMMAND, help="the command that made the output, as recorded")
    args = parser.parse_args()
    per_test: dict[str, float] = defaultdict(float)
    result, seconds = "", None
    for line in args.output.read_text().splitlines():
        if m := LINE.match(line):
            per_test[m[3]] += float(m[1])
        elif m := RESULT.match(line):
            result, seconds = m[1], float(m[2])
    dropped = []
    if args.moved:
        defined, moved = where_defined(), {}
        for nodeid, s in per_test.items():
            path, _, rest = nodeid.partition("::")
            if (ROOT / path).exists():
                moved[nodeid] = moved.get(nodeid, 0.0) + s
            elif (name := rest.split("[")[0]) in defined:
                key = f"{defined[name]}::{rest}"
                moved[key] = moved.get(key, 0.0) + s
            else:
                dropped.append(nodeid)
        per_test = moved
    files: dict[str, float] = defaultdict(float)
    for nodeid, s in per_test.items():
        files[nodeid.split("::")[0]] += s
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           cwd=ROOT).stdout
    json.dump({
        "measured": {
            "command": args.command,
            "commit": commit.strip(), "cores": os.cpu_count(), "result": result, "pytest_seconds": seconds,
            "load_average": {"min": min(args.load), "mean": round(sum(args.load) / len(args.load), 2),
                             "max": max(args.load)},
            "tests_no_longer_present": len(dropped)},
        "files": {f: round(s, 2) for f, s in sorted(files.items(), key=lambda kv: -kv[1])},
        "tests_over_1s": {t: round(s, 2) for t, s in sorted(per_test.items(), key=lambda kv: -kv[1]) if s >= 1.0},
    }, fp=sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
