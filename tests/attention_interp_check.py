"""The bounded prefill attention kernel (dsv4lab/kernels/attention_bounded.py) through Triton's
interpreter on CPU tensors against ``dsv4lab.model.bounded_attention.bounded_attention``: run by
tests/test_attention_kernel.py in a subprocess with TRITON_INTERPRET=1 (set before triton is
imported). Prints one line ``RESULT{json}``: per case the max |kernel - reference| and the
reference's max |value|.
"""
import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dsv4lab.kernels.attention_bounded import bounded_attention_triton  # noqa: E402
from dsv4lab.model.bounded_attention import bounded_attention  # noqa: E402

g = torch.Generator().manual_seed(0)
res = {}
B, H, D, W = 2, 5, 24, 8          # heads not a multiple of the head block, Dh not a power of two
for dtype in (torch.float32, torch.bfloat16):
    for kind in ("sliding", "hca", "csa"):
        for start, S in ((0, 19), (13, 11)):  # a first chunk, and one with prior window keys
            k_start = max(0, start - W + 1)
            P = start + S - k_start
            q = torch.randn(B, S, H, D, generator=g).to(dtype)
            wk = torch.randn(B, P, D, generator=g).to(dtype)
            sink = torch.randn(H, generator=g)
            ratio = 4 if kind != "sliding" else 0
            T = (start + S) // ratio if ratio else 0
            ent = torch.randn(B, T, D, generator=g).to(dtype) if ratio else None
            sel = None
            if kind == "csa":  # top-3 of the closed entries per query, -1 where fewer are closed
                vis = (torch.arange(start, start + S) + 1) // ratio
                scores = torch.randn(B, S, T, generator=g).masked_fill(torch.arange(T) >= vis.view(1, -1, 1), float("-inf"))
                top = scores.topk(min(3, T), dim=-1).indices
                sel = torch.where(top < vis.view(1, -1, 1), top, torch.full_like(top, -1))
            args = (q, sink, D ** -0.5, W, wk, start, k_start, ent, ratio, sel)
            want = bounded_attention(*args, q_block=4, k_block=5).float()
            got = bounded_attention_triton(*args, block_n=16).float()
            res[f"{kind}_{str(dtype)[6:]}_s{start}"] = {"max_abs": (got - want).abs().max().item(),
                                                        "ref_max": want.abs().max().item()}
# CSA with more selected slots than one tile: -1s scattered, -1s only at the head, an all -1 row, and
# valid slots after -1s (the kernel walks to each row's last valid slot, whatever the order)
start, S, T, K = 0, 9, 40, 37
q = torch.randn(B, S, H, D, generator=g)
wk = torch.randn(B, S, D, generator=g)
sink = torch.randn(H, generator=g)
ent = torch.randn(B, T, D, generator=g)
sel = torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(B * S)]).view(B, S, K)
sel = torch.where(torch.rand(B, S, K, generator=g) < 0.4, torch.full_like(sel, -1), sel)
sel[0, 1] = -1                      # nothing selected
sel[0, 2, :-1] = -1                 # only the last slot
sel[1, 3, 20:] = -1                 # a tail of -1s (the indexer's order)
sel[1, 4, :30] = -1                 # a head of -1s
args = (q, sink, D ** -0.5, W, wk, start, 0, ent, 4, sel)
want = bounded_attention(*args, q_block=4, k_block=5).float()
got = bounded_attention_triton(*args, block_n=16).float()
res["csa_scattered_slots_float32"] = {"max_abs": (got - want).abs().max().item(), "ref_max": want.abs().max().item()}
print("RESULT" + json.dumps(res))
