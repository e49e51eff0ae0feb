#!/usr/bin/env bash
# The Gluon W4A16 GEMM on one GPU: its GPU tests, then the probe against the Triton GEMM and cuBLAS
# BF16 (M list in $2, default 128; $3 = rule: no variants).
# Usage: bash benchmarks/results/kernels/wgmma_probe/run.sh $OUT [M,M] [rule]
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pytest --version > /dev/null 2>&1 || pip install -q --no-index .whl/*.whl > /dev/null 2>&1
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gemm_wgmma.py tests/test_gemm.py -k "wgmma or (v4_pro and 128)" > $OUT/gpu_tests.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|Error" $OUT/gpu_tests.txt | tail -12
echo "tests: ${SECONDS}s"
timeout 360 python3 benchmarks/results/kernels/wgmma_probe/wgmma_probe.py $OUT/wgmma_probe.json ${2:-128} ${3:-} 2>&1 | grep -v "^\s*$" | tee $OUT/wgmma_probe.txt
echo "probe: ${SECONDS}s"
