"""The decode attention and indexer-score kernels (dsv4lab/kernels/attention_decode.py,
indexer_decode.py) through Triton's interpreter on CPU tensors against their references
``dsv4lab.model.decode_attention.decode_attention`` and ``dsv4lab.model.indexer.index_scores_decode``:
run by tests/test_attention_decode_kernel.py in a subprocess with TRITON_INTERPRET=1 (set before
triton is imported). Prints one line ``RESULT{json}``: per attention case the max |kernel -
reference| and the reference's max |value|; per indexer case the max score difference (finite
part), whether the -inf pattern and the selected top-k sets agree.
"""
import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dsv4lab.kernels.attention_decode import decode_attention_triton  # noqa: E402
from dsv4lab.kernels.indexer_decode import index_scores_decode_triton  # noqa: E402
from dsv4lab.model.decode_attention import decode_attention  # noqa: E402
from dsv4lab.model.indexer import index_scores_decode  # noqa: E402

g = torch.Generator().manual_seed(0)
res = {}
B, H, D, W, T, K = 2, 5, 24, 8, 12, 7     # heads not a multiple of the head block, Dh not a power of two
# (name, pos, entries kind, splits): pos < window (ring partly empty), pos > window (wrapped);
# no entries closed yet; HCA-style all valid entries; CSA-style selected with -1s; one and 3 splits
CASES = [("window_p3", 3, None, None), ("window_p20", 20, None, 3), ("hca_n0", 2, "all", 3),
         ("hca_p20", 20, "all", 1), ("hca_p43", 43, "all", 3), ("csa_p20", 20, "sel", 1), ("csa_p43", 43, "sel", 3),
         ("csa_allneg", 5, "none_sel", 3)]
for dtype in (torch.float32, torch.bfloat16):
    for name, pos, kind, splits in CASES:
        q = torch.randn(B, 1, H, D, generator=g).to(dtype)
        ring = torch.randn(B, W, D, generator=g).to(dtype)
        sink = torch.randn(H, generator=g)
        p = torch.tensor(pos)
        ent = torch.randn(B, T, D, generator=g).to(dtype) if kind else None
        n_ent = torch.tensor(min((pos + 1) // 4, T)) if kind else None
        sel = None
        if kind == "sel":  # K picks among the closed entries, -1 where fewer are closed or scattered
            n = int(n_ent)
            sel = torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(B)]).view(B, 1, K)
            sel = torch.where(sel < n, sel, torch.full_like(sel, -1))
        elif kind == "none_sel":
            sel = torch.full((B, 1, K), -1, dtype=torch.long)
        args = (q, sink, D ** -0.5, ring, p, ent, n_ent, sel)
        want = decode_attention(*args).float()
        got = decode_attention_triton(*args, splits=splits).float()
        res[f"attn_{name}_{str(dtype)[6:]}"] = {"max_abs": (got - want).abs().max().item(),
                                                "ref_max": want.abs().max().item()}

# the output's inverse RoPE folded into the combine (inv_freq=): the bits of the kernel's output then
# norm_rope's in-place inverse launch; at one batch row (H * D / 16 = 64 groups: whole pair boxes) also
# the row's x_pairs for wo_a, written by the combine (no x_pairs launch after it)
from dsv4lab.kernels import activation_pairs  # noqa: E402
from dsv4lab.kernels.norm_rope import NORM_NONE, NORM_PLAIN, launch_norm_rope  # noqa: E402

inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))  # rope dim 16 of head dim 32
for dtype in (torch.float32, torch.bfloat16):
    for b, splits in ((1, 3), (2, 3), (1, 1)):
        q = torch.randn(b, 1, 32, 32, generator=g).to(dtype)
        ring = torch.randn(b, W, 32, generator=g).to(dtype)
        ent = torch.randn(b, T, 32, generator=g).to(dtype)
        args = (q, torch.randn(32, generator=g), 32 ** -0.5, ring, torch.tensor(43), ent, torch.tensor(10))
        plain = decode_attention_triton(*args, splits=splits)
        want = launch_norm_rope(plain.clone(), dtype, norm=NORM_NONE, positions=torch.tensor([43]), inv_freq=inv,
                                inverse=True, inplace=True)
        got = decode_attention_triton(*args, splits=splits, inv_freq=inv)
        gen = dict(activation_pairs._PAIRS_GEN)
        entry = {"equal": bool(torch.equal(got, want))}
        if b == 1:
            xp, xinv = (t.clone() for t in activation_pairs.x_pairs(got.reshape(1, -1)))
            skipped = activation_pairs._PAIRS_GEN == gen
            # another address: launched, the reference bits
            rp, rinv = activation_pairs.x_pairs(got.clone().reshape(1, -1))
            entry.update(pairs_skipped=skipped,
                         pairs_equal=bool(torch.equal(xp, rp) and torch.equal(xinv, rinv)))
        res[f"unrope_b{b}_s{splits}_{str(dtype)[6:]}"] = entry
        # ... and q taken raw (q_eps=): normalised and rotated in the split programs, against the
        # separate launch's q (the sum of squares in another order: within the attention's tolerance)
        q_raw = (q.float() * 3).to(dtype)
        args_raw = (q_raw,) + args[1:]
        roped = launch_norm_rope(q_raw, dtype, norm=NORM_PLAIN, eps=1e-6, positions=torch.tensor([43]), inv_freq=inv)
        want = decode_attention_triton(roped, *args[1:], splits=splits, inv_freq=inv).float()
        got = decode_attention_triton(*args_raw, splits=splits, inv_freq=inv, q_eps=1e-6).float()
        res[f"attn_qrope_b{b}_s{splits}_{str(dtype)[6:]}"] = {"max_abs": (got - want).abs().max().item(),
                                                            "ref_max": want.abs().max().item()}

# indexer scores + top-k: Hi 6 heads (padded to 16), Ih 20, capacity 150 (3 tiles of 64), k 9
Hi, Ih, Tc, k = 6, 20, 150, 9
for dtype in (torch.float32, torch.bfloat16):
    for n_valid in (0, 5, 70, 150):
        q = torch.randn(B, 1, Hi, Ih, generator=g).to(dtype)
        w_raw = torch.randn(B, 1, Hi, generator=g).to(dtype)
        keys = torch.randn(B, Tc, Ih, generator=g).to(dtype)
        nv = torch.tensor(n_valid)
        want = index_scores_decode(q, w_raw, keys, nv, Hi ** -0.5)
        got = index_scores_decode_triton(q, w_raw, keys, nv, Hi ** -0.5, programs=2)
        fin = torch.isfinite(want)
        same_inf = bool(torch.equal(fin, torch.isfinite(got)))
        diff = (got[fin] - want[fin]).abs().max().item() if fin.any() else 0.0
        kk = min(k, Tc)

        def chosen(s):  # Indexer.select's rule: top-k of the masked scores, -1 past n_valid
            idx = s.topk(kk, dim=-1).indices
            return torch.where(idx < n_valid, idx, torch.full_like(idx, -1)).sort(dim=-1).values

        res[f"index_n{n_valid}_{str(dtype)[6:]}"] = {"max_abs": diff, "ref_max": want[fin].abs().max().item() if fin.any() else 0.0,
                                                    "same_inf": same_inf, "same_set": bool(torch.equal(chosen(got), chosen(want)))}
        if n_valid == 70:  # q taken raw and rotated in the kernel (rope dim 8 of 20): the separate launch's bits
            inv8 = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
            p1 = torch.tensor([77])
            roped = launch_norm_rope(q, dtype, norm=NORM_NONE, positions=p1, inv_freq=inv8)
            sep = index_scores_decode_triton(roped, w_raw, keys, nv, Hi ** -0.5, programs=2)
            fold = index_scores_decode_triton(q, w_raw, keys, nv, Hi ** -0.5, programs=2, positions=p1, inv_freq=inv8)
            res[f"index_qrope_{str(dtype)[6:]}"] = {"equal": bool(torch.equal(fold, sep))}
print("RESULT" + json.dumps(res))
