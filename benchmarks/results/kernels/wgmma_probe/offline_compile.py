"""Offline sm_90a compile of the Gluon W4A16 GEMM (no GPU): registers, spills, shared memory per
V4-Pro shape at M = 128. Run with a python whose triton matches the device's (3.6):

    python benchmarks/results/kernels/wgmma_probe/offline_compile.py
"""
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))


class StandInDriver:  # what JITFunction.run asks of the driver, for a GPU that is not here
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_active_torch_device(self): return torch.device("cpu")


triton.runtime.driver.set_active(StandInDriver())
from dsv4lab.kernels import linear_gemm_wgmma as g  # noqa: E402

kernels = []
_run = g._wgmma_gemm_kernel.run


def run(*args, grid, warmup, **kw):
    k = _run(*args, grid=grid, warmup=True, **kw)
    kernels.append(k)
    return k


g._wgmma_gemm_kernel.run = run
g.num_sms = lambda device: 132
orig_cuda = torch.Tensor.is_cuda
SHAPES = [("q_a", 7168, 1536), ("q_b", 1536, 65536), ("o_b", 16384, 7168), ("w13", 7168, 3072), ("w2", 3072, 7168)]
M = int(sys.argv[1]) if len(sys.argv) > 1 else 128
for fmt in ("nvfp4", "mxfp4"):
    for name, K, N in SHAPES:
        x = torch.zeros(M, K, dtype=torch.bfloat16)
        p = torch.zeros(N, K // 2, dtype=torch.uint8)
        s = torch.zeros(N, K // (16 if fmt == "nvfp4" else 32), dtype=torch.uint8)
        y = torch.empty(M, N, dtype=torch.bfloat16)
        g.launch_wgmma_gemm(x, fmt, p, s, torch.ones(1), y)
        k = kernels[-1]
        md = k.metadata
        print(f"{fmt:6s} {name:4s} regs={k.n_regs if hasattr(k, 'n_regs') else '?'} spills={getattr(k, 'n_spills', '?')} "
              f"shared={md.shared} warps={md.num_warps}")
        if name == "q_a" and fmt == "nvfp4":
            Path("/tmp/wgmma_q_a.ptx").write_text(k.asm["ptx"])
