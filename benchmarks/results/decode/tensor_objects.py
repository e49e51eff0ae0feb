"""Tensor objects one eager decode step of a V4-Pro layer makes on the CPU stub (launches stubbed,
as ``eager_layer.py --cpu-stub --stub-bf16``), counted by cProfile: the allocating and viewing
torch calls, and all Python calls. Deterministic, so old and new code compare exactly where host
time on a shared machine does not. Usage: python benchmarks/results/decode/tensor_objects.py [ROOT]"""
import cProfile, json, pstats, sys
import depth_util
depth_util.use_root(sys.argv)
import torch

MAKERS = ("empty", "new_empty", "empty_like", "reshape", "view", "unsqueeze", "squeeze", "flatten", "split",
          "contiguous", "to", "__getitem__", "as_strided", "select", "narrow", "expand", "stack", "zeros")
torch.set_num_threads(1)
out = {}
for key in ("csa", "hca"):
    with depth_util.stub_layer(key) as step:
        for _ in range(3):
            step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            step()
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
