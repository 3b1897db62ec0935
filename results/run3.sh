#!/usr/bin/env bash
# Round 2, follow-ups (rule 12 and third trained gradflow seeds), started as the run2.sh queues finish.
#   bash results/run3.sh a     # depth-long, seeds 0 and 1
#   bash results/run3.sh b     # depth-long seed 2 (in results/depth-long-s2), then gradflow's trained seeds 1, 2
#   bash results/run3.sh merge # seed-2 points into results/depth-long; reports rewritten (no retraining)
set -euo pipefail
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
cd "$(dirname "$0")/.."
LONG="depths=[8,64] run.steps=2000 optim.warmup_steps=100 curve_every=100 lr_from=results/depth/results.json"
case "${1:-}" in
  a) keel experiment depth --out results/depth-long $LONG seeds=[0,1] ;;
  b)
    keel experiment depth --out results/depth-long-s2 $LONG seeds=[2]
    rm -rf results/gradflow/points  # its points record trained_seeds=[0]; every point is re-measured
    keel experiment gradflow --out results/gradflow trained_seeds=[0,1,2] ;;
  merge)
    cp -n results/depth-long-s2/points/*-seed2.json results/depth-long/points/
    keel experiment depth --out results/depth-long $LONG seeds=[0,1,2] ;;
  *) echo "usage: $0 a|b|merge" >&2; exit 2 ;;
esac
