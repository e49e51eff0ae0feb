"""The indexer's prefill scores kernel (dsv4lab/kernels/indexer_prefill.py) through Triton's
interpreter on CPU tensors against its reference ``dsv4lab.model.indexer.index_scores_prefill``: run
by tests/test_indexer_prefill_kernel.py in a subprocess with TRITON_INTERPRET=1 (set before triton is
imported). Prints one line ``RESULT{json}``: per case the max |kernel - reference| over the finite
scores, whether the -inf pattern matches, and whether the top-k sets agree.
"""
import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dsv4lab.kernels import indexer_prefill  # noqa: E402
from dsv4lab.model.indexer import index_scores_prefill, top_k_valid  # noqa: E402

indexer_prefill.BLOCK_T = 16   # several key tiles and query blocks at small sizes
indexer_prefill.QUERIES = 4
g = torch.Generator().manual_seed(0)
res = {}
# (name, B, S, T, Hi, Ih, start, ratio, dtype): a chunk at the start (tiles closed later for every
# query), a late chunk (all open), odd sizes (masks), bf16 (tensor-core dot type), fp32 (IEEE dots)
CASES = [("first_chunk", 2, 37, 40, 4, 16, 0, 4, torch.float32), ("late_chunk", 1, 12, 45, 8, 32, 170, 4, torch.float32),
         ("odd_heads", 1, 9, 33, 3, 24, 60, 2, torch.float32), ("bf16", 2, 21, 50, 4, 32, 90, 4, torch.bfloat16)]
for name, B, S, T, HI, DI, start, ratio, dt in CASES:
    q = torch.randn(B, S, HI, DI, generator=g).to(dt)
    w = torch.randn(B, S, HI, generator=g).to(dt)
    keys = torch.randn(B, T, DI, generator=g).to(dt)
    n_valid = (torch.arange(start, start + S) + 1) // ratio
    want = index_scores_prefill(q, w, keys, n_valid, HI ** -0.5)
    got = indexer_prefill.index_scores_prefill_triton(q, w, keys, n_valid, HI ** -0.5)
    fin = torch.isfinite(want)
    k = 5
    res[name] = {"shape_ok": got.shape == want.shape and got.dtype == torch.float32,
                 "inf_pattern_ok": bool(torch.equal(fin, torch.isfinite(got))),
                 "max_abs": float((got[fin] - want[fin]).abs().max()) if fin.any() else 0.0,
                 "scale": float(want[fin].abs().max()) if fin.any() else 0.0,
                 "same_topk": bool(torch.equal(top_k_valid(got, n_valid, k).sort(-1).values,
                                               top_k_valid(want, n_valid, k).sort(-1).values))}
print("RESULT" + json.dumps(res))
