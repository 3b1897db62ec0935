#!/usr/bin/env bash
# Round 3 (rules 15-17 in results/README.md, written before these runs). Every point single-threaded; each
# command may be started in two shells at once (two points at a time: points are claimed, never run twice), and
# an interrupted sweep resumes where it stopped. Usage: bash results/run5.sh frontier|max-lr|gradflow
set -euo pipefail
export OMP_NUM_THREADS=1
case "${1:-}" in
  frontier) keel experiment frontier --out results/frontier ;;                          # rule 15: ~16 single-core hours
  max-lr) keel experiment max-lr --out results/max-lr-paper ;;                           # rule 16: ~9-10 single-core hours
  gradflow) keel experiment gradflow --out results/gradflow 'trained_seeds=[0,1,2]' ;;   # rule 17: ~20 single-core minutes
  *) echo "usage: bash results/run5.sh frontier|max-lr|gradflow" >&2; exit 2 ;;
esac
