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
for i in 1; do
  for root in .base .; do
    v=$( [ $root = . ] && echo new || echo old )
    (cd $root && timeout 150 python3 benchmarks/decode.py --json $OUT/layer_${v}_$i.json --steps 64 --skip-tiny \
      --layer-modes kernels > /dev/null 2>&1)
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['layer_type'][:5], round(r['graph_ms'] * 1e3, 1), r['kernels_per_step']) for r in d['v4_pro_layer']])" $OUT/layer_${v}_$i.json "$v $i"
  done
done
for root in .base .; do
  v=$( [ $root = . ] && echo new || echo old )
  (cd $root && timeout 100 python3 benchmarks/results/decode/eager_kernel_trace.py $OUT/eager_trace_$v.json 2>&1 \
    | grep -E "device us|combine|split|top_k" )
done
