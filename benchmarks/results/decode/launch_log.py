"""The launches of one eager decode step of a V4-Pro layer (CSA and HCA) on the CPU stub
(``host_overhead.stubbed_launches``), each argument normalised so that two trees' logs compare: a
tensor by (element count, dtype, which buffer: the order its address first appeared in the step),
a TMA descriptor by its base that way and its geometry, scalars as they are. Host-side refactors
that must not change what runs on the GPU diff equal:
    python benchmarks/results/decode/launch_log.py .base > /tmp/old.json
    python benchmarks/results/decode/launch_log.py . > /tmp/new.json && diff /tmp/old.json /tmp/new.json"""
import contextlib, json, os, sys
from unittest import mock
root = sys.argv[1] if len(sys.argv) > 1 else "."
sys.path.insert(0, root); sys.path.insert(0, root + "/benchmarks")
import torch
import torch.nn.functional as F
import host_overhead
import launch_inventory as inventory
from dsv4lab.kernels.install import install_kernels
from dsv4lab.model.state import DecodeState
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
    dev = torch.device("cpu")
    layer, cfg, _ = inventory.build(inventory.LAYERS[key], dev, 8)
    st = DecodeState.allocate(cfg, 1, 4096, torch.bfloat16, dev)
    h = torch.randn(1, 1, cfg.hc_mult, cfg.hidden_size, dtype=torch.bfloat16)
    ids = torch.zeros(1, 1, dtype=torch.long)
    st.pos_on(dev).fill_(1000)
    log: list = []
    with contextlib.ExitStack() as s:
        s.enter_context(torch.no_grad())
        s.enter_context(mock.patch.dict(os.environ, {"DSV4LAB_KERNEL_VERIFY": "0"}))
        s.enter_context(host_overhead.stubbed_launches(log))
        s.enter_context(inventory._cpu_install_allowed())
        s.enter_context(mock.patch.object(F, "linear", lambda x, w, b=None: x.new_empty(*x.shape[:-1], w.shape[0])))
        install_kernels(layer)
        for m in layer.modules():
            if hasattr(m, "kernel_devices"):
                m.kernel_devices = ("cuda", "cpu")
        pos = st.pos_on(dev)
        for _ in range(3):
            log.clear()
            layer.decode(h, ids, pos, st.layers[0])
    out[key] = normalise(log)
print(json.dumps(out, indent=0))
