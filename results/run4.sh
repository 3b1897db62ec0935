#!/usr/bin/env bash
# Round 2, rule 13: the bf16 stream at 256 sub-layers (Keel). Two queues; seed 2 runs in a second directory.
#   bash results/run4.sh a; bash results/run4.sh b   # side by side
#   bash results/run4.sh merge                       # seed-2 points copied in, report rewritten (no retraining)
set -euo pipefail
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
cd "$(dirname "$0")/.."
ARGS="depth=256 schemes=[keel] lrs=[0.003] init_depths=[256]"
case "${1:-}" in
  a) keel experiment stream-precision --out results/stream-precision-256 $ARGS seeds=[0,1] ;;
  b) keel experiment stream-precision --out results/stream-precision-256-s2 $ARGS seeds=[2] ;;
  merge)
    cp -n results/stream-precision-256-s2/points/*-seed2.json results/stream-precision-256/points/
    keel experiment stream-precision --out results/stream-precision-256 $ARGS seeds=[0,1,2] ;;
  *) echo "usage: $0 a|b|merge" >&2; exit 2 ;;
esac
