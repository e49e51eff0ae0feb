#!/usr/bin/env bash
# Stop 56 on the H200: full depth (61 layers, 8 experts, 4k) one process per setting
# "post_pre gate_route pdl moe": the joins each alone / together / neither (why was eager slower with
# both on the H200's host at stop 55?), PDL off, and the NVFP4 MoE decode fused with 128-row down
# tiles (graph <= 2x the floor?). Each line: eager ms, host_op_us, graph ms, x floor, launches a step
# on the normal path by kernel. Usage: bash .../stop56/decode_ab.sh $OUT [first config index]
# (STOP_AT=seconds: start no config after that, default 500: a call's limit less ~100)
set -u
OUT=${1:?out dir}
FIRST=${2:-0}
D=$(dirname "$0")
export PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $OUT/gpu.txt
CFGS=("1 1 1 default" "1 1 1 fused128" "0 0 1 default" "0 0 1 fused128" "1 0 1 default" "0 1 1 default"
      "1 1 1 fused128" "1 1 1 default" "1 1 0 default" "0 0 0 default")
for ((i = FIRST; i < ${#CFGS[@]}; i++)); do
  [ $SECONDS -gt ${STOP_AT:-500} ] && { echo "stopped before config $i"; break; }
  set -- ${CFGS[$i]}
  tag=${i}_pp$1_gr$2_pdl$3_$4
  DSV4LAB_HC_POST_PRE=$1 DSV4LAB_GATE_ROUTE=$2 DSV4LAB_PDL=$3 timeout 110 python3 $D/moe_variant.py $4 --preset v4-pro \
    --experts 8 --gpus 1 --context 4096 --steps 32 --prefill-iters 1 --json $OUT/full_model_$tag.json \
    > $OUT/full_model_$tag.txt 2>&1
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1])); e = d['decode']
print(sys.argv[2], 'eager', round(d['eager_ms'], 1), 'host_op_us', round(d['host_op_us'], 2), 'graph',
      round(d['graph_ms'], 2), 'x', round(d['graph_over_floor'], 3), 'kernels', d['kernels_per_step'],
      'normal/step', round(e['eager_normal_launches_per_step'], 1), dict(list(e['eager_normal_by_kernel'].items())[:6]))" \
    $OUT/full_model_$tag.json "$tag" 2>&1 | tail -1
done
echo "done: ${SECONDS}s"
