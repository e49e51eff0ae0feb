#!/usr/bin/env bash
# The Gluon grouped MoE prefill GEMMs (dsv4lab/kernels/moe_prefill_wgmma.py) on one GPU: their GPU
# tests and the other MoE prefill / Gluon GEMM tests, then benchmarks/gemm.py's MoE rows at V4-Pro's
# 384 experts, 4096 tokens top-6 (Triton grouped, dense, Gluon at 64 / 128 / mixed rows a tile, A
# through shared memory or in registers, each checked against the reference), then the dense Gluon
# GEMM's probe at M = $2 (default 64,128,256; "none": skipped) if time is left.
# Usage: bash benchmarks/results/kernels/moe_wgmma/run.sh $OUT   (carry .whl: pytest wheels)
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pytest --version > /dev/null 2>&1 || pip install -q --no-index .whl/*.whl > /dev/null 2>&1
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_moe_prefill_wgmma.py tests/test_gemm_wgmma.py \
  tests/test_gemm.py -k "moe or wgmma" > $OUT/gpu_tests.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|Error" $OUT/gpu_tests.txt | tail -14
echo "tests: ${SECONDS}s"
timeout 300 python3 benchmarks/gemm.py --shapes w1/w3 --m 128 --formats nvfp4,mxfp4 --experts 384 --tokens 4096 \
  --json $OUT/moe_prefill_384.json 2>&1 | grep -v "^RESULT" | cut -c1-900 | tee $OUT/moe_prefill_384.txt
echo "moe: ${SECONDS}s"
if [ "${2:-}" != "none" ] && [ $SECONDS -lt 400 ]; then
  timeout $((580 - SECONDS)) python3 benchmarks/results/kernels/wgmma_probe/wgmma_probe.py $OUT/wgmma_probe.json \
    ${2:-64,128,256} rule 2>&1 | grep -v "^\s*$" | tee $OUT/wgmma_probe.txt
fi
echo "done: ${SECONDS}s"
