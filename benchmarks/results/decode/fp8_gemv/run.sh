#!/usr/bin/env bash
# The FP8-block decode GEMV (stop 48), on one GPU: its GPU tests, the microbench against the tiled
# kernel (SWEEP=1: tile variants too), then the official-format V4-Pro layer and full depth (8
# experts, 4k context). Usage: bash benchmarks/results/decode/fp8_gemv/run.sh $OUT
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_gemv.py tests/test_kernels.py \
  tests/test_kernels_model.py -k "fp8 or official or grouped" > $OUT/gpu_tests.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | tail -12
echo "tests: ${SECONDS}s"
timeout 300 python3 benchmarks/fp8_gemv.py --json $OUT/fp8_gemv.json $([ "${SWEEP:-0}" = 1 ] && echo --sweep) | tee $OUT/fp8_gemv.txt
echo "microbench: ${SECONDS}s"
timeout 150 python3 benchmarks/decode.py --json $OUT/layer_official.json --steps 64 --skip-tiny --layer-modes kernels \
  --format official > $OUT/layer_official.txt 2>&1
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(r['layer_type'][:5], round(r['graph_ms']*1e3,1), round(r['floor_ms']*1e3,1), r['kernels_per_step'], round(r['eager_ms'], 2), r.get('top_kernels_us')) for r in d['v4_pro_layer']]" $OUT/layer_official.json
echo "layer: ${SECONDS}s"
[ "${FULL:-1}" = 1 ] && timeout 200 python3 benchmarks/full_model.py --preset v4-pro --format official --experts 8 --gpus 1 \
  --context 4096 --steps 32 --prefill-iters 1 --json $OUT/full_official.json > $OUT/full_official.txt 2>&1
[ "${FULL:-1}" = 1 ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('floor_ms', 'graph_ms', 'graph_over_floor', 'eager_ms', 'host_op_us', 'kernels_per_step')})" $OUT/full_official.json
echo "done: ${SECONDS}s"
