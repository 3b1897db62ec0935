#!/usr/bin/env bash
# Rule 24 in results/README.md (written before its runs): downstream at the end of each arm's own schedule, Keel's
# step count searched against Pre-LN's committed 2,000-step runs (results/downstream). Single-threaded, in one slot
# beside rule 21's sweep (run8.sh); may also be started in two shells (points are claimed, never run twice).
# Usage: bash results/run11.sh
set -euo pipefail
export OMP_NUM_THREADS=1
keel experiment downstream-end --out results/downstream-end
