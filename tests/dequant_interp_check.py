"""The large-M prefill tier (dsv4lab.kernels.dequant_gemm: dequantise + ``torch.mm``) and the dense
routed-experts prefill (``moe_prefill.moe_prefill_dense``) through Triton's interpreter on CPU
tensors: run by tests/test_dequant_gemm.py in a subprocess with TRITON_INTERPRET=1 (set before triton
is imported). Prints one line ``RESULT{json}``.

    TRITON_INTERPRET=1 python tests/dequant_interp_check.py
"""
import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dsv4lab.kernels import dequant_gemm  # noqa: E402
from dsv4lab.kernels.dequant_gemm import dequantize_rows, dense_gemm  # noqa: E402
from dsv4lab.kernels.linear_nvfp4 import nvfp4_matmul  # noqa: E402
from dsv4lab.kernels.linear_official import official_matmul  # noqa: E402
from dsv4lab.kernels.moe_prefill import dense_moe_fits, moe_prefill_triton, swiglu  # noqa: E402
from dsv4lab.kernels.moe_prefill_ref import moe_prefill_ref  # noqa: E402
from dsv4lab.model.swiglu import clamped_swiglu  # noqa: E402
from dsv4lab.quant.stacked import StackedMXFP4, StackedNVFP4  # noqa: E402
from interp_weights import bad, rand_fp8, rand_mxfp4, rand_nvfp4, rand_x  # noqa: E402


g = torch.Generator().manual_seed(1)  # the MoE ids; the weights draw from interp_weights.g
res = {}


def stored(w):
    """(format, data, scale, global scale) as the kernels take them."""
    if w.format == "nvfp4":
        return "nvfp4", w.packed, w.block_scale, w.global_scale.reshape(1).float()
    if w.format == "mxfp4":
        return "mxfp4", w.packed, w.scale, None
    return "fp8_block", w.data, w.scale_float().contiguous(), None


# dequantisation: bitwise what w.dequantize(dtype) gives, from row 0 and from an offset, ragged rows
N, K = 300, 256
for mk in (rand_nvfp4, rand_mxfp4, rand_fp8):
    w = mk(N, K)
    fmt, data, scale, gs = stored(w)
    for dtype in (torch.bfloat16, torch.float32):
        ref = w.dequantize(dtype)
        whole = dequantize_rows(fmt, data, scale, gs, 0, N, dtype)
        part = dequantize_rows(fmt, data, scale, gs, 128, 100, dtype)
        words = dequantize_rows(fmt, data, scale, gs, 0, N, dtype, cfg={"WORDS": True, "BN": 16, "BK": 128})
        # the interpreter's bf16 cast mis-rounds fp32 subnormals (MXFP4's 2^-127 scale): compared
        # apart, and bitwise on the GPU (tests/test_dequant_gemm.py)
        normal = (ref.float().abs() >= torch.finfo(torch.float32).tiny) | (ref == 0)
        res[f"dequant_{fmt}_{str(dtype)[6:]}"] = {
            "normal_equal": bool(torch.equal(whole[normal], ref[normal])), "normal_count": int(normal.sum()),
            "subnormal_close": bool(((whole.float() - ref.float())[~normal]).abs().max() <= 2 ** -126) if (~normal).any()
            else True, "offset": bool(torch.equal(part, ref[128:228])),
            "words_tiles": bool(torch.equal(words[normal], ref[normal]))}
    # the GEMM, one chunk and in row chunks (the scratch bound shrunk to 128 rows)
    x = rand_x(70, K, torch.bfloat16)
    ref = F.linear(x, w.dequantize(torch.bfloat16))
    y = torch.empty(70, N, dtype=torch.bfloat16)
    dense_gemm(x, fmt, data, scale, gs, y)
    res[f"dense_{fmt}_one_chunk_equal"] = bool(torch.equal(y, ref))
    saved, dequant_gemm.SCRATCH_BYTES = dequant_gemm.SCRATCH_BYTES, 128 * K * 2
    yc = torch.empty(70, N, dtype=torch.bfloat16)
    dense_gemm(x, fmt, data, scale, gs, yc)
    dequant_gemm.SCRATCH_BYTES = saved
    res[f"dense_{fmt}_chunked"] = bad(yc, ref, 1e-2)
    # the dispatchers' forced tier (DENSE) against the reference
    yd = (nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale, config={"DENSE": True}) if fmt == "nvfp4"
          else official_matmul(x, w, config={"DENSE": True}))
    res[f"dense_{fmt}_dispatch_equal"] = bool(torch.equal(yd, ref))
    # the dispatchers' own choice at M = DENSE_MIN_M: the dense tier (bitwise the reference), and
    # one row fewer: the Triton GEMM (within its tolerance, not bitwise: another summation order)
    for m in (dequant_gemm.DENSE_MIN_M, dequant_gemm.DENSE_MIN_M - 1):
        xm = rand_x(m, K, torch.bfloat16)
        refm = F.linear(xm, w.dequantize(torch.bfloat16))
        ym = nvfp4_matmul(xm, w.packed, w.block_scale, w.global_scale) if fmt == "nvfp4" else official_matmul(xm, w)
        res[f"auto_{fmt}_M{m}"] = {"equal": bool(torch.equal(ym, refm)), **bad(ym, refm, 1e-2)}

# the dense MoE prefill vs the per-expert reference: both formats, clamp or not, the routing weight
# before w2 or on the output, bf16 and fp32; an expert with no tokens (NVFP4: the last; MXFP4: expert
# 0, whose weights the dense path dequantises before it knows the counts)
E, H, I, T, k = 5, 64, 128, 40, 3
for name, mk, S in (("nvfp4", rand_nvfp4, StackedNVFP4), ("mxfp4", rand_mxfp4, StackedMXFP4)):
    w1 = S.from_weights([mk(I, H) for _ in range(E)])
    w3 = S.from_weights([mk(I, H) for _ in range(E)])
    w2 = S.from_weights([mk(H, I) for _ in range(E)])
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)]) + (name == "mxfp4")
    wt = torch.rand(T, k, generator=g)
    for dtype, rtol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5)):
        x = (torch.randn(T, H, generator=g) * 0.5).to(dtype)
        for lim in (None, 0.75):
            for before in (False, True):
                y = moe_prefill_triton(x, ids, wt, w1, w3, w2, lim, before, cfg={"DENSE": True})
                r = moe_prefill_ref(x, ids, wt, w1, w3, w2, lim, before)
                res[f"moe_dense_{name}_{str(dtype)[6:]}_lim{lim}_before{before}"] = bad(y, r, rtol)
# the fused SwiGLU vs the reference's ops (bitwise on the GPU: tests/test_dequant_gemm.py)
gate = torch.randn(33, 96, generator=g) * 4
up = torch.randn(33, 96, generator=g) * 4
rwt = torch.rand(33, generator=g)
for dtype in (torch.bfloat16, torch.float32):
    gd, ud = gate.to(dtype), up.to(dtype)
    for lim in (None, 2.5):
        ref = clamped_swiglu(gd, ud, lim)
        res[f"swiglu_{str(dtype)[6:]}_lim{lim}"] = bad(swiglu(gd, ud, lim, None), ref, 1e-2 if dtype == torch.bfloat16 else 1e-6)
        res[f"swiglu_{str(dtype)[6:]}_lim{lim}_weight"] = bad(swiglu(gd, ud, lim, rwt), ref * rwt[:, None].to(dtype),
                                                              1e-2 if dtype == torch.bfloat16 else 1e-6)
res["moe_dense_fits"] = {"few_rows": dense_moe_fits(x, 64.0, H, I), "many_rows": dense_moe_fits(x, 600.0, H, I),
                         "odd_K": dense_moe_fits(x, 600.0, 80, I)}
print("RESULT" + json.dumps(res))
