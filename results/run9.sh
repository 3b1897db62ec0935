#!/usr/bin/env bash
# Rule 22 in results/README.md (written before its runs): the depth frontier with every LR choice interior, its
# grids grown past edge choices. One point at a time, single-threaded, beside rule 21's sweep (run8.sh) in the
# other slot; may also be started in two shells (points are claimed, never run twice). Usage: bash results/run9.sh
set -euo pipefail
export OMP_NUM_THREADS=1
keel experiment frontier --out results/frontier grow=2
