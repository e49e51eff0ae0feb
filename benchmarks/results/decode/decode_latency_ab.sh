#!/usr/bin/env bash
# Decode attention's combine (every split in one load), selected_extent in one load, the top-k's
# n <= k fast path: their GPU tests, then old (.base: the commit before) and new code alternating:
# one V4-Pro layer's graph step (decode.py, 384 experts) and the per-kernel device time of eager
# steps (eager_kernel_trace.py, 8 experts: no PDL overlap in the numbers).
# Usage (device tool, carry .base): bash benchmarks/results/decode/decode_latency_ab.sh $OUT
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
[ -e .base/data ] || ln -s ../data .base/data
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -m gpu tests/test_attention_decode_kernel.py tests/test_attention_kernel.py \
  tests/test_indexer_topk.py -q -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/gpu_tests.txt
. "$(dirname "$0")/ab_layers.sh"
ab_layers 1 150 $OUT
for root in .base .; do
  v=$( [ $root = . ] && echo new || echo old )
  (cd $root && timeout 100 python3 benchmarks/results/decode/eager_kernel_trace.py $OUT/eager_trace_$v.json 2>&1 \
    | grep -E "device us|combine|split|top_k" )
done
