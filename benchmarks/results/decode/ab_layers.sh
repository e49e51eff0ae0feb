# Sourced by the decode A/B scripts here. ab_layers ROUNDS TIMEOUT OUT: ROUNDS alternations of main
# (.base) and this tree, one V4-Pro layer's graph step each (benchmarks/decode.py, 384 experts) into
# OUT/layer_{old,new}_i.json, one line each: (layer type, graph us, kernels a step).
ab_layers() {
  local rounds=$1 limit=$2 out=$3 i root v
  for i in $(seq 1 "$rounds"); do
    for root in .base .; do
      v=$( [ $root = . ] && echo new || echo old )
      (cd $root && timeout "$limit" python3 benchmarks/decode.py --json "$out/layer_${v}_$i.json" --steps 64 \
        --skip-tiny --layer-modes kernels > /dev/null 2>&1)
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['layer_type'][:5], round(r['graph_ms'] * 1e3, 1), r['kernels_per_step']) for r in d['v4_pro_layer']])" \
        "$out/layer_${v}_$i.json" "$v $i"
    done
  done
}
