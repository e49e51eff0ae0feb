"""Tensor objects one eager decode step of a V4-Pro layer makes on the CPU stub (launches stubbed,
as ``eager_layer.py --cpu-stub --stub-bf16``), counted by cProfile: the allocating and viewing
torch calls, and all Python calls. Deterministic, so old and new code compare exactly where host
time on a shared machine does not. Usage: python benchmarks/results/decode/tensor_objects.py [ROOT]"""
import contextlib, cProfile, json, os, pstats, sys
from unittest import mock
root = sys.argv[1] if len(sys.argv) > 1 else "."
sys.path.insert(0, root); sys.path.insert(0, root + "/benchmarks")
import torch
import torch.nn.functional as F
import launch_inventory as inventory
from dsv4lab.kernels.install import install_kernels
from dsv4lab.model.state import DecodeState

MAKERS = ("empty", "new_empty", "empty_like", "reshape", "view", "unsqueeze", "squeeze", "flatten", "split",
          "contiguous", "to", "__getitem__", "as_strided", "select", "narrow", "expand", "stack", "zeros")
torch.set_num_threads(1)
out = {}
for key in ("csa", "hca"):
    dev = torch.device("cpu")
    layer, cfg, _ = inventory.build(inventory.LAYERS[key], dev, 8)
    st = DecodeState.allocate(cfg, 1, 4096, torch.bfloat16, dev)
    h = torch.randn(1, 1, cfg.hc_mult, cfg.hidden_size, dtype=torch.bfloat16)
    ids = torch.zeros(1, 1, dtype=torch.long)
    st.pos_on(dev).fill_(1000)
    with contextlib.ExitStack() as s:
        s.enter_context(torch.no_grad())
        s.enter_context(mock.patch.dict(os.environ, {"DSV4LAB_KERNEL_VERIFY": "0"}))
        s.enter_context(inventory.counted_launches(lambda: "?", [], True))
        s.enter_context(inventory._cpu_install_allowed())
        s.enter_context(mock.patch.object(F, "linear", lambda x, w, b=None: x.new_empty(*x.shape[:-1], w.shape[0])))
        install_kernels(layer)
        for m in layer.modules():
            if hasattr(m, "kernel_devices"):
                m.kernel_devices = ("cuda", "cpu")
        pos = st.pos_on(dev)
        for _ in range(3):
            layer.decode(h, ids, pos, st.layers[0])
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            layer.decode(h, ids, pos, st.layers[0])
        prof.disable()
    stats = pstats.Stats(prof).stats
    per = {}
    for (file, line, name), (cc, nc, tt, ct, callers) in stats.items():
        for mk in MAKERS:
            if name in (f"<built-in method torch.{mk}>", f"<method '{mk}' of 'torch._C.TensorBase' objects>"):
                per[mk] = per.get(mk, 0) + nc / 10
    out[key] = {"python_and_c_calls": pstats.Stats(prof).total_calls / 10, "tensor_calls": per,
                "tensor_calls_total": sum(per.values())}
print(json.dumps(out, indent=1))
