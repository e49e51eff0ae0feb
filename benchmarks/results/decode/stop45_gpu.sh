#!/usr/bin/env bash
# Stop 45's decode folds on one short device call: the GPU tests of the touched kernels, then one
# V4-Pro layer's graph step (decode.py, 384 experts) with the q fold declared (.qfold: this tree plus
# ``decode_attention.ropes_q_with = norm_rope``) and without (this tree), alternating.
# Usage (device tool, carry .qfold): bash benchmarks/results/decode/stop45_gpu.sh $OUT
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
[ -e .qfold/data ] || ln -s ../data .qfold/data
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s INT 130 python3 -m pytest -m gpu tests/test_attention_decode_kernel.py tests/test_glue_kernels.py \
  "tests/test_mhc_kernel.py::test_gpu_hc_pre_post_v4_pro_shapes" tests/test_kernels_model.py::test_gpu_load_auto_installs_kernels \
  -q -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | tail -12
for run in .qfold:1 .:1 .qfold:2; do
  root=${run%:*}; i=${run#*:}
  v=$( [ $root = . ] && echo new || echo qfold )
  (cd $root && timeout 60 python3 benchmarks/decode.py --json $OUT/layer_${v}_$i.json --steps 64 --skip-tiny \
    --layer-modes kernels > /dev/null 2>&1)
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['layer_type'][:5], round(r['graph_ms'] * 1e3, 1), r['kernels_per_step']) for r in d['v4_pro_layer']])" $OUT/layer_${v}_$i.json "$v $i"
done
