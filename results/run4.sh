#!/usr/bin/env bash
# Round 2, rules 13 and 14: the bf16 stream at 256 sub-layers (Keel), then depth at 1M tokens at 32 sub-layers.
# Two queues each; seed 2 runs in a second directory.
#   bash results/run4.sh a; bash results/run4.sh b   # side by side
#   bash results/run4.sh merge                       # seed-2 points copied in, report rewritten (no retraining)
set -euo pipefail
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
cd "$(dirname "$0")/.."
ARGS="depth=256 schemes=[keel] lrs=[0.003] init_depths=[256]"
# rule 14: the 32-sub-layer point of depth at 1M tokens (c and d side by side, then merge32)
LONG32="depths=[32] run.steps=2000 optim.warmup_steps=100 curve_every=100 lr_from=results/depth/results.json"
case "${1:-}" in
  a) keel experiment stream-precision --out results/stream-precision-256 $ARGS seeds=[0,1] ;;
  b) keel experiment stream-precision --out results/stream-precision-256-s2 $ARGS seeds=[2] ;;
  c) keel experiment depth --out results/depth-long-32 $LONG32 seeds=[0,1] ;;
  d) keel experiment depth --out results/depth-long-32-s2 $LONG32 seeds=[2] ;;
  merge32)
    cp -n results/depth-long-32-s2/points/*-seed2.json results/depth-long-32/points/
    keel experiment depth --out results/depth-long-32 $LONG32 seeds=[0,1,2] ;;
  merge)
    cp -n results/stream-precision-256-s2/points/*-seed2.json results/stream-precision-256/points/
    keel experiment stream-precision --out results/stream-precision-256 $ARGS seeds=[0,1,2] ;;
  *) echo "usage: $0 a|b|merge|c|d|merge32" >&2; exit 2 ;;
esac
