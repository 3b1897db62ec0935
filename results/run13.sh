#!/usr/bin/env bash
# Rule 26 in results/README.md (written before its runs): tuned Keel at 64 sub-layers over the alpha grid
# {1, 2, 4, sqrtL, 16, L}, rule 19/23's points reused (copied from results/tuned/points: same configuration, same
# names). Single-threaded, in the slot beside rule 21's sweep (run8.sh); may also be started in two shells (points
# are claimed, never run twice). Usage: bash results/run13.sh
set -euo pipefail
export OMP_NUM_THREADS=1
out=results/tuned-alpha
mkdir -p $out/points
for f in results/tuned/points/*-seed*.json; do [ -e "$out/points/$(basename "$f")" ] || cp "$f" "$out/points/"; done
grid='[1e-3, 3e-3, 1e-2]'
keel experiment tuned --out $out grow=2 \
  "arms={post_ln: post_ln, keel: keel, keel-sqrtL: keel, keel-a1: keel, keel-a2: keel, keel-a4: keel, keel-a16: keel}" \
  "alphas={keel-sqrtL: sqrtL, keel-a1: 1, keel-a2: 2, keel-a4: 4, keel-a16: 16}" \
  "lrs={post_ln: $grid, keel: $grid, keel-sqrtL: $grid, keel-a1: $grid, keel-a2: $grid, keel-a4: $grid, keel-a16: $grid}"
