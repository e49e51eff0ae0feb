"""The Gluon W4A16 GEMM (dsv4lab/kernels/linear_gemm_wgmma.py) compiled for sm_90a on a machine
without a GPU (a stand-in driver, the installed triton's Gluon and its bundled ptxas), run by
tests/test_gemm_wgmma.py in a subprocess (the driver swap stays out of the test process). Prints
one line ``RESULT{json}``: per case the shared memory, ptxas's registers, spill bytes and whether it
serialised the async wgmmas (warning C7515: the overlap this kernel exists for, lost).
"""
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class StandInDriver:  # what JITFunction.run asks of the driver, for an sm_90 GPU that is not here
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_active_torch_device(self): return torch.device("cpu")


triton.runtime.driver.set_active(StandInDriver())
from dsv4lab.kernels import linear_gemm_wgmma as g  # noqa: E402
from dsv4lab.kernels import moe_prefill_wgmma as mg  # noqa: E402
from dsv4lab.kernels.moe_prefill import expert_schedule  # noqa: E402
from dsv4lab.quant.stacked import StackedMXFP4, StackedNVFP4  # noqa: E402

compiled = []


def _warmup_only(run):
    def go(*args, grid, warmup, **kw):
        compiled.append(run(*args, grid=grid, warmup=True, **kw))
    return go


g._wgmma_gemm_kernel.run = _warmup_only(g._wgmma_gemm_kernel.run)
mg._grouped_wgmma_kernel.run = _warmup_only(mg._grouped_wgmma_kernel.run)
g.num_sms = lambda device: 132
PTXAS = get_ptxas(90).path  # the ptxas this triton compiles sm_90 with (its PTX version)
# name: (format, M, K, N, config override): V4-Pro's o_b (split K) and w1/w3, both formats, 64 / 128 /
# 256 tokens, fp16 x
CASES = {"nvfp4_o_b_m128": ("nvfp4", 128, 16384, 7168, None, torch.bfloat16),
         "mxfp4_w13_m128": ("mxfp4", 128, 7168, 3072, None, torch.bfloat16),
         "nvfp4_q_a_m64": ("nvfp4", 64, 7168, 1536, None, torch.bfloat16),
         "nvfp4_w2_m256_f16": ("nvfp4", 256, 3072, 7168, None, torch.float16),
         "nvfp4_o_b_one_split": ("nvfp4", 128, 16384, 7168, {"SPLIT": 1}, torch.bfloat16)}
# the grouped MoE prefill GEMMs (moe_prefill_wgmma) at V4-Pro's expert shapes: name: (format,
# rows a tile, K, N, up (w1 + w3, SwiGLU, routing weight) or down, x dtype)
GROUPED = {"grouped_nvfp4_up_bm128": ("nvfp4", 128, 7168, 3072, True, torch.bfloat16, True),
           "grouped_mxfp4_up_bm64": ("mxfp4", 64, 7168, 3072, True, torch.bfloat16, True),
           "grouped_nvfp4_down_bm128_f16": ("nvfp4", 128, 3072, 7168, False, torch.float16, True),
           "grouped_nvfp4_up_bm128_smem_a": ("nvfp4", 128, 7168, 3072, True, torch.bfloat16, False)}


def _stack(fmt: str, E: int, N: int, K: int):
    p = torch.zeros(E, N, K // 2, dtype=torch.uint8)
    if fmt == "nvfp4":
        return StackedNVFP4(p, torch.zeros(E, N, K // 16, dtype=torch.float8_e4m3fn), torch.ones(E))
    return StackedMXFP4(p, torch.zeros(E, N, K // 32, dtype=torch.uint8))


def _launch(name: str) -> None:
    if name in CASES:
        fmt, M, K, N, cfg, dt = CASES[name]
        x = torch.zeros(M, K, dtype=dt)
        p = torch.zeros(N, K // 2, dtype=torch.uint8)
        s = torch.zeros(N, K // (16 if fmt == "nvfp4" else 32), dtype=torch.uint8)
        g.launch_wgmma_gemm(x, fmt, p, s, torch.ones(1), torch.empty(M, N, dtype=dt), cfg)
        return
    fmt, bm, K, N, up, dt, frag = GROUPED[name]
    E, T, k = 4, 96, 2
    sched = expert_schedule(torch.arange(T * k).reshape(T, k) % E, E, bm)
    w = _stack(fmt, E, N, K)
    mg.grouped_wgmma(torch.zeros(T * k, K, dtype=dt), sched, bm, w, _stack(fmt, E, N, K) if up else None,
                     10.0 if up else None, torch.ones(T * k) if up else None, frag)


res = {}
for name in [*CASES, *GROUPED]:
    _launch(name)
    k = compiled[-1]
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_text(k.asm["ptx"])
        r = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", str(Path(d) / "k.ptx"), "-o", str(Path(d) / "k.cubin")],
                           capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    loop = k.asm["ptx"]  # shared-memory stores: the A operand's round trip (none in fragment order but the epilogue's)
    res[name] = {"st_shared": loop.count("st.shared"), "ptxas_rc": r.returncode, "shared": k.metadata.shared, "registers": int(regs.group(1)) if regs else None,
                 "spill_bytes": int(spill.group(1)) if spill else None, "serialized": "C7515" in r.stderr,
                 "wgmma": k.asm["ptx"].count("wgmma.mma_async"), "ptxas_err": r.stderr[-300:] if r.returncode else ""}
print("RESULT" + json.dumps(res))
