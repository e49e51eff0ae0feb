#!/usr/bin/env bash
# Old (.base: a copy of dsv4lab/ + benchmarks/ at the commit before) and new code alternating on one
# device machine: full-depth V4-Pro (8 experts) eager / graph decode, and the embedded model's decode.
# Usage (device tool, carry .base): bash benchmarks/results/decode/eager_host_ab.sh $OUT
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
for rep in 1 2; do
  for v in base new; do
    root=.; [ $v = base ] && root=.base
    echo "== full depth $v $rep"
    timeout 95 python3 $root/benchmarks/full_model.py --preset v4-pro --experts 8 --gpus 1 --context 4096 \
      --steps 16 --prefill-iters 1 --json $OUT/fm_${v}_$rep.json 2>&1 | grep -E '"(eager_ms|graph_ms|graph_over_floor|capture_s|floor_ms)"'
  done
done
echo "== one V4-Pro layer, kernels (graph ms, kernels a step)"
timeout 110 python3 benchmarks/decode.py --steps 64 --skip-tiny --layer-modes kernels --json $OUT/layer_new.json 2>&1 | tail -12
for v in base new; do
  root=.; [ $v = base ] && root=.base
  echo "== embedded $v"
  timeout 60 python3 $root/benchmarks/decode.py --steps 128 --layer-modes "" --json $OUT/tiny_${v}.json 2>&1 | grep -iE "median|step|eager|graph" | head -6
done
