#!/usr/bin/env bash
# The README's Quick start as a new user runs it, timed: a fresh clone, each install into a fresh venv with pip's
# cache off (as on a new machine), then the main job (`keel train`) in the light install. Prints one line per
# step with the load average before and after; nothing else may run if you want the "idle" figures.
# Usage: bash benchmarks/cpu/quickstart/run.sh [WORKDIR]   (default /tmp/keel-quickstart; it is deleted first)
set -euo pipefail
repo="$(cd "$(dirname "$0")/../../.." && pwd)"
work="${1:-/tmp/keel-quickstart}"
rm -rf "$work" && mkdir -p "$work"
git clone -q "$repo" "$work/src"
cd "$work/src"
load() { cut -d' ' -f1 /proc/loadavg; }
step() {  # step NAME COMMAND...: wall seconds of COMMAND, load before/after
  local before start end
  before=$(load); start=$(date +%s.%N)
  "${@:2}" > "$work/$1.log" 2>&1
  end=$(date +%s.%N)
  printf '%-14s %8.1f s   load %s -> %s\n' "$1" "$(echo "$end - $start" | bc)" "$before" "$(load)"
}
export PIP_NO_CACHE_DIR=1
step install-light bash -c "python3 -m venv $work/light && $work/light/bin/pip install -q -c constraints.txt -e ."
step install-test bash -c "python3 -m venv $work/test && $work/test/bin/pip install -q -c constraints.txt -e '.[test]'"
echo "venv size: light $(du -sh "$work/light" | cut -f1), .[test] $(du -sh "$work/test" | cut -f1)"
step main-job "$work/light/bin/keel" train run.progress=false
grep -E "^(wall_seconds|final_val_loss|val_loss) " "$work/main-job.log" || tail -n 3 "$work/main-job.log"
