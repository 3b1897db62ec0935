#!/usr/bin/env bash
# Rule 25 in results/README.md (written before its runs): Keel, Pre-LN and Post-LN at 64 sub-layers and 1.02M tokens,
# every hyper-parameter tuned there (rule 21's method at one depth). Single-threaded, in one slot beside rule 21's
# sweep (run8.sh); may also be started in two shells (points are claimed, never run twice).
# Usage: bash results/run12.sh
set -euo pipefail
export OMP_NUM_THREADS=1
keel experiment depth-sweep --out results/depth-long-tuned 'depths=[64]' run.steps=2000 'schemes=[keel,pre_ln,post_ln]' \
  'warmups_above=[1500,2000]'
