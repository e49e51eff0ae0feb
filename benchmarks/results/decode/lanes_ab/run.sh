#!/usr/bin/env bash
# Decode lanes (dsv4lab/lanes.py: the compressors' step and the indexer's selection on a side stream
# beside the q path) "off" against "graph" (DSV4LAB_DECODE_LANES), same tree, same GPU: their GPU
# tests, full depth (61 layers, 8 experts, 4k context), then ROUNDS alternations of one V4-Pro
# layer's graph step (benchmarks/decode.py, 384 experts) while time is left. The stored runs
# h100_first/ and h100_borrow/ predate the modes: their lanes=0/1 are off / "all" (eager forked too).
# Usage (device tool, carry .whl: pytest wheels): bash benchmarks/results/decode/lanes_ab/run.sh $OUT [ROUNDS] [profile]
# (profile: then cProfile full-depth eager steps, lanes "all" and off, while time is left)
set -u
OUT=${1:?out dir}
ROUNDS=${2:-2}
export PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pytest --version > /dev/null 2>&1 || pip install -q --no-index .whl/*.whl > /dev/null 2>&1
timeout -s INT 150 python3 -m pytest -m gpu tests/test_lanes.py \
  -q -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | tail -8
echo "tests: ${SECONDS}s"
for on in off graph; do
  DSV4LAB_DECODE_LANES=$on timeout 110 python3 benchmarks/full_model.py --preset v4-pro --experts 8 --gpus 1 --context 4096 \
    --steps 32 --prefill-iters 1 --json $OUT/full_model_lanes$on.json > $OUT/full_model_lanes$on.txt 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], {k: d.get(k) for k in ('floor_ms', 'graph_ms', 'graph_over_floor', 'eager_ms', 'host_op_us', 'kernels_per_step')})" $OUT/full_model_lanes$on.json "lanes=$on"
done
echo "full depth: ${SECONDS}s"
for i in $(seq 1 "$ROUNDS"); do
  for on in off graph; do
    [ $SECONDS -gt 430 ] && break 2
    DSV4LAB_DECODE_LANES=$on timeout 100 python3 benchmarks/decode.py --json "$OUT/layer_lanes${on}_$i.json" --steps 64 \
      --skip-tiny --layer-modes kernels > "$OUT/layer_lanes${on}_$i.txt" 2>&1
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['layer_type'][:5], round(r['graph_ms'] * 1e3, 1), round(r['eager_ms'] * 1e3), r['kernels_per_step']) for r in d['v4_pro_layer']])" \
      "$OUT/layer_lanes${on}_$i.json" "lanes=$on round $i (type, graph us, eager us, kernels)"
  done
done
echo "layers: ${SECONDS}s"
if [ "${3:-}" = "profile" ]; then  # cProfile of full-depth eager steps, lanes on then off
  for on in all off; do
    [ $SECONDS -gt 480 ] && break
    DSV4LAB_DECODE_LANES=$on timeout 60 python3 benchmarks/results/decode/full_eager_profile.py > "$OUT/eager_profile_lanes$on.txt" 2>&1
    echo "lanes=$on $(head -1 $OUT/eager_profile_lanes$on.txt)"
  done
fi
echo "done: ${SECONDS}s"
