#!/usr/bin/env bash
# A/B of the attn expansion + FFN pre in one launch (DSV4LAB_HC_POST_PRE 0 / 1, mhc_fused.hc_post_pre)
# on one GPU: the mHC GPU tests (the fused launch bitwise the two, the embedded model bitwise), ROUNDS
# alternations of one V4-Pro layer's graph step (export helpers), full depth (61 layers, 8 experts,
# 4k) both ways, then the per-launch trace with it on. Results in $OUT/post_pre.tgz.
# Usage (device tool, carry .whl): bash benchmarks/results/decode/stop53/post_pre_ab.sh $OUT [ROUNDS]
set -u
OUT=${1:?out dir}
ROUNDS=${2:-2}
W=/tmp/post_pre; rm -rf $W; mkdir -p $W
export PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader | tee $W/gpu.txt
python3 -m pytest --version > /dev/null 2>&1 || pip install -q --no-index .whl/*.whl > /dev/null 2>&1
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_mhc_kernel.py tests/test_layer_graphs.py \
  > $W/gpu_tests.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $W/gpu_tests.txt | tail -6
echo "tests: ${SECONDS}s"
for i in $(seq 1 "$ROUNDS"); do
  for on in 0 1; do
    [ $SECONDS -gt 330 ] && break 2
    DSV4LAB_HC_POST_PRE=$on timeout 100 python3 benchmarks/decode.py --steps 64 --skip-tiny --layer-modes kernels \
      --helpers quantised --json "$W/layer_pp${on}_$i.json" > /dev/null 2>&1
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['layer_type'][:5], round(r['graph_ms'] * 1e3, 1), r['kernels_per_step']) for r in d['v4_pro_layer']])" \
      "$W/layer_pp${on}_$i.json" "post_pre=$on round $i (type, graph us, kernels)"
  done
done
echo "layers: ${SECONDS}s"
for on in 0 1; do
  DSV4LAB_HC_POST_PRE=$on timeout 110 python3 benchmarks/full_model.py --preset v4-pro --experts 8 --gpus 1 \
    --context 4096 --steps 32 --prefill-iters 1 --json $W/full_model_pp$on.json > $W/full_model_pp$on.txt 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], {k: d.get(k) for k in ('floor_ms', 'graph_ms', 'graph_over_floor', 'eager_ms', 'host_op_us', 'kernels_per_step')})" $W/full_model_pp$on.json "post_pre=$on"
done
echo "full depth: ${SECONDS}s"
DSV4LAB_HC_POST_PRE=1 OUT=$W timeout 60 python3 benchmarks/results/decode/decode_trace.py quantised > $W/trace.txt 2>&1
grep span $W/trace.txt
tar czf $OUT/post_pre.tgz -C $W .
echo "done: ${SECONDS}s"
