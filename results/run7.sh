#!/usr/bin/env bash
# Round 5 (rule 19 in results/README.md, written before these runs). Every point single-threaded; the command may
# be started in two shells at once (two points at a time: points are claimed, never run twice), and an interrupted
# sweep resumes where it stopped. Usage: bash results/run7.sh tuned
set -euo pipefail
export OMP_NUM_THREADS=1
case "${1:-}" in
  tuned) keel experiment tuned --out results/tuned ;;   # rule 19: ~4-5 single-core hours
  *) echo "usage: bash results/run7.sh tuned" >&2; exit 2 ;;
esac
