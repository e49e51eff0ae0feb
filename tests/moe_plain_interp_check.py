"""The plain-expert MoE decode (dsv4lab/kernels/moe_decode_plain.py) through Triton's interpreter on
CPU tensors against ``moe_decode_plain_ref`` (run by tests/test_moe_plain.py in a subprocess with
TRITON_INTERPRET=1). Prints one line ``RESULT{json}``: per case the max |kernel - reference| over
the reference's max |value|, the clamp's reach, and whether two calls agree bit for bit.
"""
import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dsv4lab.kernels.moe_decode_plain import moe_decode_plain_triton  # noqa: E402
from dsv4lab.kernels.moe_decode_ref import moe_decode_plain_ref  # noqa: E402

g = torch.Generator().manual_seed(0)
res = {}
# name: (T, k, E, H, I, x dtype, weight dtype, limit): ragged I and H (not multiples of the tiles),
# several tokens, a weight dtype other than x's, no clamp
CASES = {
    "f32": (2, 2, 5, 96, 40, torch.float32, torch.float32, 1.0),
    "bf16": (3, 2, 4, 64, 72, torch.bfloat16, torch.bfloat16, 1.0),
    "bf16_x_f32_w": (1, 3, 6, 80, 48, torch.bfloat16, torch.float32, 1.0),
    "f32_no_limit": (2, 1, 3, 64, 32, torch.float32, torch.bfloat16, None),
}
for name, (T, k, E, H, I, xdt, wdt, lim) in CASES.items():
    x = (torch.randn(T, H, generator=g) * 2).to(xdt)
    w1 = (torch.randn(E, I, H, generator=g) * H ** -0.5).to(wdt)
    w3 = (torch.randn(E, I, H, generator=g) * H ** -0.5).to(wdt)
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(wdt)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    want = moe_decode_plain_ref(x, ids, wts, w1, w3, w2, lim)
    got = moe_decode_plain_triton(x, ids, wts, w1, w3, w2, lim)
    again = moe_decode_plain_triton(x, ids, wts, w1, w3, w2, lim)
    gate = torch.einsum("th,eih->tei", x.float(), w1.float())
    res[name] = {"rel": ((got.float() - want.float()).abs().max() / want.float().abs().max()).item(),
                 "clamped": bool((gate > (lim or float("inf"))).any()),
                 "deterministic": bool(torch.equal(got, again)), "dtype_ok": got.dtype == xdt,
                 "shape_ok": tuple(got.shape) == (T, H)}
try:
    moe_decode_plain_triton(torch.zeros(1, 64), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1),
                            torch.zeros(2, 8, 32), torch.zeros(2, 8, 32), torch.zeros(2, 64, 8), 1.0)
    res["bad_shape_error"] = None
except ValueError as e:
    res["bad_shape_error"] = str(e)
print("RESULT" + json.dumps(res))
