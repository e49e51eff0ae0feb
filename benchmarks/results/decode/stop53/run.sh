#!/usr/bin/env bash
# Stop 53 A/B on one GPU: the side lane's stream priority (DSV4LAB_SIDE_LANE_PRIORITY high / normal;
# that switch was removed after this run, which found no gain, so both now run the normal priority)
# x hc_pre loading fn before its PDL wait (DSV4LAB_HC_PRE_EARLY_FN 1 / 0): GPU tests of the touched
# modules, ROUNDS alternations of one V4-Pro layer's graph step (benchmarks/decode.py, export helpers),
# full depth (61 layers, 8 experts, 4k) new vs old, then the per-launch trace of the new layer.
# Usage (device tool, carry .whl): bash benchmarks/results/decode/stop53/run.sh $OUT [ROUNDS]
set -u
OUT=${1:?out dir}
ROUNDS=${2:-2}
W=/tmp/stop53; rm -rf $W; mkdir -p $W
export PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader | tee $W/gpu.txt
python3 -m pytest --version > /dev/null 2>&1 || pip install -q --no-index .whl/*.whl > /dev/null 2>&1
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_mhc_kernel.py tests/test_lanes.py \
  tests/test_kernels_model.py tests/test_layer_graphs.py > $W/gpu_tests.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $W/gpu_tests.txt | tail -6
echo "tests: ${SECONDS}s"
for i in $(seq 1 "$ROUNDS"); do
  for v in high:1 normal:1 high:0 normal:0; do
    [ $SECONDS -gt 300 ] && break 2
    p=${v%:*}; e=${v#*:}
    DSV4LAB_SIDE_LANE_PRIORITY=$p DSV4LAB_HC_PRE_EARLY_FN=$e timeout 100 python3 benchmarks/decode.py --steps 64 \
      --skip-tiny --layer-modes kernels --helpers quantised --json "$W/layer_${p}_fn${e}_$i.json" > /dev/null 2>&1
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['layer_type'][:5], round(r['graph_ms'] * 1e3, 1), r['kernels_per_step']) for r in d['v4_pro_layer']])" \
      "$W/layer_${p}_fn${e}_$i.json" "priority=$p early_fn=$e round $i (type, graph us, kernels)"
  done
done
echo "layers: ${SECONDS}s"
for v in high:1 normal:0; do
  p=${v%:*}; e=${v#*:}
  DSV4LAB_SIDE_LANE_PRIORITY=$p DSV4LAB_HC_PRE_EARLY_FN=$e timeout 110 python3 benchmarks/full_model.py --preset v4-pro \
    --experts 8 --gpus 1 --context 4096 --steps 32 --prefill-iters 1 --json $W/full_model_${p}_fn$e.json > $W/full_model_${p}_fn$e.txt 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], {k: d.get(k) for k in ('floor_ms', 'graph_ms', 'graph_over_floor', 'eager_ms', 'host_op_us', 'kernels_per_step')})" $W/full_model_${p}_fn$e.json "priority=$p early_fn=$e"
done
echo "full depth: ${SECONDS}s"
OUT=$W timeout 60 python3 benchmarks/results/decode/decode_trace.py quantised > $W/trace.txt 2>&1
grep span $W/trace.txt
tar czf $OUT/stop53.tgz -C $W .
echo "done: ${SECONDS}s"
