#!/usr/bin/env bash
# Round 6 (rules 20 and 21 in results/README.md, each written before its runs). Every point single-threaded; the command may
# be started in two shells at once (two points at a time: points are claimed, never run twice), and an interrupted
# sweep resumes where it stopped. Usage: bash results/run8.sh pilot|sweep
set -euo pipefail
export OMP_NUM_THREADS=1
case "${1:-}" in
  pilot) keel experiment depth-pilot --out results/depth-pilot ;;   # rule 20: ~7.5 single-core hours
  sweep) keel experiment depth-sweep --out results/depth-sweep ;;   # rule 21: ~150 single-core hours
  *) echo "usage: bash results/run8.sh pilot|sweep" >&2; exit 2 ;;
esac
