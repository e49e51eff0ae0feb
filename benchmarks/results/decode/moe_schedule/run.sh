#!/usr/bin/env bash
# MoE decode schedules (two launches / PDL'd down launch / one fused launch), on one GPU:
# GPU tests of the MoE decode (TESTS=0 skips them), the microbench, then one V4-Pro layer per
# LAYER_VARIANTS entry (schedules; LAYER_FORMAT nvfp4 or official), MICRO=0 skips the microbench,
# alternating, ROUNDS times. Usage: bash benchmarks/results/decode/moe_schedule/run.sh $OUT [ROUNDS]
set -u
OUT=${1:?out dir}
ROUNDS=${2:-1}
export PYTHONUNBUFFERED=1
SECONDS=0
D=benchmarks/results/decode/moe_schedule
nvidia-smi --query-gpu=name --format=csv,noheader
[ "${TESTS:-1}" = 1 ] && timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_model.py \
  tests/test_layer_graphs.py -k "${TESTS_K:-moe or model or graph}" > $OUT/gpu_tests.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | tail -12
echo "tests: ${SECONDS}s"
[ "${MICRO:-1}" = 1 ] && timeout 150 python3 $D/moe_schedule.py $OUT/moe_schedule.json | tee $OUT/moe_schedule.txt | grep -v " r[12] " 
echo "microbench: ${SECONDS}s"
for i in $(seq 1 "$ROUNDS"); do
  for sched in ${LAYER_VARIANTS:-two fused pdl}; do
    s=${LAYER_FORMAT:-nvfp4}_${sched}
    timeout 100 python3 -c "import runpy, sys; from dsv4lab.kernels import moe_decode_tma as m
m.SCHEDULE = '$sched'
sys.argv = ['benchmarks/decode.py', '--json', '$OUT/layer_${s}_$i.json', '--steps', '64', '--skip-tiny', '--layer-modes', 'kernels', '--format', '${LAYER_FORMAT:-nvfp4}']
runpy.run_path('benchmarks/decode.py', run_name='__main__')" > /dev/null 2>&1
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['layer_type'][:5], round(r['graph_ms'] * 1e3, 1), r['kernels_per_step']) for r in d['v4_pro_layer']])" \
      "$OUT/layer_${s}_$i.json" "$s $i"
  done
done
echo "done: ${SECONDS}s"
