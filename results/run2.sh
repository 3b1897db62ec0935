#!/usr/bin/env bash
# Round 2 (rules: results/README.md, "Round 2 rules"): two single-threaded queues side by side on 2 cores.
#   bash results/run2.sh a      # regime, seeds 0 and 1
#   bash results/run2.sh b      # third seeds, regime seed 2, lr-sweep, deep-vs-wide, stream precision
# Every sweep resumes from its points/ if interrupted. regime seed 2 runs in results/regime-s2 and its point
# files are then copied into results/regime/points, whose report is rewritten with seeds=[0,1,2] (no retraining).
set -euo pipefail
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
cd "$(dirname "$0")/.."
REGIME="run.steps=6000 optim.warmup_steps=200 curve_every=100 curve_batches=4"
case "${1:-}" in
  a) keel experiment regime --out results/regime $REGIME seeds=[0,1] ;;
  b)
    keel experiment ablations --out results/ablations seeds=[0,1,2] references=[] run.steps=300 optim.warmup_steps=30
    keel experiment max-lr --out results/max-lr-64 optim.lr=0.08 run.steps=1000 depths=[64] schemes=[post_ln,pre_ln,keel] no_clip=[] seeds=[0,1,2]
    keel experiment regime --out results/regime-s2 $REGIME seeds=[2]
    keel experiment lr-sweep --out results/lr-sweep run.steps=300 optim.warmup_steps=30
    keel experiment deep-vs-wide --out results/deep-vs-wide run.steps=300 optim.warmup_steps=30
    keel experiment stream-precision --out results/stream-precision ;;
  merge)
    cp -n results/regime-s2/points/*-seed2.json results/regime/points/
    keel experiment regime --out results/regime $REGIME seeds=[0,1,2] ;;
  *) echo "usage: $0 a|b|merge" >&2; exit 2 ;;
esac
