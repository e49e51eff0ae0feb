"""The batched unquantised decode GEMV (``linear_plain.plain_gemv_batch``) through Triton's
interpreter on CPU tensors against ``plain_gemv`` per weight (same bits: the same programs) and
F.linear in fp64 (run by tests/test_linear_plain.py in a subprocess with TRITON_INTERPRET=1).
Prints one line ``RESULT{json}``: per case whether every output equals its single launch bit for
bit, the max |batch - fp64| over max |fp64| ("rel"), the shapes, and the splits of the weights.
"""
import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dsv4lab.kernels.linear_plain import plain_gemv, plain_gemv_batch, plain_split  # noqa: E402

g = torch.Generator().manual_seed(0)
res = {}
# name: (M, K, row counts, dtype): one to five weights, ragged N, one split (short K) and several
# (K > BK: the rule splits), a split-1 weight beside split ones, 1..4 rows
CASES = {
    "five_m1_bf16": (1, 2600, (37, 16, 9, 8, 3), torch.bfloat16),
    "two_m3_bf16": (3, 2100, (21, 40), torch.bfloat16),
    "one_m1_f16": (1, 600, (12,), torch.float16),
    "three_m4_bf16_short_k": (4, 96, (5, 24, 17), torch.bfloat16),
    "four_m2_f32": (2, 1100, (7, 9, 33, 1), torch.float32),
    "mixed_split_m1_bf16": (1, 1100, (9, 4100), torch.bfloat16),   # 2 splits beside 1 (513 row tiles)
}
for name, (M, K, ns, dt) in CASES.items():
    x = torch.randn(M, 1, K, generator=g).to(dt)
    ws = [(torch.randn(n, K, generator=g) * K ** -0.5).to(dt) for n in ns]
    got = plain_gemv_batch(x, ws)
    again = plain_gemv_batch(x, ws)
    single = [plain_gemv(x, w) for w in ws]
    rel = 0.0
    for y, w in zip(got, ws):
        want = torch.nn.functional.linear(x.double(), w.double())
        rel = max(rel, ((y.double() - want).abs().max() / want.abs().max()).item())
    res[name] = {"bitwise_single": all(torch.equal(a, b) for a, b in zip(got, single)),
                 "deterministic": all(torch.equal(a, b) for a, b in zip(got, again)), "rel": rel,
                 "shapes_ok": [list(y.shape) for y in got] == [[M, 1, n] for n in ns],
                 "contiguous": all(y.is_contiguous() for y in got),
                 "splits": [plain_split(n, K)[1] for n in ns]}
print("RESULT" + json.dumps(res))
