#!/usr/bin/env bash
# Tokens/s of a short `keel train` at run.threads default / 1 / 2 (and the old spinning OpenMP threads), idle
# and with two busy processes beside it; writes README.md and threads.json here. Run it on an otherwise idle
# machine (it starts the busy processes itself): about 15-25 minutes on 2 cores with the defaults.
#   benchmarks/cpu/threads/run.sh [--steps 30] [--repeats 2] [--max-seconds 120]
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec python benchmarks/cpu/threads/bench.py "$@"
