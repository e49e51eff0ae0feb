"""The fused mHC kernels (dsv4lab/kernels/mhc_fused.py) through Triton's interpreter on CPU tensors
against the reference in dsv4lab/model/mhc.py: run by tests/test_mhc_kernel.py in a subprocess with
TRITON_INTERPRET=1 (set before triton is imported). Prints one line ``RESULT{json}``: per case and
output the max |kernel - reference|, the max over elements of |kernel - reference| / (|reference| +
max|reference| * 2^-24) ("rel") and the reference's max |value|.
"""
import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dsv4lab.kernels import mhc_fused  # noqa: E402
from dsv4lab.kernels.activation_pairs import x_pairs  # noqa: E402
from dsv4lab.kernels.mhc_fused import hc_head_pre, hc_post, hc_pre  # noqa: E402
from dsv4lab.model.mhc import HyperConnection, collapse, head_weights, mix_logits, mix_weights  # noqa: E402
from dsv4lab.model.norms import rms_norm  # noqa: E402

g = torch.Generator().manual_seed(0)
res = {}
mhc_fused.DENSE_CHUNK_K = 64  # the dense cases' products in several K chunks (hc*D = 256: 4, 120: 2)


def diff(got, want):
    got, want = got.double(), want.double()
    d = (got - want).abs()
    ref_max = want.abs().max().item()
    return {"max_abs": d.max().item(), "rel": (d / (want.abs() + ref_max * 2.0 ** -24 + 1e-30)).max().item(),
            "ref_max": ref_max}


def params(hc, D, head, logit_scale):
    mix = hc if head else (2 + hc) * hc
    fn = torch.randn(mix, hc * D, generator=g) * 0.2
    base = torch.randn(mix, generator=g)
    scale = torch.rand(1 if head else 3, generator=g) * logit_scale + 0.5
    return fn, base, scale


# name: (hc, D, B, S, dtype, iters, hc_eps, hc_pre keywords (split / block_k / dense), streams kind, logit scale)
CASES = {
    "b1_f32": (4, 64, 1, 1, torch.float32, 20, 1e-6, {}, "randn", 1.0),
    "b2_f32_split": (4, 64, 2, 1, torch.float32, 20, 1e-6, {"split": 4, "block_k": 32}, "randn", 1.0),
    "b3_bf16": (4, 64, 3, 1, torch.bfloat16, 20, 1e-6, {}, "randn", 1.0),
    "b3_bf16_split": (4, 64, 3, 1, torch.bfloat16, 20, 1e-6, {"split": 3, "block_k": 16}, "randn", 1.0),
    "b2s3_bf16_blocks": (4, 64, 2, 9, torch.bfloat16, 20, 1e-6, {"split": 2, "block_k": 32}, "randn", 1.0),  # 2 blocks
    "hc3_d40_f32": (3, 40, 2, 1, torch.float32, 7, 1e-6, {"split": 5, "block_k": 16}, "randn", 1.0),  # padded hc
    "eps_zero_streams": (4, 64, 2, 1, torch.float32, 20, 1e-6, {"split": 4, "block_k": 32}, "zeros", 1.0),  # rms eps
    "eps_saturated": (4, 64, 2, 1, torch.float32, 20, 1e-2, {}, "randn", 400.0),      # softmax 0s: Sinkhorn eps
    "iters1_bf16": (4, 64, 1, 1, torch.bfloat16, 1, 1e-3, {"split": 2, "block_k": 64}, "randn", 1.0),
    # 16 tokens in one block: the collapse (and the folded block norm) in two steps of 128 over D = 160
    "s16_bf16_d160_steps": (4, 160, 1, 16, torch.bfloat16, 20, 1e-6, {"split": 2, "block_k": 16}, "randn", 1.0),
    # the dense tier (cuBLAS products of fn's bf16 parts on the GPU; an fp32 matmul here): 18 tokens in
    # blocks of 4 (a ragged last block), hc 3 with a ragged D, zero streams
    "b2s9_bf16_dense": (4, 64, 2, 9, torch.bfloat16, 20, 1e-6, {"dense": True}, "randn", 1.0),
    "hc3_d40_bf16_dense": (3, 40, 1, 5, torch.bfloat16, 7, 1e-6, {"dense": True}, "randn", 1.0),
    "eps_zero_bf16_dense": (4, 64, 1, 3, torch.bfloat16, 20, 1e-6, {"dense": True}, "zeros", 1.0),
}
for name, (hc, D, B, S, dtype, iters, hc_eps, kw, kind, lscale) in CASES.items():
    streams = (torch.randn(B, S, hc, D, generator=g) if kind == "randn" else torch.zeros(B, S, hc, D)).to(dtype)
    fn, base, scale = params(hc, D, False, lscale)
    pre, post, comb = mix_weights(streams, fn, base, scale, iters, hc_eps, 1e-6)
    k_pre, k_post, k_comb, k_col = hc_pre(streams, fn, base, scale, iters, hc_eps, 1e-6, **kw)
    res[name] = {"pre": diff(k_pre, pre), "post": diff(k_post, post), "comb": diff(k_comb, comb),
                 "collapsed": diff(k_col, collapse(pre, streams))}
    out = torch.randn(B, S, D, generator=g).to(dtype)
    res[name]["expand"] = diff(hc_post(streams, out, post, comb), HyperConnection.expand(streams, out, post, comb))
    # the deferred projection: hc_pre's logits, projected by hc_post (PendingSinkhorn's fused pair)
    logits = mix_logits(streams, fn, base, scale, hc_eps, 1e-6)[2]
    k_logits = hc_pre(streams, fn, base, scale, iters, hc_eps, 1e-6, sinkhorn=False, **kw)[2]
    res[name]["logits"] = diff(k_logits, logits)
    res[name]["expand_pending"] = diff(hc_post(streams, out, post, k_logits, sinkhorn_iters=iters, hc_eps=hc_eps),
                                       HyperConnection.expand(streams, out, post, comb))
    # the block's RMSNorm folded (block_norm_weight=): against rms_norm of the same launch's collapsed
    # rows; one row of D % 16 == 0 also leaves its x_pairs in the kept buffers, as x_pairs writes them
    w = (1.0 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    normed = hc_pre(streams, fn, base, scale, iters, hc_eps, 1e-6, block_norm_weight=w, block_norm_eps=1e-6, **kw)
    res[name]["normed"] = diff(normed[3], rms_norm(k_col, w, 1e-6))
    res[name]["normed_pre"] = diff(normed[0], k_pre)
    if B * S == 1 and D % 16 == 0:
        rows, inv = (t.clone() for t in x_pairs(normed[3]))    # no launch: the fold's own pairs
        want_rows, want_inv = x_pairs(normed[3].clone())         # a new tensor: the x_pairs launch
        res[name]["normed_pairs_equal"] = {"max_abs": float(not (torch.equal(rows, want_rows)
                                                                 and torch.equal(inv, want_inv))),
                                           "rel": 0.0, "ref_max": float(want_inv.abs().max())}
    fn, base, scale = params(hc, D, True, lscale)
    h_pre = head_weights(streams, fn, base, scale, hc_eps, 1e-6)
    k_pre, k_col = hc_head_pre(streams, fn, base, scale, hc_eps, 1e-6, **kw)
    res[name]["head_pre"] = diff(k_pre, h_pre)
    res[name]["head_collapsed"] = diff(k_col, collapse(h_pre, streams))
# fn's tile loaded before the PDL wait (one K step a program: EARLY_FN) against the K loop: the same bits
import dsv4lab.kernels.mhc_fused as mhc_fused_mod
early = {}
EARLY_CASES = {"b1_f32": CASES["b1_f32"], "b3_bf16": CASES["b3_bf16"],
               "d1024_bf16_splits": (4, 1024, 1, 1, torch.bfloat16, 20, 1e-6, {}, "randn", 1.0)}  # 16 one-step splits
for name, (hc, D, B, S, dtype, iters, hc_eps, kw, kind, lscale) in EARLY_CASES.items():
    streams = torch.randn(B, S, hc, D, generator=g).to(dtype)
    fn, base, scale = params(hc, D, False, lscale)
    w = (1.0 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    outs = {}
    for on in (True, False):
        mhc_fused_mod.EARLY_FN_ON = on
        outs[on] = hc_pre(streams, fn, base, scale, iters, hc_eps, 1e-6, **kw) + \
            hc_pre(streams, fn, base, scale, iters, hc_eps, 1e-6, block_norm_weight=w, block_norm_eps=1e-6, **kw)
    mhc_fused_mod.EARLY_FN_ON = True
    bt, bk, ch, n_split = mhc_fused_mod.pre_split(B * S, hc * D, kw.get("split"), kw.get("block_k"))
    early[name] = {"one_step": ch <= bk, "splits": n_split, "bitwise": all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))}
res["_early_fn"] = early
# one launch for an expansion and the next site's pre (hc_post_pre) against the two launches, bit for
# bit: comb given or its logits projected (the pending Sinkhorn), with and without the next block's
# norm (one row: its pairs too), one and several splits, two tokens; and the shapes it declines
from dsv4lab.kernels.activation_pairs import _kept_pairs  # noqa: E402
from dsv4lab.kernels.mhc_fused import hc_post_pre, post_pre_fits  # noqa: E402
fused = {}
for name, (hc, D, B, dtype, project, norm) in {
        "d256_f32": (4, 256, 1, torch.float32, False, False),
        "d256_bf16_pending_norm": (4, 256, 1, torch.bfloat16, True, True),
        "d1024_bf16_norm_splits": (4, 1024, 1, torch.bfloat16, False, True),
        "d1024_bf16_pending": (4, 1024, 1, torch.bfloat16, True, False),
        "b2_d256_bf16_pending_norm": (4, 256, 2, torch.bfloat16, True, True)}.items():
    streams = torch.randn(B, 1, hc, D, generator=g).to(dtype)
    out = torch.randn(B, 1, D, generator=g).to(dtype)
    fn0, base0, scale0 = params(hc, D, False, 1.0)
    _, post0, comb0 = mix_weights(streams, fn0, base0, scale0, 20, 1e-6, 1e-6)
    logits0 = mix_logits(streams, fn0, base0, scale0, 1e-6, 1e-6)[2]
    fn, base, scale = params(hc, D, False, 1.0)
    w = (1.0 + 0.1 * torch.randn(D, generator=g)).to(dtype) if norm else None
    norm_kw = {"block_norm_weight": w, "block_norm_eps": 1e-6} if norm else {}
    c_in, post_kw = (logits0, {"sinkhorn_iters": 20, "hc_eps": 1e-6}) if project else (comb0, {})
    y2 = hc_post(streams, out, post0, c_in, **post_kw)
    two = (y2,) + hc_pre(y2, fn, base, scale, 20, 1e-6, 1e-6, sinkhorn=not project, **norm_kw)
    pairs_two = [t.clone() for t in _kept_pairs(D // 16, streams.device)] if norm and B == 1 else []
    one = hc_post_pre(streams, out, post0, c_in, fn, base, scale, 20, 1e-6, 1e-6, sinkhorn=not project,
                      sinkhorn_iters=post_kw.get("sinkhorn_iters", 0), post_eps=post_kw.get("hc_eps", 0.0), **norm_kw)
    pairs_one = [t.clone() for t in _kept_pairs(D // 16, streams.device)] if norm and B == 1 else []
    fused[name] = {"splits": mhc_fused.pre_split(B, hc * D)[3],
                   "bitwise": one is not None and all(torch.equal(a, b) for a, b in zip(one, two)),
                   "pairs_bitwise": all(torch.equal(a, b) for a, b in zip(pairs_one, pairs_two)),
                   "pairs_checked": len(pairs_one),
                   "streams_vs_reference": diff(one[0], HyperConnection.expand(streams, out, post0, comb0))}
fused["declines"] = [post_pre_fits(torch.zeros(1, 1, 4, 64)),      # chunk of 256 > D: across streams
                     post_pre_fits(torch.zeros(1, 16, 4, 256)),    # 16 tokens: blocks of several rows
                     post_pre_fits(torch.zeros(1, 1, 4, 256))]     # fits
res["_post_pre"] = fused
print("RESULT" + json.dumps(res))
