#!/usr/bin/env bash
# Stop 46: main (.base) then this tree, full depth (61 layers, 8 experts, 4k context) on one GPU.
# Usage (carry .base = main): bash benchmarks/results/decode/stop46_norm_fold/full_depth_ab.sh $OUT
set -u
OUT=${1:?out dir}
for r in .base .; do
  v=$([ $r = . ] && echo new || echo old)
  (cd $r && timeout 110 python3 benchmarks/full_model.py --preset v4-pro --experts 8 --gpus 1 --context 4096 --steps 32 \
    --prefill-iters 1 --json $OUT/full_model_$v.json > $OUT/full_model_$v.txt 2>&1)
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], {k: d.get(k) for k in ('floor_ms', 'graph_ms', 'graph_over_floor', 'eager_ms', 'host_op_us', 'kernels_per_step')})" $OUT/full_model_$v.json $v
done
