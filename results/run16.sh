#!/usr/bin/env bash
# Rule 29 in results/README.md (written before its runs): downstream at the end of each arm's own schedule, rule 24's
# search with its bracket halved until a step count meets the loss tolerance. Rule 24's points are reused (copied from
# results/downstream-end/points: same configuration, same names). Single-threaded, in the slot beside rule 21's sweep
# (run8.sh). Usage: bash results/run16.sh
set -euo pipefail
export OMP_NUM_THREADS=1
out=results/downstream-end-bisect
mkdir -p $out/points
for f in results/downstream-end/points/*-seed*.json; do [ -e "$out/points/$(basename "$f")" ] || cp "$f" "$out/points/"; done
keel experiment downstream-end --out $out bisect=3
