#!/usr/bin/env bash
# Why was eager full depth slower with both decode joins on the H200's host (stop 55: 102.8 / 115.3 ->
# 129.5 / 140.8 ms, two rounds), when the CPU stub has the joined layers cheaper on the host? One
# process per setting (neither, each join alone, both; then both / neither with PDL off, since the
# H200 delta was ~26 ms in both rounds whatever the host speed: a wait, not Python?), two rounds in
# swapped order; each prints
# eager ms, host_op_us and the launches a step that missed the direct path, by kernel
# (decode.eager_normal_by_kernel: each costs Triton's Python launcher on the host).
# Usage (device tool): bash benchmarks/results/decode/stop55/eager_joins.sh $OUT
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for cfg in "0 0 1" "1 1 1" "1 0 1" "0 1 1" "1 1 1" "0 0 1" "1 1 0" "0 0 0"; do
  [ $SECONDS -gt 520 ] && break
  set -- $cfg
  tag=pp$1_gr$2_pdl$3_$SECONDS
  DSV4LAB_HC_POST_PRE=$1 DSV4LAB_GATE_ROUTE=$2 DSV4LAB_PDL=$3 timeout 100 python3 benchmarks/full_model.py --preset v4-pro --experts 8 \
    --gpus 1 --context 4096 --steps 32 --prefill-iters 1 --json $OUT/full_model_$tag.json > $OUT/full_model_$tag.txt 2>&1
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1])); e = d['decode']
print(sys.argv[2], 'eager', round(d['eager_ms'], 1), 'host_op_us', round(d['host_op_us'], 2), 'graph', round(d['graph_ms'], 2),
      'normal/step', round(e['eager_normal_launches_per_step'], 1), dict(list(e['eager_normal_by_kernel'].items())[:6]))" \
    $OUT/full_model_$tag.json "$tag" 2>&1 | tail -1
done
echo "done: ${SECONDS}s"
