"""The FP8-block decode GEMV (dsv4lab/kernels/linear_fp8_tma.py) through Triton's interpreter on CPU
tensors against the fp64 product of the dequantised weight (run by tests/test_fp8_gemv.py in a
subprocess with TRITON_INTERPRET=1). Prints one line ``RESULT{json}``: per case the max |kernel -
fp64| over max |fp64| ("rel"), whether two calls agree bit for bit, and what the plan chose.
"""
import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dsv4lab.kernels.dispatch import grouped_quant_linear, quant_linear  # noqa: E402
from dsv4lab.kernels.linear_fp8_tma import fp8_gemv, fp8_grouped_gemv, fp8_pair_gemv, fp8_plan  # noqa: E402
from dsv4lab.kernels.linear_official import official_matmul, verified_official_matmul, verified_official_pair  # noqa: E402
from dsv4lab.model.linear import grouped_linear  # noqa: E402
from dsv4lab.quant.weights import quantize_fp8_block  # noqa: E402

g = torch.Generator().manual_seed(0)
res = {}


def weight(N: int, K: int, scale_format: str = "fp32"):
    w = torch.randn(N, K, generator=g) * K ** -0.5
    w[0, :5] *= 40.0  # an outlier block: its scale differs from the others'
    return quantize_fp8_block(w, scale_format)


# name: (N, K, x dtype, scale format, tile override): ragged rows (not a multiple of the tile), one
# and several K splits, E8M0 scales, bf16 / fp32 x
CASES = {
    "bf16_ragged_rows": (40, 256, torch.bfloat16, "fp32", None),
    "bf16_split3": (48, 384, torch.bfloat16, "fp32", {"SPLIT": 3}),
    "f32_e8m0_two_scale_rows": (160, 256, torch.float32, "e8m0", {"SPLIT": 2}),
}
for name, (N, K, dt, sf, cfg) in CASES.items():
    w = weight(N, K, sf)
    x = torch.randn(1, K, generator=g).to(dt)
    want = x.double() @ w.dequantize(torch.float64).T
    y = torch.empty(1, N, dtype=dt)
    took = fp8_gemv(x, w, y, cfg=cfg)
    again = torch.empty_like(y)
    fp8_gemv(x, w, again, cfg=cfg)
    plan = fp8_plan(x, w, cfg=cfg)
    d = (y.double() - want).abs()
    res[name] = {"took": took, "rel": (d.max() / want.abs().max()).item(), "deterministic": bool(torch.equal(y, again)),
                 "splits": plan.split, "tiles": plan.n_tiles}

# the dispatcher: official_matmul at M = 1 takes the GEMV (same bits); config TMA=False the tiled kernel
w = weight(64, 256)
x = torch.randn(1, 1, 256, generator=g).to(torch.bfloat16)
y = torch.empty(1, 64, dtype=torch.bfloat16)
fp8_gemv(x.reshape(1, 256), w, y)
res["official_matmul_is_gemv"] = bool(torch.equal(official_matmul(x, w).reshape(1, 64), y))
tiled = official_matmul(x, w, config={"TMA": False}).reshape(1, 64)
want = x.reshape(1, 256).double() @ w.dequantize(torch.float64).T
res["tiled_rel"] = ((tiled.double() - want).abs().max() / want.abs().max()).item()

# grouped (wo_a's block-diagonal use): G row blocks of 128 rows, x [G, K] one token
G, rows, K = 3, 128, 256
w = weight(G * rows, K)
x = torch.randn(1, G, K, generator=g).to(torch.bfloat16)
want = grouped_linear(x.double(), w.dequantize(torch.float64), G)
y = fp8_grouped_gemv(x, w, G)
d = (y.double() - want).abs()
res["grouped"] = {"rel": (d.max() / want.abs().max()).item(), "shape": list(y.shape),
                  "blocks_bitwise": all(torch.equal(y[0, i], official_matmul(x[0, i:i + 1], w.row_block(i * rows, rows))[0])
                                        for i in range(G))}
res["grouped_two_tokens_declined"] = fp8_grouped_gemv(torch.randn(2, G, K).to(torch.bfloat16), w, G) is None
# the dispatcher on CPU tensors is the reference (the kernel slot's contract off CUDA)
res["dispatch_cpu_reference"] = bool(torch.equal(grouped_quant_linear(x, w, G), grouped_linear(x, w.dequantize(x.dtype), G)))
res["quant_linear_cpu_reference"] = bool(torch.equal(quant_linear(x[0, :1], w), torch.nn.functional.linear(x[0, :1], w.dequantize(x.dtype))))
# two weights of one x in one launch (wq_a + wkv): each output the bits of its own GEMV; the
# dispatcher's pair waits for both weights' first-use check
wa, wb = weight(48, 256), weight(160, 256, "e8m0")
x = torch.randn(1, 256, generator=g).to(torch.bfloat16)
ya, yb = torch.empty(1, 48, dtype=torch.bfloat16), torch.empty(1, 160, dtype=torch.bfloat16)
fp8_gemv(x, wa, ya)
fp8_gemv(x, wb, yb)
pa, pb = fp8_pair_gemv(x, wa, wb)
before_check = verified_official_pair(x, wa, wb)
verified_official_matmul(x, wa)
verified_official_matmul(x, wb)
after = verified_official_pair(x, wa, wb)
res["pair"] = {"bitwise": torch.equal(pa, ya) and torch.equal(pb, yb), "shapes": [list(pa.shape), list(pb.shape)],
               "waits_for_check": before_check is None,
               "after_check_bitwise": after is not None and torch.equal(after[0], ya) and torch.equal(after[1], yb),
               "other_k_declined": fp8_pair_gemv(x, wa, weight(32, 384)) is None}
# an in-place edit of E8M0 scales (widened once into the plan) is seen by the next call
w = weight(64, 256, "e8m0")
x = torch.randn(1, 256, generator=g)
before, after = torch.empty(1, 64), torch.empty(1, 64)
fp8_gemv(x, w, before)
w.scale.view(torch.uint8)[0, 1] += 1  # the second 128-column block's scale doubles
fp8_gemv(x, w, after)
want = x.double() @ w.dequantize(torch.float64).T
res["scale_edit_seen"] = {"changed": not torch.equal(before, after),
                          "rel": ((after.double() - want).abs().max() / want.abs().max()).item()}
# K not a multiple of 128: not taken
w_odd = quantize_fp8_block(torch.randn(32, 200, generator=g))
res["k200_declined"] = fp8_gemv(torch.randn(1, 200), w_odd, torch.empty(1, 32)) is False
print("RESULT" + json.dumps(res))
