#!/usr/bin/env bash
# Rule 27 in results/README.md (written before its runs): the depth frontier with Post-LN's and DeepNorm's warm-up
# tuned at 1024 sub-layers; every committed point of rules 15 and 22 reused. Single-threaded, in the slot beside
# rule 21's sweep (run8.sh); may also be started in two shells (points are claimed, never run twice).
# Usage: bash results/run14.sh
set -euo pipefail
export OMP_NUM_THREADS=1
keel experiment frontier --out results/frontier grow=2 'warmup_schemes=[post_ln,deepnorm]'
