"""The decode glue kernels (dsv4lab/kernels/norm_rope.py, router_topk.py) through Triton's
interpreter on CPU tensors against their references (``norm_rope_ref``, ``rms_norm``, ``route``):
run by tests/test_glue_kernels.py in a subprocess with TRITON_INTERPRET=1 (set before triton is
imported). Prints one line ``RESULT{json}``: per case the violations of the stated tolerance and
the max |kernel - reference|, or whether ids / values are equal.
"""
import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dsv4lab.kernels.norm_rope import NORM_NONE, NORM_PLAIN, NORM_WEIGHTED, launch_norm_pair, launch_norm_rope  # noqa: E402
from dsv4lab.kernels.norm_rope_ref import norm_rope_ref  # noqa: E402
from dsv4lab.kernels.host import counters  # noqa: E402
from dsv4lab.kernels.gate_route import gate_route_takes, gate_route_triton  # noqa: E402
from dsv4lab.kernels.linear_plain import launch_plain_gemv, plain_split  # noqa: E402
from dsv4lab.kernels.router_topk import route_triton  # noqa: E402
from dsv4lab.model.moe import route  # noqa: E402
from dsv4lab.model.norms import rms_norm  # noqa: E402

g = torch.Generator().manual_seed(0)
res = {}
EPS = 1e-6


def err(y, r, dtype=None, fp8=False):
    """Tolerance: |y - r| <= u * |r| + 2u * max|r| per element, u = 2^-7 where the math rounds to
    bf16 (``dtype``, default r's), 1e-6 in fp32: one ulp of the value plus two of the largest (the
    norm's fp32 sum runs in another order, so a normalised value may round one ulp apart, and RoPE
    subtracts products of two such values). kv_fp8 channels (``fp8``): u = 2^-3, one e4m3 step,
    since one ulp before the round trip can cross an e4m3 rounding boundary."""
    u = 2.0 ** -3 if fp8 else 2.0 ** -7 if (dtype or r.dtype) == torch.bfloat16 else 1e-6
    y, r = y.float(), r.float()
    bad = (y - r).abs() > u * r.abs() + 2 * u * r.abs().max()
    return {"bad": int(bad.sum()), "max_abs": (y - r).abs().max().item(), "exact": bool(torch.equal(y, r))}


inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))  # rope dim 8 of head dim 24 / 80
pos = torch.tensor([3, 1000, 77777])
for dt in (torch.float32, torch.bfloat16):
    # q heads: [B=2, S=3, H=5 (not a power of two), D=24]
    q = (torch.randn(2, 3, 5, 24, generator=g) * 3).to(dt)
    res[f"q_{str(dt)[6:]}"] = err(launch_norm_rope(q, dt, norm=NORM_PLAIN, eps=EPS, positions=pos, inv_freq=inv),
                                  norm_rope_ref(q, pos, inv, EPS))
    # kv: one head of 80 (72 non-RoPE channels: one full and one partial kv_fp8 block), weighted
    kv = (torch.randn(2, 3, 1, 80, generator=g) * 2).to(dt)
    kv[0, 0, 0, :64] *= 1e-4  # a block whose amax hits the 1e-4 floor
    w = (torch.rand(80, generator=g) + 0.5).to(dt)
    for fp8 in (False, True):
        res[f"kv_{str(dt)[6:]}_fp8{fp8}"] = err(
            launch_norm_rope(kv, dt, norm=NORM_WEIGHTED, eps=EPS, weight=w, positions=pos, inv_freq=inv, fp8_nope=fp8),
            norm_rope_ref(kv, pos, inv, EPS, w, fp8_nope=fp8), fp8=fp8)
    # ... also written into the decode ring [B, W=5, 80] at positions % W (slots 3, 0, 2): the same
    # bits as the launch without the ring, and the ring's other slots untouched
    ring = torch.randn(2, 5, 80, generator=g).to(dt)
    before = ring.clone()
    plain = launch_norm_rope(kv, dt, norm=NORM_WEIGHTED, eps=EPS, weight=w, positions=pos, inv_freq=inv, fp8_nope=True)
    got = launch_norm_rope(kv, dt, norm=NORM_WEIGHTED, eps=EPS, weight=w, positions=pos, inv_freq=inv, fp8_nope=True,
                           ring=ring)
    slots = pos % 5
    others = [i for i in range(5) if i not in slots.tolist()]
    res[f"ring_{str(dt)[6:]}"] = {"same_y": bool(torch.equal(got, plain)),
                                  "ring_rows": bool(torch.equal(ring[:, slots], plain.squeeze(-2))),
                                  "others_kept": bool(torch.equal(ring[:, others], before[:, others]))}
    # the kv_fp8 round trip alone (position 0: cos 1, sin 0, RoPE exact): bit-exact
    p0 = torch.zeros(3, dtype=torch.long)
    res[f"fp8_{str(dt)[6:]}"] = err(launch_norm_rope(kv, dt, norm=NORM_NONE, positions=p0, inv_freq=inv, fp8_nope=True),
                                    norm_rope_ref(kv, p0, inv, fp8_nope=True))
    # inverse RoPE of the attention output (no norm)
    unrope = launch_norm_rope(q, dt, norm=NORM_NONE, positions=pos, inv_freq=inv, inverse=True)
    res[f"unrope_{str(dt)[6:]}"] = err(unrope, norm_rope_ref(q, pos, inv, inverse=True))
    # ... in place (only the RoPE channels read and rewritten, in x's storage): the same bits
    xq = q.clone()
    got = launch_norm_rope(xq, dt, norm=NORM_NONE, positions=pos, inv_freq=inv, inverse=True, inplace=True)
    res[f"unrope_inplace_{str(dt)[6:]}"] = {**err(got, norm_rope_ref(q, pos, inv, inverse=True)),
                                            "equal_out_of_place": torch.equal(got, unrope),
                                            "in_x": got.data_ptr() == xq.data_ptr() and torch.equal(xq, got)}
    # q_norm: weighted RMSNorm over 40 channels, weight in fp32 with bf16 x (promoted output)
    x = (torch.randn(2, 3, 40, generator=g) * 4).to(dt)
    for wdt in (dt, torch.float32):
        wq = (torch.rand(40, generator=g) + 0.5).to(wdt)
        ref = rms_norm(x, wq, EPS)
        got = launch_norm_rope(x.unsqueeze(-2), ref.dtype, norm=NORM_WEIGHTED, eps=EPS, weight=wq).squeeze(-2)
        res[f"qnorm_{str(dt)[6:]}_w{str(wdt)[6:]}"] = {**err(got, ref, dt), "dtype_ok": got.dtype == ref.dtype}

# a one-row RMSNorm (decode) writes its output's x_pairs rows: the bits x_pairs computes from the
# output, and x_pairs of the output (or a view of all of it) then launches nothing until the output
# changes or another row's pairs take the buffers
from dsv4lab.kernels import activation_pairs  # noqa: E402

for dt in (torch.float32, torch.bfloat16):
    x = (torch.randn(1, 1, 1536, generator=g) * 3).to(dt)
    wq = (torch.rand(1536, generator=g) + 0.5).to(dt)
    y = launch_norm_rope(x, dt, norm=NORM_WEIGHTED, eps=EPS, weight=wq, one_head=True)
    gen = dict(activation_pairs._PAIRS_GEN)
    xp, xinv = activation_pairs.x_pairs(y)
    xp_v, _ = activation_pairs.x_pairs(y.view(-1, 1536))
    skipped = activation_pairs._PAIRS_GEN == gen
    emitted = (xp.clone(), xinv.clone())
    rp, rinv = activation_pairs.x_pairs(y.clone())  # another address: launched, the reference bits
    res[f"pairs_{str(dt)[6:]}"] = {"skipped": skipped, "same_buffers": xp_v is xp,
                                   "rows_equal": bool(torch.equal(emitted[0], rp)),
                                   "inv_equal": bool(torch.equal(emitted[1], rinv))}
    y2 = launch_norm_rope(x, dt, norm=NORM_WEIGHTED, eps=EPS, weight=wq, one_head=True)
    y2.mul_(2)                                     # changed after the launch: pairs made afresh
    gen = dict(activation_pairs._PAIRS_GEN)
    p2, _ = activation_pairs.x_pairs(y2)
    want, _ = activation_pairs.x_pairs(y2.clone())
    res[f"pairs_{str(dt)[6:]}"]["changed_relaunched"] = (activation_pairs._PAIRS_GEN != gen
                                                         and bool(torch.equal(p2, want)))
    # the decode's inverse RoPE in place over whole rows [1, 1, H=32, D=32] (H * D / 16 = 64 groups):
    # the bits of the out-of-place launch, written into x, and the row's pairs for the grouped wo_a
    o = (torch.randn(1, 1, 32, 32, generator=g) * 2).to(dt)
    want = launch_norm_rope(o, dt, norm=NORM_NONE, positions=pos[:1], inv_freq=inv, inverse=True)
    oo = o.clone()
    got = launch_norm_rope(oo, dt, norm=NORM_NONE, positions=pos[:1], inv_freq=inv, inverse=True, inplace=True)
    gen = dict(activation_pairs._PAIRS_GEN)
    xp, xinv = activation_pairs.x_pairs(got.reshape(1, 1, 2, 512)[0, 0].contiguous().reshape(1, 1024))
    skipped = activation_pairs._PAIRS_GEN == gen
    emitted = (xp.clone(), xinv.clone())
    rp, rinv = activation_pairs.x_pairs(got.clone())
    res[f"unrope_pairs_{str(dt)[6:]}"] = {"same_y": bool(torch.equal(got, want)), "in_x": got.data_ptr() == oo.data_ptr(),
                                          "skipped": skipped,
                                          "rows_equal": bool(torch.equal(emitted[0], rp)),
                                          "inv_equal": bool(torch.equal(emitted[1], rinv))}
    # q_norm of a [1, 1, 1536] and kv_norm + RoPE + kv_fp8 of kv [1, 1, 1, 80] into a ring [1, W=5, 80] as
    # one launch (launch_norm_pair): each output the bits of its own launch (the interpreter has no
    # warps), q_res's pairs emitted, kv written at slot pos % W, the other slots kept; declined (None)
    # for two rows
    a = (torch.randn(1, 1, 1536, generator=g) * 3).to(dt)
    wq = (torch.rand(1536, generator=g) + 0.5).to(dt)
    kv1 = (torch.randn(1, 1, 1, 80, generator=g) * 2).to(dt)
    w = (torch.rand(80, generator=g) + 0.5).to(dt)
    p1 = pos[2:3]
    want_q = launch_norm_rope(a, dt, norm=NORM_WEIGHTED, eps=EPS, weight=wq, one_head=True)
    want_kv = launch_norm_rope(kv1, dt, norm=NORM_WEIGHTED, eps=EPS, weight=w, positions=p1, inv_freq=inv,
                               fp8_nope=True)
    ring = torch.randn(1, 5, 80, generator=g).to(dt)
    before = ring.clone()
    got_q, got_kv = launch_norm_pair(a, wq, EPS, kv1, w, EPS, p1, inv, True, ring)
    gen = dict(activation_pairs._PAIRS_GEN)
    xp, xinv = activation_pairs.x_pairs(got_q)
    skipped = activation_pairs._PAIRS_GEN == gen
    rp, rinv = activation_pairs.x_pairs(got_q.clone())
    slot = int(p1) % 5
    res[f"norm_pair_{str(dt)[6:]}"] = {
        "q_equal": bool(torch.equal(got_q, want_q)), "kv_equal": bool(torch.equal(got_kv, want_kv)),
        "ring_row": bool(torch.equal(ring[0, slot], want_kv.reshape(80))),
        "others_kept": bool(torch.equal(ring[0, [i for i in range(5) if i != slot]],
                                        before[0, [i for i in range(5) if i != slot]])),
        "pairs_skipped": skipped, "pairs_equal": bool(torch.equal(xp, rp) and torch.equal(xinv, rinv)),
        "declines_two_rows": launch_norm_pair(a.expand(2, 1, 1536).contiguous(), wq, EPS, kv1, w, EPS, p1, inv,
                                              True, ring) is None}

T, E = 7, 40  # E not a power of two
for scoring in ("sqrtsoftplus", "sigmoid", "softmax"):
    for dt in (torch.float32, torch.bfloat16):
        logits = (torch.randn(T, E, generator=g) * 2).to(dt)
        bias = torch.randn(E, generator=g) * 0.1
        ri, rw = route(logits, 6, scoring, 1.5, bias)
        ki, kw = route_triton(logits, 6, scoring, 1.5, bias)
        rs, order = ri.sort(1)
        ks, korder = ki.sort(1)
        res[f"topk_{scoring}_{str(dt)[6:]}"] = {"ids_equal": bool(torch.equal(rs, ks)),
                                                "w_max_rel": ((kw.gather(1, korder) - rw.gather(1, order)).abs() / rw.abs().max()).max().item()}
        tid = torch.stack([torch.randperm(E, generator=g)[:6] for _ in range(30)])
        toks = torch.randint(0, 30, (1, T), generator=g)
        ri, rw = route(logits, 6, scoring, 1.5, None, tid, toks)
        ki, kw = route_triton(logits, 6, scoring, 1.5, None, tid, toks)
        res[f"hash_{scoring}_{str(dt)[6:]}"] = {"ids_equal": bool(torch.equal(ri, ki)),
                                                "w_max_rel": ((kw - rw).abs() / rw.abs().max()).max().item()}
# ties: equal scores + bias; the lowest ids win, written as torch.topk's CUDA kernel writes them
# (above the k-th value in ascending id, then the k-th values in ascending id)
bias = torch.tensor([0.0, 1, 0, 0, 1, 0, 0, 0])
ids, w = route_triton(torch.zeros(2, 8), 4, "sigmoid", 1.0, bias)
res["ties"] = {"ids": ids.tolist(), "w": w.tolist()}
# the gate GEMV and the route in one launch: bitwise plain_gemv then route_triton (ids, their order,
# weights), split K (V4-Pro's router: 384 x 7168, 7 splits) and one split, top-k and hash, 1 and 3 tokens
for (E, D), M, scoring, hashed in (((384, 7168), 1, "sqrtsoftplus", False), ((384, 7168), 3, "sigmoid", True),
                                   ((40, 256), 1, "softmax", False), ((40, 256), 3, "sqrtsoftplus", True),
                                   ((40, 256), 2, "sigmoid", False)):
    x = torch.randn(M, D, generator=g).to(torch.bfloat16)
    w = (torch.randn(E, D, generator=g) * D ** -0.5).to(torch.bfloat16)
    bias = torch.randn(E, generator=g) * 0.1
    tid = torch.stack([torch.randperm(E, generator=g)[:6] for _ in range(30)])
    toks = torch.randint(0, 30, (1, M), generator=g)
    choice = (None, tid, toks) if hashed else (bias, None, None)
    ri, rw = route_triton(launch_plain_gemv(x, w), 6, scoring, 2.5, *choice)
    ki, kw = gate_route_triton(x, w, 6, scoring, 2.5, *choice)
    tiles = -(-E // 8)
    res[f"gate_route_{E}_{M}_{scoring}_{hashed}"] = {
        "split": plain_split(E, D)[1], "ids_equal": bool(torch.equal(ri, ki)), "w_equal": bool(torch.equal(rw, kw)),
        "counters_zero": int(counters(x.device, tiles + 1)[:tiles + 1].abs().sum()) == 0}
res["gate_route_takes"] = [gate_route_takes(torch.zeros(5, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16), 2, "sigmoid"),
                           gate_route_takes(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 64), 2, "sigmoid"),
                           gate_route_takes(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16), 9, "sigmoid"),
                           gate_route_takes(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16), 2, "tanh"),
                           gate_route_takes(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16), 8, "softmax")]
print("RESULT" + json.dumps(res))
