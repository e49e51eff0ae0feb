"""The prefill GEMM (dsv4lab.kernels.linear_gemm) and the grouped MoE prefill
(dsv4lab.kernels.moe_prefill) through Triton's interpreter on CPU tensors (tiny shapes): run by
tests/test_gemm.py in a subprocess with TRITON_INTERPRET=1 (set before triton is imported).
Prints one line ``RESULT{json}``: per case the number of elements outside the tolerance.

    TRITON_INTERPRET=1 python tests/gemm_interp_check.py
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

from dsv4lab.kernels.linear_gemm import launch_gemm  # noqa: E402
from dsv4lab.kernels.linear_nvfp4 import nvfp4_matmul  # noqa: E402
from dsv4lab.kernels.linear_official import official_matmul  # noqa: E402
from dsv4lab.kernels.moe_prefill import expert_schedule, moe_prefill_triton  # noqa: E402
from dsv4lab.kernels.moe_prefill_ref import moe_prefill_ref  # noqa: E402
from dsv4lab.quant.stacked import StackedMXFP4, StackedNVFP4  # noqa: E402
from interp_weights import bad, g, rand_fp8, rand_mxfp4, rand_nvfp4, rand_x  # noqa: E402

res = {}


def launch(x, w, cfg):
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    if w.format == "nvfp4":
        launch_gemm(x, "nvfp4", w.packed, w.block_scale, w.global_scale.reshape(1).float(), y, cfg)
    elif w.format == "mxfp4":
        launch_gemm(x, "mxfp4", w.packed, w.scale, None, y, cfg)
    else:
        launch_gemm(x, "fp8_block", w.data, w.scale_float().contiguous(), None, y, cfg)
    return y


# the dense GEMM: formats x M (ragged included) x tile orientation x split K, N = 40 (a ragged
# column tile), K = 256 (two 128-column FP8 blocks, four BK = 64 steps)
N, K = 40, 256
for fmt, mk in (("nvfp4", rand_nvfp4), ("mxfp4", rand_mxfp4), ("fp8", rand_fp8)):
    w = mk(N, K)
    for M in (64, 97, 130):
        for dtype, rtol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
            x = rand_x(M, K, dtype)
            ref = F.linear(x, w.dequantize(dtype))
            for swap in (True, False):
                for split in (1, 3):
                    cfg = {"SWAP": swap, "SPLIT": split, "BK": 64, "BN": 32, "BM": 64}
                    res[f"gemm_{fmt}_M{M}_{str(dtype)[6:]}_swap{swap}_split{split}"] = bad(launch(x, w, cfg), ref, rtol)
    # the dispatcher's path at M >= 64 (the interpreter counts as sm_90+), BK = 128 and the default tiles
    x = rand_x(80, K, torch.bfloat16)
    y = (nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale) if fmt == "nvfp4" else official_matmul(x, w))
    res[f"gemm_{fmt}_dispatch"] = bad(y, F.linear(x, w.dequantize(torch.bfloat16)), 1e-2)
    res[f"gemm_{fmt}_bk128"] = bad(launch(x, w, {"BK": 128}), F.linear(x, w.dequantize(torch.bfloat16)), 1e-2)

# the grouped MoE prefill vs the per-expert reference: both formats, with and without the clamp,
# the routing weight before w2 or on the output, bf16 and fp32; an expert with no tokens
E, H, I, T, k = 6, 64, 96, 45, 3
for name, mk, S in (("nvfp4", rand_nvfp4, StackedNVFP4), ("mxfp4", rand_mxfp4, StackedMXFP4)):
    w1 = S.from_weights([mk(I, H) for _ in range(E)])
    w3 = S.from_weights([mk(I, H) for _ in range(E)])
    w2 = S.from_weights([mk(H, I) for _ in range(E)])
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])  # expert E-1 unused
    wt = torch.rand(T, k, generator=g)
    for dtype, rtol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5)):
        x = (torch.randn(T, H, generator=g) * 0.5).to(dtype)
        for lim in (None, 0.75):
            for before in (False, True):
                y = moe_prefill_triton(x, ids, wt, w1, w3, w2, lim, before)
                r = moe_prefill_ref(x, ids, wt, w1, w3, w2, lim, before)
                res[f"moe_{name}_{str(dtype)[6:]}_lim{lim}_before{before}"] = bad(y, r, rtol)

# the schedule: every (token, slot) row exactly once, tiles inside one expert, surplus tiles marked
s = expert_schedule(ids, E, 16)
flat = ids.reshape(-1)
te, r0, r1 = s["tile_e"].tolist(), s["tile_r0"].tolist(), s["tile_r1"].tolist()
covered = sorted(r for t in range(s["tiles"]) if te[t] >= 0 for r in range(r0[t], min(r0[t] + 16, r1[t])))
res["schedule"] = {
    "rows_once": covered == list(range(T * k)),
    "one_expert": all(int(flat[s["order"][r]]) == te[t] for t in range(s["tiles"]) if te[t] >= 0
                      for r in range(r0[t], min(r0[t] + 16, r1[t]))),
    "pos_inverse": bool(torch.equal(s["order"][s["pos"].long()], torch.arange(T * k))),
    "src": bool(torch.equal(s["src"].long(), s["order"] // k)),
}
print("RESULT" + json.dumps(res))
