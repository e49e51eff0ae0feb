#!/usr/bin/env bash
# Stop 45, H200: main (.base) against the deferred Sinkhorn + the wq_a/wkv GEMV pair + q_norm/kv as one
# launch + the inverse RoPE in the combine (this tree at ac22bb5 less the q fold, which it predates):
# the GPU tests of the touched modules, then 3 alternating runs of one V4-Pro layer's graph step.
# Usage (device tool, carry .base = main a944187): bash benchmarks/results/decode/stop45_ab/run.sh $OUT
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
[ -e .base/data ] || ln -s ../data .base/data
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 -m pytest -m gpu tests/test_mhc_kernel.py tests/test_kernels.py tests/test_kernels_model.py \
  tests/test_linear_plain.py tests/test_layer_graphs.py tests/test_indexer_topk.py tests/test_glue_kernels.py tests/test_attention_decode_kernel.py -q -p no:cacheprovider 2>&1 \
  | grep -E "passed|failed|Error|FAILED" | tail -12 | tee $OUT/gpu_tests.txt
. "$(dirname "$0")/../ab_layers.sh"
ab_layers 3 120 $OUT
