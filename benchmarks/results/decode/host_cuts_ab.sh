#!/usr/bin/env bash
# Stop 42's eager host cuts on one device machine: the GPU tests (CuTeDSL / notebook files need
# cutlass / nbformat: not collected), then old (.base: dsv4lab/ + benchmarks/ at the commit before)
# and new code alternating: full-depth V4-Pro eager decode (full_eager_ab.py) and the embedded model.
# Usage (device tool, carry .base): bash benchmarks/results/decode/host_cuts_ab.sh $OUT
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
[ -e .base/data ] || ln -s ../data .base/data   # the old tree's decode.py loads data/tiny-dsv4 from its root
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${TEST_S:-420} python3 -m pytest -m gpu tests -q -p no:cacheprovider --ignore=tests/test_cute_kernels.py \
  --ignore=tests/test_notebook_sources.py --ignore=tests/test_notebooks.py 2>&1 | tail -6 | tee $OUT/gpu_tests.txt
for i in 1 2; do
  for root in .base .; do
    timeout 80 python3 benchmarks/results/decode/full_eager_ab.py $root 5 20 2>&1 | tail -1 | tee -a $OUT/full_eager_ab.jsonl
  done
done
for v in base new base new; do
  root=.; [ $v = base ] && root=.base
  echo "== embedded $v"
  timeout 50 python3 $root/benchmarks/decode.py --steps 128 --layer-modes "" --json $OUT/tiny_$v.json 2>&1 | tail -3
done
