#!/usr/bin/env bash
# The attention kernels walking the selected slots only up to each row's last valid one
# (common.selected_extent), on one device machine: their GPU tests, then old (.base: dsv4lab/ +
# benchmarks/ at the commit before) and new code: the prefill attention kernel at a prompt's first
# 4k chunk (csa_first) and at 64k (csa, every slot valid: no change expected), default tiles, and
# the full-depth V4-Pro-shaped model (4k prefill, decode).
# Usage (device tool, carry .base): bash benchmarks/results/prefill/selected_extent_ab.sh $OUT
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
[ -e .base/data ] || ln -s ../data .base/data
cp benchmarks/prefill_attention.py .base/benchmarks/   # the csa_first shape, on the old kernel
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 -m pytest -m gpu tests/test_attention_kernel.py tests/test_attention_decode_kernel.py -q \
  -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
for root in .base .; do
  echo "== prefill attention $root"
  timeout 120 python3 $root/benchmarks/prefill_attention.py --shapes csa_first,csa --tiles 17:18 \
    --json $OUT/prefill_attention_$( [ $root = . ] && echo new || echo old ).json 2>&1 | tail -2
done
for root in .base .; do
  v=$( [ $root = . ] && echo new || echo old )
  timeout 200 python3 $root/benchmarks/full_model.py --preset v4-pro --experts 8 --gpus 1 --context 4096 \
    --steps 16 --prefill-iters 2 --json $OUT/full_model_$v.json > $OUT/full_model_$v.log 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], {k: round(d[k], 3) for k in ('prefill_tok_s', 'prefill_over_compute_floor', 'graph_ms', 'graph_over_floor', 'eager_ms', 'floor_ms')})" $OUT/full_model_$v.json $v
done
