#!/usr/bin/env bash
# Stop 46, H200: main (.base: the q folds declared) against the layer norms folded into hc_pre
# (norms_with): the GPU tests of the touched modules, main and this tree alternating (one V4-Pro
# layer's graph step each, then the eager host time of one layer step, benchmarks/eager_layer.py),
# then the full-depth model on this tree.
# Usage (device tool, carry .base = main): bash benchmarks/results/decode/stop46_norm_fold/run.sh $OUT
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
[ -e .base/data ] || ln -s ../data .base/data
nvidia-smi --query-gpu=name --format=csv,noheader
SECONDS=0
timeout -s INT 200 python3 -m pytest -m gpu tests/test_mhc_kernel.py tests/test_kernels_model.py tests/test_layer_graphs.py \
  tests/test_indexer_topk.py -q -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | tail -12
echo "tests: ${SECONDS}s"
. "$(dirname "$0")/../ab_layers.sh"
ab_layers 2 100 $OUT
echo "layers: ${SECONDS}s"
for run in .base:1 .:1 .base:2 .:2; do
  root=${run%:*}; i=${run#*:}
  v=$( [ $root = . ] && echo new || echo old )
  (cd $root && timeout 60 python3 benchmarks/eager_layer.py --layer both --steps 100 --json $OUT/eager_${v}_$i.json 2>&1 \
    | grep " host " | sed "s/^/$v $i /")
done
echo "eager: ${SECONDS}s"
timeout 120 python3 benchmarks/full_model.py --preset v4-pro --experts 8 --gpus 1 --context 4096 --steps 32 \
  --prefill-iters 2 --json $OUT/full_model.json > $OUT/full_model.txt 2>&1
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('floor_ms', 'graph_ms', 'graph_over_floor', 'eager_ms', 'host_op_us', 'kernels_per_step', 'prefill_tok_s', 'prefill_over_compute_floor')})" $OUT/full_model.json
echo "done: ${SECONDS}s"
