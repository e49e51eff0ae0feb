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
. "$(dirname "$0")/ab_layers.sh"
ab_layers 2 120 $OUT
