#!/usr/bin/env bash
# How results/ was produced: two single-threaded queues, run side by side on 2 shared CPU cores.
#   bash results/run.sh depth     # queue 1
#   bash results/run.sh rest      # queue 2
# Every sweep resumes from results/<name>/points/ if interrupted. The overrides scale the defaults down to
# the CPU time this session had (chosen before any result of that experiment was seen).
set -euo pipefail
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
cd "$(dirname "$0")/.."
case "${1:-}" in
  depth) keel experiment depth --out results/depth depths=[8,32,64] run.steps=300 optim.warmup_steps=30 ;;
  rest)
    keel experiment max-lr --out results/max-lr optim.lr=0.08 run.steps=1000 depths=[16] no_clip=[pre_ln,keel]
    keel experiment ablations --out results/ablations seeds=[0,1] references=[] run.steps=300 optim.warmup_steps=30
    keel experiment redundancy --out results/redundancy run.steps=300 optim.warmup_steps=30
    keel experiment gradflow --out results/gradflow trained_seeds=[0] ;;
  *) echo "usage: $0 depth|rest" >&2; exit 2 ;;
esac
