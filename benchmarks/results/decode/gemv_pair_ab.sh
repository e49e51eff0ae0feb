#!/usr/bin/env bash
# wq_a + wkv as one TMA GEMV launch (Attention.quant_pair_kernel): the GEMV / model GPU tests, then old
# (.base: main before the change) and new code alternating, one V4-Pro layer's graph step each
# (decode.py, 384 experts).
# Usage (device tool, carry .base): bash benchmarks/results/decode/gemv_pair_ab.sh $OUT
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
[ -e .base/data ] || ln -s ../data .base/data
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -m gpu tests/test_kernels.py tests/test_kernels_model.py tests/test_linear_plain.py \
  tests/test_layer_graphs.py -q -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/gpu_tests.txt
for i in 1 2; do
  for root in .base .; do
    v=$( [ $root = . ] && echo new || echo old )
    (cd $root && timeout 120 python3 benchmarks/decode.py --json $OUT/layer_${v}_$i.json --steps 64 --skip-tiny \
      --layer-modes kernels > /dev/null 2>&1)
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['layer_type'][:5], round(r['graph_ms'] * 1e3, 1), r['kernels_per_step']) for r in d['v4_pro_layer']])" $OUT/layer_${v}_$i.json "$v $i"
  done
done
