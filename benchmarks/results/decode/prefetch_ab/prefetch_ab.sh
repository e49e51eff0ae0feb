#!/usr/bin/env bash
# Runs on branch l2-prefetch (4a74822): the prefetch and early-trigger switches exist only there.
# The TMA GEMV's L2 prefetch before its PDL wait (common.PREFETCH_BYTES, DSV4LAB_PREFETCH_MB) and the
# early trigger (DSV4LAB_GEMV_EARLY_TRIGGER): the GEMV GPU tests, then one V4-Pro layer's graph step
# (decode.py, 384 experts) per variant, alternating, and the hc_pre probe.
# Usage (device tool): bash benchmarks/results/decode/prefetch_ab.sh $OUT
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -m gpu tests/test_kernels.py tests/test_host_overhead.py tests/test_mhc_kernel.py -k "tma or gemv or linear or mhc or hc_" -q \
  -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/gpu_tests.txt
timeout 100 python3 benchmarks/results/decode/hc_pre_probe.py $OUT/hc_pre_probe.json 2>&1 | tail -16
n=0
for v in "0 0" "16 0" "16 1" "48 1" "0 0"; do
  set -- $v
  n=$((n + 1))
  f=$OUT/layer_${n}_pf$1_et$2.json
  DSV4LAB_PREFETCH_MB=$1 DSV4LAB_GEMV_EARLY_TRIGGER=$2 timeout 120 python3 benchmarks/decode.py \
    --json $f --steps 64 --skip-tiny --layer-modes kernels > /dev/null 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['layer_type'][:5], round(r['graph_ms'] * 1e3, 1), round(r['eager_ms'] * 1e3)) for r in d['v4_pro_layer']])" \
    $f "prefetch_MB=$1 early=$2 (run $n)"
done
