#!/usr/bin/env bash
# Rule 28 in results/README.md (written before its runs): the depth frontier with every scheme's warm-up tuned at 1024
# sub-layers; every committed point of rules 15, 22 and 27 reused (rule 27's Post-LN and DeepNorm searches as they
# are). Single-threaded, in the slot beside rule 21's sweep (run8.sh), after rule 26 (run13.sh); may also be started
# in two shells (points are claimed, never run twice). Usage: bash results/run15.sh
set -euo pipefail
export OMP_NUM_THREADS=1
keel experiment frontier --out results/frontier grow=2 'warmup_schemes=[post_ln,deepnorm,pre_ln,keel]'
