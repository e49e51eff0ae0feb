#!/usr/bin/env bash
# A/B of the opt-in launch joins on one GPU: the attn expansion + FFN pre and the FFN expansion + next
# layer's attn pre (DSV4LAB_HC_POST_PRE, mhc_fused.hc_post_pre), and the router's gate + route
# (DSV4LAB_GATE_ROUTE, gate_route.py). Their GPU tests, full depth (61 layers, 8 experts, 4k) with
# neither / post_pre / both, then one V4-Pro layer's graph step (384 experts) neither / both while
# time is left. Results in $OUT/fusions.tgz.
# Usage (device tool, carry .whl): bash benchmarks/results/decode/stop54/fusions_ab.sh $OUT [short]
# (short: only the joins' GPU tests, full depth neither / both, no layer rounds)
set -u
OUT=${1:?out dir}
CONFIGS=("0 0" "1 0" "1 1"); LAYER_UNTIL=420
PICK=""
[ "${2:-}" = "short" ] && CONFIGS=("0 0" "1 1") && LAYER_UNTIL=0 && PICK="post_pre or gate_route"
W=/tmp/fusions; rm -rf $W; mkdir -p $W
export PYTHONUNBUFFERED=1
SECONDS=0
save() { tar czf $OUT/fusions.tgz -C $W .; }   # after each phase: a run cut short keeps what it did
nvidia-smi --query-gpu=name --format=csv,noheader | tee $W/gpu.txt
python3 -m pytest --version > /dev/null 2>&1 || pip install -q --no-index .whl/*.whl > /dev/null 2>&1
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -k "${PICK:-gpu}" tests/test_mhc_kernel.py tests/test_glue_kernels.py \
  > $W/gpu_tests.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $W/gpu_tests.txt | tail -8
echo "tests: ${SECONDS}s"
save
for cfg in "${CONFIGS[@]}"; do
  set -- $cfg
  tag=pp$1_gr$2
  DSV4LAB_HC_POST_PRE=$1 DSV4LAB_GATE_ROUTE=$2 timeout 110 python3 benchmarks/full_model.py --preset v4-pro --experts 8 \
    --gpus 1 --context 4096 --steps 32 --prefill-iters 1 --json $W/full_model_$tag.json > $W/full_model_$tag.txt 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], {k: d.get(k) for k in ('floor_ms', 'graph_ms', 'graph_over_floor', 'eager_ms', 'host_op_us', 'kernels_per_step')})" $W/full_model_$tag.json "$tag"
  save
done
echo "full depth: ${SECONDS}s"
for cfg in "0 0" "1 1" "0 0" "1 1"; do
  [ $SECONDS -gt $LAYER_UNTIL ] && break
  set -- $cfg
  tag=pp$1_gr$2
  DSV4LAB_HC_POST_PRE=$1 DSV4LAB_GATE_ROUTE=$2 timeout 60 python3 benchmarks/decode.py --steps 64 --skip-tiny \
    --layer-modes kernels --json "$W/layer_${tag}_$SECONDS.json" > /dev/null 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['layer_type'][:5], round(r['graph_ms'] * 1e3, 1), r['kernels_per_step']) for r in d['v4_pro_layer']])" \
    "$W/layer_${tag}_$SECONDS.json" "$tag (type, graph us, kernels)" 2>/dev/null
done
save
echo "done: ${SECONDS}s"
