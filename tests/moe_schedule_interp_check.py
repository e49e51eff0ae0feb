"""The TMA MoE decode's schedules (dsv4lab/kernels/moe_decode_tma.py: two launches, the down one
PDL-launched, one fused launch of ticketed up and down tiles) through Triton's interpreter on CPU
tensors (run by tests/test_kernels.py in a subprocess with TRITON_INTERPRET=1). Prints one line
``RESULT{json}``: per schedule whether each call's y is bitwise the two-launch y, its error against
the reference, and whether every counter is back at 0 afterwards.
"""
import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dsv4lab.kernels import moe_decode_tma as mdt  # noqa: E402
from dsv4lab.kernels.host import counters  # noqa: E402
from dsv4lab.kernels.moe_decode_ref import moe_decode_ref  # noqa: E402
from dsv4lab.quant.stacked import StackedNVFP4, stack_one  # noqa: E402
from dsv4lab.quant.weights import quantize_nvfp4  # noqa: E402

g = torch.Generator().manual_seed(0)
E, H, I, T, k = 4, 256, 256, 2, 2   # one TMA box of groups; 16-row tiles: 16 up and 16 down tiles a pair
stack = lambda n, kk: StackedNVFP4.from_weights([quantize_nvfp4(torch.randn(n, kk, generator=g) * (1 + e))  # noqa: E731
                                                 for e in range(E)])
w1, w3, w2 = stack(I, H), stack(I, H), stack(H, I)
sh = tuple(stack_one(quantize_nvfp4(torch.randn(n, kk, generator=g) * 2)) for n, kk in ((I, H), (I, H), (H, I)))
x = torch.randn(T, H, generator=g).to(torch.bfloat16)
ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
wt = torch.rand(T, k, generator=g)
ref = (moe_decode_ref(x, ids, wt, w1, w3, w2, 1.5)
       + moe_decode_ref(x, torch.zeros(T, 1, dtype=torch.long), torch.ones(T, 1), *sh, 1.5))
res = {}
ys = {}
for sched, calls in (("two", 1), ("pdl", 1), ("fused", 2)):
    mdt.SCHEDULE = sched
    ys[sched] = [mdt.moe_decode_tma(x, ids.reshape(-1).to(torch.int32), wt.reshape(-1), w1, w3, w2, 1.5, k, shared=sh)
                 for _ in range(calls)]
mdt.SCHEDULE = "two"
for sched, got in ys.items():
    res[sched] = {"equal": [bool(torch.equal(y, ys["two"][0])) for y in got],
                  "max_abs": (got[0].float() - ref.float()).abs().max().item(), "ref_max": ref.abs().max().item()}
res["counters_zero"] = bool((counters(x.device, 256) == 0).all())
print("RESULT" + json.dumps(res))
