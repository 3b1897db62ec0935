#!/usr/bin/env bash
# A 1024-sub-layer model that learns (issue 14, item 3): Keel, Pre-LN and Post-LN at the same depth and
# settings, one after another, single-threaded, with per-sub-layer telemetry; then one comparison plot.
# Usage: bash benchmarks/deep-1024-learn/run.sh [out_dir]   (default: runs/deep-1024)
set -euo pipefail
out="${1:-runs/deep-1024}"
export OMP_NUM_THREADS=1
for scheme in keel pre_ln post_ln; do
  if [ -f "$out/$scheme/summary.json" ]; then continue; fi
  keel train --preset tiny model.scheme="$scheme" model.n_blocks=512 model.d_model=64 model.n_heads=4 \
    model.n_kv_heads=2 model.d_ffn=192 model.max_seq_len=64 run.seq_len=64 run.batch_size=4 run.steps=300 \
    optim.lr=1e-3 optim.warmup_steps=30 run.seed=0 run.log_every=5 run.eval_every=100 run.eval_batches=8 \
    run.ckpt_every=100 run.telemetry_every=25 run.progress=false data.source=stdlib \
    run.out_dir="$out" run.name="$scheme" --json || true   # a diverged run (exit 3) is a result too
done
keel plot "$out/keel" "$out/pre_ln" "$out/post_ln" --out "$out/compare.png"
