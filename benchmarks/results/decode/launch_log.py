"""The launches of one eager decode step of a V4-Pro layer (CSA and HCA) on the CPU stub
(``host_overhead.stubbed_launches``), each argument normalised so that two trees' logs compare: a
tensor by (element count, dtype, which buffer: the order its address first appeared in the step),
a TMA descriptor by its base that way and its geometry, scalars as they are. Host-side refactors
that must not change what runs on the GPU diff equal:
    python benchmarks/results/decode/launch_log.py .base > /tmp/old.json
    python benchmarks/results/decode/launch_log.py . > /tmp/new.json && diff /tmp/old.json /tmp/new.json"""
import json, sys
import depth_util
depth_util.use_root(sys.argv)
import torch
from triton.tools.tensor_descriptor import TensorDescriptor


def normalise(log):
    ids: dict = {}

    def buf(t):
        return ids.setdefault(t.data_ptr(), len(ids))

    def norm(v):
        if isinstance(v, torch.Tensor):
            return ["T", v.numel(), str(v.dtype), buf(v)]
        if isinstance(v, TensorDescriptor):
            return ["D", norm(v.base), list(v.shape), list(v.strides), list(v.block_shape)]
        if isinstance(v, (int, float, bool, str)) or v is None:
            return v
        return repr(type(v))
    return [[name, list(grid) if isinstance(grid, tuple) else repr(grid), [norm(a) for a in args],
             {k: norm(v) for k, v in sorted(kw.items())}] for name, grid, args, kw in log]


out = {}
torch.manual_seed(0)
for key in ("csa", "hca"):
    log: list = []
    with depth_util.stub_layer(key, log) as step:
        for _ in range(3):
            log.clear()
            step()
    out[key] = normalise(log)
print(json.dumps(out, indent=0))
