#!/usr/bin/env bash
# Rule 23 in results/README.md (written before its runs): tuned Keel at 64 sub-layers with every LR choice interior,
# its grids grown past edge choices. Single-threaded, beside rule 21's sweep (run8.sh) in the other slot; may also
# be started in two shells (points are claimed, never run twice). Usage: bash results/run10.sh
set -euo pipefail
export OMP_NUM_THREADS=1
keel experiment tuned --out results/tuned grow=2
