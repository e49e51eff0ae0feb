"""The unquantised decode GEMV (dsv4lab/kernels/linear_plain.py) through Triton's interpreter on CPU
tensors against F.linear of the same operands in fp64 (run by tests/test_linear_plain.py in a
subprocess with TRITON_INTERPRET=1). Prints one line ``RESULT{json}``: per case the max |kernel -
fp64| over the fp64 result's max |value| ("rel"), and whether two calls agree bit for bit.
"""
import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dsv4lab.kernels.linear_plain import BK, BN, plain_gemv, plain_split  # noqa: E402

g = torch.Generator().manual_seed(0)
res = {}
# name: (M, N, K, dtype, split override, tile override): ragged N (not a multiple of the row tile),
# K not a multiple of the step, one and several splits, 1..4 rows, 3-D x
SMALL = {"BN": 16, "BK": 128}   # splits of a short K need a step below the rule's 1024
CASES = {
    "m1_bf16_split": (1, 37, 600, torch.bfloat16, 3, SMALL),
    "m1_bf16_rule": (1, 40, 512, torch.bfloat16, None, None),
    "m3_bf16": (3, 21, 300, torch.bfloat16, 2, SMALL),
    "m4_f16_one_split": (4, 16, 256, torch.float16, 1, SMALL),
    "m2_f32": (2, 33, 520, torch.float32, 3, SMALL),
    "m1_bf16_long_k": (1, 9, 2600, torch.bfloat16, None, None),   # the rule's tiles: 2 row tiles x 3 splits
}
for name, (M, N, K, dt, split, cfg) in CASES.items():
    x = torch.randn(M, 1, K, generator=g).to(dt)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dt)
    want = torch.nn.functional.linear(x.double(), w.double())
    got = plain_gemv(x, w, split=split, config=cfg)
    again = plain_gemv(x, w, split=split, config=cfg)
    d = (got.double() - want).abs()
    bn, bk = (cfg or {}).get("BN", BN), (cfg or {}).get("BK", BK)
    res[name] = {"rel": (d.max() / want.abs().max()).item(), "max_abs": d.max().item(),
                 "deterministic": bool(torch.equal(got, again)), "shape_ok": list(got.shape) == [M, 1, N],
                 "dtype_ok": got.dtype == dt, "splits": plain_split(N, K, split, bn, bk)[1]}
print("RESULT" + json.dumps(res))
