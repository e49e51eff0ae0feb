"""The indexer's decode top-k kernel (dsv4lab/kernels/indexer_topk.py) through Triton's interpreter
on CPU tensors against its reference ``dsv4lab.model.indexer.index_top_k_decode``: run by
tests/test_indexer_topk.py in a subprocess with TRITON_INTERPRET=1 (set before triton is
imported). Prints one line ``RESULT{json}``: per case whether the selected sets agree (distinct
scores), the kernel's list in index order, and the tie cases' exact lists.
"""
import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dsv4lab.kernels import indexer_topk  # noqa: E402
from dsv4lab.model.indexer import index_top_k_decode  # noqa: E402

indexer_topk.BLOCK = 64  # several tiles per pass at small capacities
g = torch.Generator().manual_seed(0)
res = {}
B = 2
# (name, capacity T, n_valid, k): none valid, fewer than k, exactly k, more than k over several
# tiles, k > T (k clipped), n_valid past the capacity (clipped)
CASES = [("n0", 150, 0, 9), ("n5", 150, 5, 9), ("n9", 150, 9, 9), ("n70", 150, 70, 9), ("n150", 150, 150, 40),
         ("k_gt_t", 20, 20, 32), ("n_gt_t", 100, 300, 9)]
for name, T, n, k in CASES:
    scores = torch.randn(B, 1, T, generator=g) * 3
    scores[0, 0, :n // 3] *= -1                  # negative and positive keys
    nv = torch.tensor(n)
    want = index_top_k_decode(scores, nv, k)
    got = indexer_topk.index_top_k_decode_triton(scores, nv, k)
    res[name] = {"same_set": bool(torch.equal(got.sort(-1).values, want.sort(-1).values)),
                 "shape_ok": got.shape == want.shape, "dtype_ok": got.dtype == torch.int64}
    ok_order = all(bool((r[r >= 0].diff() > 0).all()) and bool((r[(r >= 0).sum():] == -1).all()) for r in got.view(B, -1))
    res[name]["index_order"] = ok_order
# ties: equal scores at the k-th value take the lowest indices; -0.0 equals +0.0; NaN-free
s = torch.tensor([[[1.0, 0.0, 2.0, -0.0, 0.0, 2.0, 0.0, -1.0]]])
res["ties"] = indexer_topk.index_top_k_decode_triton(s, torch.tensor(8), 4).view(-1).tolist()
res["ties_all_equal"] = indexer_topk.index_top_k_decode_triton(torch.zeros(1, 1, 200), torch.tensor(150), 5).view(-1).tolist()
print("RESULT" + json.dumps(res))
