#!/usr/bin/env bash
# The FP8 GEMV's tile rule in the official V4-Pro layer, alternating on one GPU: "w4" = 64 rows,
# 4 stages, 4 warps, K split to ~2 waves (the first rule), "w8" = 64 rows, 5 stages, 8 warps, one
# wave (the microbench sweep's). Usage: bash benchmarks/results/decode/fp8_gemv/config_ab.sh $OUT [ROUNDS]
set -u
OUT=${1:?out dir}
ROUNDS=${2:-2}
nvidia-smi --query-gpu=name --format=csv,noheader
for i in $(seq 1 "$ROUNDS"); do
  for v in w4 w8; do
    timeout 120 python3 -c "import runpy, sys
from dsv4lab.kernels import linear_fp8_tma as m
base = m.fp8_tma_config
def rule(N, K, device, rows_per_x=0):
    c = base(N, K, device, rows_per_x)
    if '$v' == 'w4':
        tiles = m.cdiv(N, c['BN'])
        c.update(STAGES=4, num_warps=4, SPLIT=max(1, min(m.cdiv(2 * m.num_sms(device), tiles), K // 256, 64)))
        c['PDL'] = tiles * c['SPLIT'] <= 3 * m.num_sms(device) or c['SPLIT'] > 1
    return c
m.fp8_tma_config = rule
sys.argv = ['benchmarks/decode.py', '--json', '$OUT/ab_${v}_$i.json', '--steps', '64', '--skip-tiny', '--layer-modes', 'kernels', '--format', 'official']
runpy.run_path('benchmarks/decode.py', run_name='__main__')" > /dev/null 2>&1
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['layer_type'][:5], round(r['graph_ms'] * 1e3, 1)) for r in d['v4_pro_layer']])" "$OUT/ab_${v}_$i.json" "$v $i"
  done
done
