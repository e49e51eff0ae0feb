#!/usr/bin/env bash
# Stop 46: the norm fold's one-row finish (the collapsed row normalised in registers, the weight
# loaded first): the mHC GPU tests, then main (.base) and this tree alternating, one V4-Pro layer's
# graph step each. Usage (carry .base = main): bash benchmarks/results/decode/stop46_norm_fold/run_one_row.sh $OUT
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
[ -e .base/data ] || ln -s ../data .base/data
nvidia-smi --query-gpu=name --format=csv,noheader
SECONDS=0
timeout -s INT 120 python3 -m pytest -m gpu tests/test_mhc_kernel.py tests/test_layer_graphs.py -q -p no:cacheprovider \
  > $OUT/gpu_tests.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | tail -8
echo "tests: ${SECONDS}s"
. "$(dirname "$0")/../ab_layers.sh"
ab_layers ${ROUNDS:-2} 100 $OUT
echo "done: ${SECONDS}s"
