"""The bounded prefill attention kernel (dsv4lab/kernels/attention_bounded.py) against its
reference ``dsv4lab.model.bounded_attention.bounded_attention``, and the ``Attention.kernel`` slot.

CPU: the kernel through Triton's interpreter in a subprocess (tests/attention_interp_check.py:
sliding, HCA, CSA; a first chunk and one after prior window keys; 5 heads, Dh 24).
GPU (@pytest.mark.gpu): V4-Pro head shapes (128 x 512, window 128, top-k 1024) in bf16.

Tolerances: fp32 |kernel - ref| <= 1e-5 * max(1, max|ref|) (online softmax, another order);
bf16 <= 2e-2 * max|ref|: each side rounds P to bf16 per key tile against its own running maximum
(tiles of 5 vs 16 keys) and the output once; measured up to 2 ulps (0.0156 at max|ref| 1.7).
"""
from __future__ import annotations


import pytest
import torch

from dsv4lab.kernels.install import install_kernels
from dsv4lab.model.attention import Attention
from dsv4lab.model.bounded_attention import bounded_attention
from dsv4lab.quant.modes import RoundTrip
from dsv4lab.workbench import random_model
from oracle_util import interp_check_result, random_ids, tiny_config

def test_interp_bounded_attention_matches_reference():
    res = interp_check_result("attention_interp_check.py")
    assert len(res) == 13
    for case, v in res.items():
        tol = 1e-5 * max(1.0, v["ref_max"]) if "float32" in case else 2e-2 * v["ref_max"]
        assert v["max_abs"] <= tol, (case, v)


def test_attention_kernel_slot():
    """A callable in ``Attention.kernel`` runs the bounded path (bitwise the reference when it is
    the reference); the blocked path (``probs_bf16``) does not call it; on the CPU install puts
    none there."""
    cfg = tiny_config()
    m = random_model(cfg, seed=2)
    attns = [a for a in m.modules() if isinstance(a, Attention)]
    ids = random_ids(cfg, n=40, b=1)
    assert install_kernels(m) == 0 and all(a.kernel is None for a in attns)
    with torch.no_grad():
        ref = m(ids)
    calls = []

    def kernel(q, *args):
        calls.append(q.shape)
        return bounded_attention(q, *args)

    try:
        for a in attns:
            a.kernel = kernel
        with torch.no_grad():
            assert torch.equal(m(ids), ref)
        assert len(calls) == len(attns)
        calls.clear()
        m.layers[1].attn.round_trips = frozenset({RoundTrip.PROBS_BF16})
        with torch.no_grad():
            m(ids)
        assert len(calls) == len(attns) - 1 and m.layers[1].attn.last_prefill_path == "blocked"
    finally:
        m.layers[1].attn.round_trips = frozenset()
        assert install_kernels(m, enable=False) == len(attns)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_gpu_bounded_attention_v4_pro_shapes(kind):
    from dsv4lab.kernels.dispatch import prefill_attention

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    B, S, H, D, W, start = 1, 512, 128, 512, 128, 4096
    k_start = start - W + 1
    q = torch.randn(B, S, H, D, device=dev, generator=g).bfloat16()
    wk = torch.randn(B, start + S - k_start, D, device=dev, generator=g).bfloat16()
    sink = torch.randn(H, device=dev, generator=g)
    ratio = {"sliding": 0, "hca": 128, "csa": 4}[kind]
    T = (start + S) // ratio if ratio else 0
    ent = torch.randn(B, T, D, device=dev, generator=g).bfloat16() if ratio else None
    sel = None
    if kind == "csa":
        vis = (torch.arange(start, start + S, device=dev) + 1) // ratio
        sc = torch.randn(B, S, T, device=dev, generator=g).masked_fill(torch.arange(T, device=dev) >= vis.view(1, -1, 1), float("-inf"))
        top = sc.topk(1024, dim=-1).indices
        sel = torch.where(top < vis.view(1, -1, 1), top, torch.full_like(top, -1))
    args = (q, sink, D ** -0.5, W, wk, start, k_start, ent, ratio, sel)
    want = bounded_attention(*args).float()
    got = prefill_attention(*args).float()
    assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item()
