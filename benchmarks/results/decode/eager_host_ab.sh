#!/usr/bin/env bash
# Old code (.base: a copy of dsv4lab/ + benchmarks/ at the commit compared against: d9ba98f for the
# PDL runs, d20f72a for stop 41's launch cuts), new code, and new code without PDL
# (DSV4LAB_PDL=0) on one device machine: full-depth V4-Pro (8 experts) eager / graph decode, then
# the embedded model's decode (old and new; AB_TINY=0 skips it).
# Usage (device tool, carry .base): bash benchmarks/results/decode/eager_host_ab.sh $OUT
# .base, here first: echo /.base/ >> .git/info/exclude; mkdir .base; git archive <commit> dsv4lab benchmarks | tar -x -C .base
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
full() {  # full <label> <root> [env...]
  local label=$1 root=$2; shift 2
  echo "== full depth $label"
  env "$@" timeout 90 python3 $root/benchmarks/full_model.py --preset v4-pro --experts 8 --gpus 1 --context 4096 \
    --steps 16 --prefill-iters 1 --json $OUT/fm_$label.json 2>&1 | grep -E '"(eager_ms|graph_ms|graph_over_floor|kernels_per_step|prefill_tok_s)"'
}
full new1 .
full nopdl1 . DSV4LAB_PDL=0
full base1 .base
[ "${AB_REPEAT:-0}" = 1 ] && { full base2 .base; full new2 .; }
[ "${AB_TINY:-1}" = 1 ] && for v in base new; do
  root=.; [ $v = base ] && root=.base
  echo "== embedded $v"
  timeout 50 python3 $root/benchmarks/decode.py --steps 128 --layer-modes "" --json $OUT/tiny_${v}.json 2>&1 | tail -4
done
