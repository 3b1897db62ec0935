#!/usr/bin/env bash
# Round 4 (rule 18 in results/README.md, written before these runs). Every point single-threaded; the command may
# be started in two shells at once (two points at a time: points are claimed, never run twice), and an interrupted
# sweep resumes where it stopped. Usage: bash results/run6.sh downstream
set -euo pipefail
export OMP_NUM_THREADS=1
case "${1:-}" in
  downstream) keel experiment downstream --out results/downstream ;;   # rule 18: ~4 single-core hours (6-8 loaded)
  *) echo "usage: bash results/run6.sh downstream" >&2; exit 2 ;;
esac
