"""The unquantised (bf16 / fp16) decode GEMV ``QLinear.plain_kernel`` (dsv4lab/kernels/linear_plain.py,
dispatched by ``plain_linear``) against ``F.linear``.

CPU: the kernel through Triton's interpreter (tests/plain_gemv_interp_check.py): ragged N and K,
one and several K splits, 1..4 rows, bf16 / fp16 / fp32; ``plain_linear`` on CPU is ``F.linear``
bit for bit; ``QLinear`` takes the slot only where no autograd graph is built.
GPU (@pytest.mark.gpu): V4-Pro's bf16 decode shapes (K = 7168; N = 1024 compressor, 256 indexer
compressor, 64 weights_proj, 384 router), deterministic, CUDA-graph replay equal to eager, and the
installed slot on a bf16 QLinear.

The batched launch (``plain_gemv_batch``: several weights of one x, ``Attention.plain_batch_kernel``):
each output bit for bit its single launch (interpreter and GPU), and in the model the attention
offers the outputs to its compressors' and indexer's linears (``QLinear.offer``): the decode is
unchanged, the linears do not run again, their forward hooks see the offered tensor, a pre-hook
that replaces x makes its linear compute afresh, and no offer outlives the step.

Tolerance: the kernel sums the exact products in fp32 in its own order, then rounds once to x's
dtype, so |kernel - fp64| <= one step of the output dtype (2^-7 relative in bf16: the interpreter's
fp32 -> bf16 cast truncates; 2^-11 in fp16, 2^-24 in fp32) of max|fp64| plus the fp32 sum's error
(about K * 2^-24 of the products' magnitude, bounded here by 1e-5 of max|fp64|).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv4lab.kernels.device import triton_importable
from dsv4lab.kernels.dispatch import PLAIN_GEMV_MAX_N, plain_linear, plain_linear_batch
from dsv4lab.model.linear import QLinear
from oracle_util import graph_equals_eager, interp_check_result

UNIT = {"bf16": 2.0 ** -7, "f16": 2.0 ** -11, "f32": 2.0 ** -24}
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and triton_importable()), reason="needs CUDA + triton")


def test_interp_plain_gemv_matches_fp64():
    res = interp_check_result("plain_gemv_interp_check.py")
    assert len(res) == 6
    for case, v in res.items():
        unit = next(u for k, u in UNIT.items() if f"_{k}" in case)
        assert v["rel"] <= unit + 1e-5, (case, v)
        assert v["deterministic"] and v["shape_ok"] and v["dtype_ok"], (case, v)
    assert res["m1_bf16_split"]["splits"] == 3 and res["m4_f16_one_split"]["splits"] == 1
    assert res["m1_bf16_rule"]["splits"] == 1 and res["m1_bf16_long_k"]["splits"] > 1


def test_interp_plain_gemv_batch_is_the_single_launch_bit_for_bit():
    res = interp_check_result("plain_gemv_batch_interp_check.py")
    assert len(res) == 6
    for case, v in res.items():
        unit = next(u for k, u in UNIT.items() if f"_{k}" in case)
        assert v["bitwise_single"] and v["deterministic"] and v["shapes_ok"] and v["contiguous"], (case, v)
        assert v["rel"] <= unit + 1e-5, (case, v)
    assert res["mixed_split_m1_bf16"]["splits"] == [2, 1]                  # a split and an unsplit weight
    assert res["three_m4_bf16_short_k"]["splits"] == [1, 1, 1] and res["five_m1_bf16"]["splits"][0] > 1


def test_plain_gemv_batch_refuses_what_it_cannot_take():
    from dsv4lab.kernels.linear_plain import plain_gemv_batch

    x = torch.zeros(1, 64)
    with pytest.raises(ValueError, match="plain_gemv_batch: needs 1..5 weights.*\\(8, 32\\)"):
        plain_gemv_batch(x, [torch.zeros(8, 64), torch.zeros(8, 32)])       # K mismatch in the second
    with pytest.raises(ValueError, match="1..5 weights"):
        plain_gemv_batch(x, [torch.zeros(8, 64)] * 6)
    with pytest.raises(ValueError, match="contiguous rows"):
        plain_gemv_batch(x, [torch.zeros(8, 128)[:, :64]])                   # row stride 128 for K = 64
    assert plain_linear_batch(x, [torch.zeros(8, 64)] * 2) is None        # CPU: the callers run each linear


def _offering_layer(seed: int = 4):
    """A tiny model's CSA attention (layer 1) with counting ``plain_kernel`` slots (F.linear) on its
    batchable linears and a counting ``plain_batch_kernel`` (F.linear per weight) on the attention."""
    from dsv4lab.workbench import random_model
    from oracle_util import random_ids, tiny_config

    cfg = tiny_config()
    m = random_model(cfg, seed=seed)
    attn = m.layers[1].attn
    single, batches = [], []
    for lin in attn.plain_batch_members():
        lin.plain_kernel = lambda xx, ww, lin=lin: single.append(lin) or F.linear(xx, ww)

    def batch(x, weights):
        batches.append(len(weights))
        return [F.linear(x, w) for w in weights]

    return m, attn, random_ids(cfg, n=14, b=2), single, batches, batch


def test_attention_offers_batched_projections_to_its_linears():
    from oracle_util import decode_logits

    m, attn, ids, single, batches, batch = _offering_layer()
    members = attn.plain_batch_members()
    assert [id(x) for x in members] == [id(attn.compressor.wkv), id(attn.compressor.wgate),
                                        id(attn.indexer.compressor.wkv), id(attn.indexer.compressor.wgate),
                                        id(attn.indexer.weights_proj)]
    ref = decode_logits(m, ids, steps=4)
    n_ref = len(single)
    assert n_ref > 0 and not batches
    attn.plain_batch_kernel = batch
    seen = []
    with attn.compressor.wkv.register_forward_hook(lambda mod, inp, out: seen.append(out)):
        got = decode_logits(m, ids, steps=4)
    assert torch.equal(got, ref)                       # F.linear either way: the same logits
    assert batches == [5] * 4                          # one batch of the five linears a decode step
    # prefill ran the linears itself (same count as before); decode took every offer
    assert len(single) == 2 * n_ref - 4 * 5
    assert len(seen) == 1 + 4                          # the hook fired in prefill and on every offer taken
    assert all(lin._offered is None for lin in members)


def test_offer_goes_to_the_same_x_only_and_never_outlives_the_step():
    from oracle_util import decode_logits

    m, attn, ids, single, batches, batch = _offering_layer(seed=5)
    ref = decode_logits(m, ids, steps=3)
    attn.plain_batch_kernel = batch
    single.clear()
    # a pre-hook that replaces x: that linear computes afresh (its offer was for the old x)
    with attn.indexer.weights_proj.register_forward_pre_hook(lambda mod, inp: (inp[0].clone(),)):
        got = decode_logits(m, ids, steps=3)
    assert torch.equal(got, ref)
    assert sum(lin is attn.indexer.weights_proj for lin in single) >= 3 + 1   # prefill + every decode step
    # a disabled indexer takes nothing from weights_proj: it is not batched, and no offer stays behind
    attn.indexer.enabled = False
    try:
        assert attn.indexer.weights_proj not in attn.plain_batch_members()
        batches.clear()
        decode_logits(m, ids, steps=2)
        assert batches == [4, 4]
        assert all(lin._offered is None for lin in (attn.compressor.wkv, attn.indexer.weights_proj))
    finally:
        attn.indexer.enabled = True
    # a quantised-activation mode (w4a8) is not batchable: every linear runs itself
    attn.compressor.wkv.set_mode("w4a8")
    assert attn.compressor.wkv.batchable(torch.zeros(1, 1, attn.compressor.wkv.in_features)) is None


def test_plain_gemv_refuses_what_it_cannot_take():
    from dsv4lab.kernels.linear_plain import plain_gemv

    with pytest.raises(ValueError, match="plain_gemv: needs x.*got x \\(1, 64\\)"):
        plain_gemv(torch.zeros(1, 64), torch.zeros(8, 32))            # K mismatch
    with pytest.raises(ValueError, match="at most 4 rows"):
        plain_gemv(torch.zeros(5, 64), torch.zeros(8, 64))


def test_plain_linear_on_cpu_is_f_linear_and_slot_respects_autograd():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1, 64, generator=g).bfloat16()
    w = torch.randn(24, 64, generator=g).bfloat16()
    assert torch.equal(plain_linear(x, w), F.linear(x, w))
    lin = QLinear(64, 24)
    lin.set_weight(w)
    calls = []
    lin.plain_kernel = lambda xx, ww: calls.append(1) or F.linear(xx, ww)
    with torch.no_grad():
        lin(x)
    assert calls == [1]
    lin.weight.requires_grad_(True)
    y = lin(x)                       # grad mode, a trainable weight: the reference, differentiable
    assert calls == [1] and y.requires_grad


def test_install_puts_plain_linear_on_plain_linears(monkeypatch):
    """With CUDA faked, install_kernels gives every unquantised QLinear (a Router too) the
    ``plain_kernel`` slot; components() labels a plain one ``kernel:plain_linear`` and a router by its
    route kernel; on CPU the slot is F.linear, so the model is bitwise unchanged; uninstall clears it."""
    from dsv4lab.analysis.components import impl_label
    from dsv4lab.kernels import install
    from dsv4lab.model.moe import Router
    from dsv4lab.workbench import random_model
    from oracle_util import random_ids, tiny_config

    cfg = tiny_config()
    m = random_model(cfg, seed=2)
    ids = random_ids(cfg, n=8, b=1)
    with torch.no_grad():
        ref = m(ids)
    monkeypatch.setattr(install, "have_triton_cuda", lambda: True)
    monkeypatch.setattr(install, "_on_cuda", lambda t: t is not None)
    plain = [mod for mod in m.modules() if isinstance(mod, QLinear) and mod.qweight is None]
    assert plain and install.install_kernels(m, "**") > 0
    assert all(mod.plain_kernel is plain_linear for mod in plain)
    routers = [mod for mod in plain if isinstance(mod, Router)]
    assert routers and all(impl_label(r) == "kernel:route" for r in routers)
    assert any(impl_label(mod) == "kernel:plain_linear" for mod in plain if not isinstance(mod, Router))
    with torch.no_grad():
        assert torch.equal(m(ids), ref)
    install.install_kernels(m, "**", enable=False)
    assert all(mod.plain_kernel is None for mod in plain)


def _v4_pro_weights(dev, g):
    return {n: (torch.randn(n, 7168, device=dev, generator=g) * 7168 ** -0.5).bfloat16() for n in (1024, 256, 64, 384)}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("M", [1, 4])
def test_gpu_plain_gemv_v4_pro_shapes(M):
    from dsv4lab.kernels.linear_plain import plain_gemv

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(M)
    x = torch.randn(M, 1, 7168, device=dev, generator=g).bfloat16()
    for n, w in _v4_pro_weights(dev, g).items():
        want = F.linear(x.double(), w.double())
        got = plain_gemv(x, w)
        assert ((got.double() - want).abs().max() / want.abs().max()).item() <= UNIT["bf16"] + 1e-5, n
        assert torch.equal(plain_gemv(x, w), got), n             # deterministic
        if n <= PLAIN_GEMV_MAX_N:                                 # the dispatcher takes it at decode rows
            assert torch.equal(plain_linear(x, w), got), n
        else:                                                     # wide weights stay on cuBLAS
            assert torch.equal(plain_linear(x, w), F.linear(x, w)), n
    w = _v4_pro_weights(dev, g)[1024]
    assert graph_equals_eager(plain_gemv, x, w)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("M", [1, 4])
def test_gpu_plain_gemv_batch_v4_pro_shapes(M):
    """A V4-Pro CSA layer's five projections of x (compressor 2 x 1024, indexer compressor 2 x 256,
    weights_proj 64) and an HCA layer's two (2 x 512) in one launch: each the bits of its single
    launch and of ``plain_linear``; CUDA-graph replay equal to eager."""
    from dsv4lab.kernels.linear_plain import plain_gemv, plain_gemv_batch

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(10 + M)
    x = torch.randn(M, 1, 7168, device=dev, generator=g).bfloat16()
    for ns in ((1024, 1024, 256, 256, 64), (512, 512)):
        ws = [(torch.randn(n, 7168, device=dev, generator=g) * 7168 ** -0.5).bfloat16() for n in ns]
        got = plain_gemv_batch(x, ws)
        assert [tuple(y.shape) for y in got] == [(M, 1, n) for n in ns]
        for y, w in zip(got, ws):
            assert torch.equal(y, plain_gemv(x, w)) and torch.equal(y, plain_linear(x, w))
        assert all(torch.equal(a, b) for a, b in zip(plain_linear_batch(x, ws), got))
    assert graph_equals_eager(plain_gemv_batch, x, ws)


@pytest.mark.gpu
@gpu
def test_gpu_bf16_qlinear_gets_plain_slot():
    from dsv4lab.analysis.components import impl_label
    from dsv4lab.kernels.install import install_kernels

    lin = QLinear(7168, 64)
    lin.set_weight(torch.randn(64, 7168).bfloat16())
    lin = lin.cuda()
    assert install_kernels(lin) == 1 and lin.plain_kernel is plain_linear
    assert impl_label(lin) == "kernel:plain_linear"
    x = torch.randn(1, 1, 7168, device="cuda").bfloat16()
    with torch.no_grad():
        assert (lin(x).float() - F.linear(x, lin.weight).float()).abs().max().item() <= 2 ** -7 * lin(x).float().abs().max().item()
        xp = torch.randn(1, 600, 7168, device="cuda").bfloat16()
        assert torch.equal(lin(xp), F.linear(xp, lin.weight))   # prefill rows stay on cuBLAS


def test_attention_pairs_each_compressors_wkv_and_wgate_in_decode():
    """Quantised compressor projections (V4-Pro's NVFP4 export) are not in the plain batch: decode
    runs each compressor's wkv and wgate of x as one ``quant_pair_kernel`` launch (a counting
    F.linear pair here) and offers each its output: the same logits, two pairs a CSA decode step
    (compressor, indexer compressor), one an HCA step, and no offer left behind."""
    from dsv4lab.precision.quantize import quantize_linears
    from dsv4lab.workbench import random_model
    from oracle_util import decode_logits, random_ids, tiny_config

    cfg = tiny_config()
    m = random_model(cfg, seed=8)
    quantize_linears(m, fmt="nvfp4", pattern="layers.*.attn.**.w[kg]*")
    pairs = []

    def pair(x, wa, wb):
        pairs.append((x.shape[1], wa.shape[0]))
        return F.linear(x, wa.dequantize(x.dtype)), F.linear(x, wb.dequantize(x.dtype))

    class Own:  # the slot whose outputs the pair reproduces (dispatch.quant_linear's role)
        pairs_with = staticmethod(pair)

        def __call__(self, x, w):
            return F.linear(x, w.dequantize(x.dtype))

    comps = {}
    for i, layer in enumerate(m.layers):
        attn = layer.attn
        cs = [c for c in (attn.compressor, attn.indexer.compressor if attn.indexer is not None else None) if c]
        for c in cs:
            assert c.wkv.qweight is not None and c.wgate.qweight is not None
            c.wkv.kernel = c.wgate.kernel = Own()
        comps[i] = cs
    ids = random_ids(cfg, n=12, b=1)
    ref = decode_logits(m, ids, steps=3)
    for layer in m.layers:
        layer.attn.quant_pair_kernel = pair
    got = decode_logits(m, ids, steps=3)
    assert torch.equal(got, ref)
    per_step = sum(len(cs) for cs in comps.values())
    assert per_step == 5 and len(pairs) == 3 * per_step          # 2 CSA layers x 2 pairs + 1 HCA, each decode step
    assert all(n == 1 for n, _ in pairs)                          # decode only (prefill pools its own way)
    assert all(c.wkv._offered is None and c.wgate._offered is None for cs in comps.values() for c in cs)


def test_attention_pairs_wq_a_and_wkv_of_one_decode_token():
    """Decode runs wq_a and wkv of x as one ``quant_pair_kernel`` launch (a counting F.linear pair
    here) and offers each its output: the same logits, one pair a decode step, neither linear's own
    kernel called in decode, and no offer left behind; a linear whose kernel the pair does not
    reproduce (no ``pairs_with``) keeps the two launches."""
    from dsv4lab.kernels import dispatch
    from dsv4lab.precision.quantize import quantize_linears
    from dsv4lab.workbench import random_model
    from oracle_util import decode_logits, random_ids, tiny_config

    cfg = tiny_config()
    m = random_model(cfg, seed=6)
    quantize_linears(m, fmt="nvfp4", pattern="layers.1.attn.w*")
    attn = m.layers[1].attn
    assert attn.wq_a.qweight is not None and attn.wkv.qweight is not None
    own, pairs = [], []

    def pair(x, wa, wb):
        pairs.append(x.shape)
        return F.linear(x, wa.dequantize(x.dtype)), F.linear(x, wb.dequantize(x.dtype))

    class Own:  # the slot whose outputs the pair reproduces (dispatch.quant_linear's role)
        pairs_with = staticmethod(pair)

        def __call__(self, x, w):
            own.append(x.shape)
            return F.linear(x, w.dequantize(x.dtype))

    attn.wq_a.kernel = attn.wkv.kernel = Own()
    attn.norm_kernel, attn.rope_kernel = dispatch.rms_norm, dispatch.norm_rope  # the fused rows (CPU reference)
    ids = random_ids(cfg, n=12, b=1)
    ref = decode_logits(m, ids, steps=3)
    n_own = len(own)
    attn.quant_pair_kernel = pair
    got = decode_logits(m, ids, steps=3)
    assert torch.equal(got, ref)
    # the prompt ([1, 9, D]: this stand-in takes it; the GPU pair declines more than one token) and 3 steps
    assert [s[1] for s in pairs] == [9, 1, 1, 1]
    assert len(own) == n_own                           # every offer taken: neither linear ran itself
    assert attn.wq_a._offered is None and attn.wkv._offered is None
    xq = torch.zeros(1, 1, cfg.hidden_size)
    assert dispatch.quant_linear_pair(xq, attn.wq_a.qweight, attn.wkv.qweight) is None   # CPU: each runs itself
    attn.wkv.kernel = dispatch.quant_linear            # pairs with another kernel: not with this one
    assert attn.wkv.pair_weight(torch.zeros(1, 1, cfg.hidden_size), pair) is None
    pairs.clear()
    decode_logits(m, ids, steps=2)
    assert not pairs
