#!/usr/bin/env bash
# Branch pending-qfolds: the attention's q norm + RoPE in the decode split programs and the indexer's
# q RoPE in its scores kernel, declared (ropes_q_with). The GPU tests of the touched modules, then
# main (.base) and this tree alternating, one V4-Pro layer's graph step each (decode.py, 384 experts),
# then the full-depth model on this tree.
# Usage (device tool, carry .base = main): bash benchmarks/results/decode/pending_qfolds_ab.sh $OUT
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
[ -e .base/data ] || ln -s ../data .base/data
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s INT 240 python3 -m pytest -m gpu tests/test_attention_decode_kernel.py tests/test_glue_kernels.py \
  tests/test_kernels_model.py tests/test_layer_graphs.py tests/test_indexer_topk.py tests/test_mhc_kernel.py \
  -q -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | tail -12
for run in .:1 .base:1 .:2 .base:2; do
  root=${run%:*}; i=${run#*:}
  v=$( [ $root = . ] && echo new || echo old )
  (cd $root && timeout 100 python3 benchmarks/decode.py --json $OUT/layer_${v}_$i.json --steps 64 --skip-tiny \
    --layer-modes kernels > /dev/null 2>&1)
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['layer_type'][:5], round(r['graph_ms'] * 1e3, 1), r['kernels_per_step']) for r in d['v4_pro_layer']])" $OUT/layer_${v}_$i.json "$v $i"
done
timeout 150 python3 benchmarks/full_model.py --preset v4-pro --experts 8 --gpus 1 --context 4096 --steps 32 \
  --prefill-iters 2 --json $OUT/full_model.json > $OUT/full_model.txt 2>&1
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('floor_ms', 'graph_ms', 'graph_over_floor', 'eager_ms', 'host_op_us', 'kernels_per_step', 'prefill_tok_s', 'prefill_over_compute_floor')})" $OUT/full_model.json
