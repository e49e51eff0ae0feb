"""The fused mHC kernels (dsv4lab/kernels/mhc_fused.py) against the reference in dsv4lab/model/mhc.py,
and the ``HyperConnection.kernel`` / ``.post_kernel`` / ``HyperHead.kernel`` slots.

CPU: the kernels through Triton's interpreter in a subprocess (tests/mhc_interp_check.py: hc 4, D 64,
B 1..3, one and several splits of hc*D, two token blocks, hc 3 with a ragged D, zero streams (the
RMS eps), saturated logits (the Sinkhorn eps), one Sinkhorn iteration, a collapse in two steps; fp32
and bf16; each also with the block's RMSNorm folded, and one row's x_pairs from the fold); the slots'
wiring at model level (use_kernels on/off, hooks and overriding implementations force the
reference, the CUDA-graph signature sees the slots).
GPU (@pytest.mark.gpu): V4-Pro shapes (hc 4, D 7168, mix 24, 20 Sinkhorn iterations), B 1 and 4 in
bf16 (and T = 64), determinism and CUDA-graph replay, and the tiny model with the slots on.

Stated tolerances (per element; the mixes differ from the reference by fp32 rounding only: the
reference computes F.linear(x * r, fn) by cuBLAS, the kernel r * (x . fn) in its own order):
* pre, post, comb (fp32, values in [0, 2]): |kernel - ref| <= 2e-5 (observed under the interpreter:
  <= 5e-7 at these shapes, <= 3e-6 at V4-Pro shapes, where the hc*D = 28672 sums are longer);
* collapsed and the new streams in fp32: |kernel - ref| <= 1e-6 * max|ref| (a sum of hc products);
* collapsed in bf16: at most one bf16 rounding step apart, |kernel - ref| <= 2^-7 |ref| (+ 1e-5 *
  max|ref| on the GPU for cancelling sums): the same fp32 sum is rounded once, a pre that differs
  in its last fp32 bit can move it across a rounding boundary. Bitwise equal in every interpreter case
  here; at V4-Pro shapes (interpreter) 0.03 % (B 1) to 0.09 % (head, B 4) of the elements moved one step;
* new streams in bf16 (same post / comb given): the reference's rounding points are kept (post and
  comb cast to bf16, post*out rounded, comb^T.streams rounded, the sum rounded); the freedom is the
  sum inside the matmul (the kernel: hc exact products in fp32, one rounding; cuBLAS's batched bf16
  GEMM promises no fp32 sums and was 1.5 steps off once at 4096 tokens), so |kernel - ref| <=
  2^-7 (|ref| + 2 |comb^T.streams|). Bitwise equal under the interpreter (CPU matmul sums in stream order).
"""
from __future__ import annotations

import pytest
import torch

from dsv4lab.analysis.components import components, use_kernels
from dsv4lab.bugzoo.variants import MHCCombNotTransposed, MHCPreNoEps
from dsv4lab.decode.graphs import model_signature
from dsv4lab.kernels import install
from dsv4lab.kernels.device import triton_importable
from dsv4lab.kernels.dispatch import mhc_head_pre, mhc_post, mhc_pre, rms_norm
from dsv4lab.model.mhc import HyperConnection, PendingSinkhorn, collapse, head_weights, mix_logits, mix_weights
from dsv4lab.workbench import random_model
from dsv4lab.model.norms import RMSNorm
from oracle_util import Counting, decode_logits, interp_check_result, random_ids, tiny_config

BF16_STEP = 2.0 ** -7  # one bf16 rounding step, relative to the value
pytestmark = pytest.mark.usefixtures("one_thread")


def test_interp_mhc_kernels_match_reference():
    assert triton_importable(), "triton is part of the test set-up (pip install -e '.[kernels]')"
    res = interp_check_result("mhc_interp_check.py")
    early = res.pop("_early_fn")   # hc_pre's fn loaded before the PDL wait: the K loop's bits
    assert all(v["one_step"] for v in early.values()), early
    assert all(v["bitwise"] for v in early.values()), early
    assert early["d1024_bf16_splits"]["splits"] == 16, early
    fused = res.pop("_post_pre")   # hc_post_pre: the bits of hc_post then hc_pre, pairs included
    assert fused.pop("declines") == [False, False, True], fused
    for case, v in fused.items():
        assert v["bitwise"] and v["pairs_bitwise"], (case, v)
        r = v["streams_vs_reference"]   # the expansion against the reference, as for hc_post above
        assert (r["rel"] <= BF16_STEP * (1 + 1e-6)) if "bf16" in case else (r["max_abs"] <= 1e-6 * r["ref_max"]), \
            (case, v)
    assert fused["d1024_bf16_norm_splits"]["splits"] == 16 and fused["d256_f32"]["splits"] == 4, fused
    assert fused["d256_bf16_pending_norm"]["pairs_checked"] == 2, fused
    assert len(res) == 13
    for case, outs in res.items():
        assert set(outs) - {"normed_pairs_equal"} == {"pre", "post", "comb", "collapsed", "expand", "head_pre",
                                                      "head_collapsed", "logits", "expand_pending", "normed",
                                                      "normed_pre"}
        for out, v in outs.items():
            if out in ("normed_pairs_equal", "normed_pre"):   # bitwise: the same pairs, the same mixes
                ok = v["max_abs"] == 0.0
            elif out == "normed":  # rms_norm of the same collapsed rows: the statistic summed in another order
                ok = v["rel"] <= 2 * BF16_STEP * (1 + 1e-6) if "bf16" in case else v["max_abs"] <= 2e-6 * v["ref_max"]
            elif out in ("pre", "post", "comb", "head_pre"):
                ok = v["max_abs"] <= 2e-5
            elif out == "logits":  # fp32 sums of up to hc*D products, scaled by up to 400
                ok = v["max_abs"] <= 2e-5 * max(1.0, v["ref_max"])
            elif "bf16" in case:
                ok = v["rel"] <= BF16_STEP * (1 + 1e-6)
            else:
                ok = v["max_abs"] <= 1e-6 * v["ref_max"]
            assert ok, (case, out, v)
    assert sum("normed_pairs_equal" in outs for outs in res.values()) == 2   # b1_f32, iters1_bf16
    # the eps paths did something: zero streams collapse to exactly zero, saturated rows stay finite
    assert res["eps_zero_streams"]["collapsed"]["ref_max"] == 0.0
    assert res["eps_zero_bf16_dense"]["collapsed"]["max_abs"] == 0.0
    assert res["eps_saturated"]["comb"]["max_abs"] <= 1e-5


def test_dense_tier_rule_and_its_error():
    from dsv4lab.kernels.mhc_fused import DENSE_MIN_T, use_dense

    assert use_dense(DENSE_MIN_T, torch.bfloat16) and not use_dense(DENSE_MIN_T - 1, torch.bfloat16)
    assert not use_dense(10 ** 6, torch.float32) and use_dense(1, torch.bfloat16, True)
    assert not use_dense(10 ** 6, torch.bfloat16, False)
    with pytest.raises(ValueError, match="dense=True needs bfloat16 streams.*float32"):
        use_dense(4096, torch.float32, True)


# ----------------------------------------------------------------------------- model-level wiring
def _sites(m):
    return [mod for mod in m.modules() if isinstance(mod, HyperConnection)], m.hc_head


def test_mhc_slots_equal_reference_and_hooks_force_it():
    """The dispatch entry points (the reference math on CPU) in the slots give bitwise the reference
    logits; a hook on any of a site's hook points, or an implementation overriding mixes / expand,
    puts that site on the reference; the head's hook_pre does the same for the head."""
    cfg = tiny_config()
    m = random_model(cfg, seed=3)
    ids = random_ids(cfg, n=20, b=2)
    sites, head = _sites(m)
    assert install.install_kernels(m) == 0 and all(s.kernel is None and s.post_kernel is None for s in sites)
    with torch.no_grad():
        ref = m(ids)
    pre_k, post_k, head_k = Counting(mhc_pre), Counting(mhc_post), Counting(mhc_head_pre)
    for s in sites:
        s.kernel, s.post_kernel = pre_k, post_k
    head.kernel = head_k
    with torch.no_grad():
        assert torch.equal(m(ids), ref)
    assert (pre_k.calls, post_k.calls, head_k.calls) == (len(sites), len(sites), 1)

    for hp in ("hook_pre", "hook_post", "hook_comb", "hook_collapsed", "hook_streams"):
        seen = []
        h = getattr(m.layers[1].ffn_hc, hp).register_forward_hook(lambda mod, i, o: seen.append(o.shape))
        pre_k.calls = post_k.calls = 0
        with torch.no_grad():
            assert torch.equal(m(ids), ref)
        h.remove()
        assert seen and (pre_k.calls, post_k.calls) == (len(sites) - 1, len(sites) - 1), hp
    h = head.hook_pre.register_forward_hook(lambda mod, i, o: None)
    head_k.calls = 0
    with torch.no_grad():
        assert torch.equal(m(ids), ref)
    h.remove()
    assert head_k.calls == 0

    # overriding implementations keep their own math (the bug-zoo variants differ from ref)
    for variant, slot in ((MHCPreNoEps, pre_k), (MHCCombNotTransposed, post_k)):
        with m.replace("layers.2.attn_hc", variant):
            slot.calls = 0
            with torch.no_grad():
                assert not torch.equal(m(ids), ref)
            assert slot.calls == len(sites) - 1, variant.__name__


def test_pending_sinkhorn_deferral_is_the_reference_and_steps_aside():
    """With the fused pair in the slots (CPU entry points: the reference math) forward hands combine
    a PendingSinkhorn and the streams are bitwise the reference; a torch forward hook on the site, a
    slot of a user's own or an overridden expand turn the deferral off (the hook sees tensors); a
    hook started between forward and combine gets the reference projection."""
    cfg = tiny_config()
    m = random_model(cfg, seed=3)
    site = m.layers[0].attn_hc
    g = torch.Generator().manual_seed(0)
    streams = torch.randn(2, 3, cfg.hc_mult, cfg.hidden_size, generator=g)
    out = torch.randn(2, 3, cfg.hidden_size, generator=g)
    with torch.no_grad():
        post, comb, col = site(streams)
        ref = site.combine(streams, out, post, comb)
        site.kernel, site.post_kernel = mhc_pre, mhc_post
        assert site.defers_sinkhorn()
        k_post, pending, k_col = site(streams)
        assert isinstance(pending, PendingSinkhorn) and pending.iters == cfg.hc_sinkhorn_iters
        assert torch.equal(pending.resolve(), comb) and torch.equal(k_col, col)
        assert torch.equal(site.combine(streams, out, k_post, pending), ref)
        h = site.hook_streams.register_forward_hook(lambda mod, i, o: None)  # listens after forward ran
        assert torch.equal(site.combine(streams, out, k_post, pending), ref)
        h.remove()
        seen = []
        h = site.register_forward_hook(lambda mod, i, o: seen.append(o[1]))
        assert not site.defers_sinkhorn()
        assert torch.equal(site(streams)[1], comb) and type(seen[0]) is torch.Tensor
        h.remove()
        site.post_kernel = lambda s, o, p, c: HyperConnection.expand(s, o, p, c)  # a user's slot
        assert not site.defers_sinkhorn() and torch.equal(site(streams)[1], comb)
        site.kernel = site.post_kernel = None


def test_block_norm_fold_is_the_reference_and_steps_aside():
    """With ``mhc_pre`` declaring the layer norms' slot (``norms_with``) the sites hand the norm to
    the mHC launch (``block_norm_weight=``): prefill + decode logits bitwise the reference (CPU entry
    points: the reference math) and the norm slot never called; a torch hook on one norm, a hook
    point of its site, another norm slot or an RMSNorm overriding forward each run that norm by
    itself again (the hook sees its output)."""
    cfg = tiny_config()
    m = random_model(cfg, seed=3)
    ids = random_ids(cfg, n=14, b=2)
    sites, _ = _sites(m)
    norms = [mod for n, mod in m.named_modules() if n.endswith(("attn_norm", "ffn_norm"))]
    ref = decode_logits(m, ids)
    pre_k, post_k, norm_k = Counting(mhc_pre), Counting(mhc_post), Counting(rms_norm)
    pre_k.norms_with = norm_k
    try:
        for s in sites:
            s.kernel, s.post_kernel = pre_k, post_k
        for nm in norms:
            nm.kernel = norm_k
        assert all(s.folds_norm(nm) for s, nm in zip(sites, norms))
        assert torch.equal(decode_logits(m, ids), ref)
        assert norm_k.calls == 0 and pre_k.keywords["block_norm_weight"] == pre_k.calls > 0

        def norm_calls_when(action, undo):
            norm_k.calls = 0
            action()
            try:
                assert torch.equal(decode_logits(m, ids), ref)
            finally:
                undo()
            return norm_k.calls
        layer = m.layers[1]
        seen = []
        h = layer.attn_norm.register_forward_hook(lambda mod, i, o: seen.append(o.shape))
        assert not layer.attn_hc.folds_norm(layer.attn_norm) and layer.ffn_hc.folds_norm(layer.ffn_norm)
        assert norm_calls_when(lambda: None, h.remove) == 7 and len(seen) == 7   # prefill + 6 decode steps
        h = layer.ffn_hc.hook_collapsed.register_forward_hook(lambda mod, i, o: None)
        assert norm_calls_when(lambda: None, h.remove) == 7
        other = Counting(rms_norm)   # a slot mhc_pre does not declare
        norm_calls_when(lambda: setattr(layer.ffn_norm, "kernel", other), lambda: setattr(layer.ffn_norm, "kernel", norm_k))
        assert other.calls == 7

        class LoudNorm(RMSNorm):
            def forward(self, x):
                return super().forward(x)
        loud = LoudNorm(cfg.hidden_size, cfg.rms_norm_eps)
        loud.load_state_dict(layer.attn_norm.state_dict())
        loud.kernel, old = norm_k, layer.attn_norm
        assert norm_calls_when(lambda: setattr(layer, "attn_norm", loud), lambda: setattr(layer, "attn_norm", old)) == 7
    finally:
        for s in sites:
            s.kernel = s.post_kernel = None
        for nm in norms:
            nm.kernel = None


def test_post_pre_fusion_is_the_two_calls_and_steps_aside():
    """``HyperConnection.combine_then``: where an expansion slot declares the pre slot (``then_pre`` /
    ``pre_fuses_with``), each layer runs its attn expansion and its FFN pre (norm folded, Sinkhorn
    pending) as one call, and in decode each FFN expansion and the next layer's attention pre too:
    logits bitwise the reference (CPU entry points: the reference math). A hook on the residual
    between them (mid, post, the next pre), a hook point of the site, a torch hook on the norm or
    an undeclared pre slot each give back the two calls they sit between (and the hooks see their
    tensors)."""
    cfg = tiny_config()
    m = random_model(cfg, seed=5)
    ids = random_ids(cfg, n=14, b=2)
    sites, _ = _sites(m)
    norms = [mod for n, mod in m.named_modules() if n.endswith(("attn_norm", "ffn_norm"))]
    ref = decode_logits(m, ids)
    iters_seen = []

    def post_pre_ref(streams, block_out, post, comb, fn, base, scale, iters, hc_eps, norm_eps, *, sinkhorn_iters=0,
                     post_eps=0.0, logits_settled=False, sinkhorn=True, block_norm_weight=None, block_norm_eps=0.0):
        iters_seen.append((sinkhorn_iters, logits_settled, sinkhorn))
        y = mhc_post(streams, block_out, post, comb, sinkhorn_iters=sinkhorn_iters, hc_eps=post_eps)
        return (y,) + mhc_pre(y, fn, base, scale, iters, hc_eps, norm_eps, sinkhorn=sinkhorn,
                              block_norm_weight=block_norm_weight, block_norm_eps=block_norm_eps)

    pre_k, post_k, norm_k, fused = Counting(mhc_pre), Counting(mhc_post), Counting(rms_norm), Counting(post_pre_ref)
    pre_k.norms_with = norm_k
    post_k.then_pre, post_k.pre_fuses_with = fused, pre_k
    n_layers, steps = len(m.layers), 6   # a prefill and 6 decode steps
    calls = steps + 1
    both = n_layers * calls + (n_layers - 1) * steps   # within each layer; across layers in decode only
    assert n_layers >= 3
    try:
        for s in sites:
            s.kernel, s.post_kernel = pre_k, post_k
        for nm in norms:
            nm.kernel = norm_k
        assert torch.equal(decode_logits(m, ids), ref)
        assert fused.calls == both and norm_k.calls == 0
        assert all(it == (cfg.hc_sinkhorn_iters, True, False) for it in iters_seen)   # pending in, pending out

        def fused_calls_when(hook_on):
            fused.calls = 0
            seen = []
            h = hook_on.register_forward_hook(lambda mod, i, o: seen.append(1))
            try:
                assert torch.equal(decode_logits(m, ids), ref)
            finally:
                h.remove()
            return fused.calls, len(seen)
        layer = m.layers[1]   # a middle layer: chained from layer 0, chaining into layer 2
        assert fused_calls_when(layer.hook_resid_mid) == (both - calls, calls)
        assert fused_calls_when(layer.ffn_norm) == (both - calls, calls)
        assert fused_calls_when(layer.hook_resid_post) == (both - steps, calls)
        assert fused_calls_when(layer.hook_resid_pre) == (both - steps, calls)
        assert fused_calls_when(layer.attn_norm) == (both - steps, calls)
        assert fused_calls_when(layer.attn_hc.hook_streams) == (both - calls - steps, calls)   # its pre and its post
        layer.ffn_hc.kernel = Counting(mhc_pre)   # a pre slot the expansion does not declare
        layer.ffn_hc.kernel.norms_with = norm_k
        fused.calls = 0
        assert torch.equal(decode_logits(m, ids), ref) and fused.calls == both - calls
    finally:
        for s in sites:
            s.kernel = s.post_kernel = None
        for nm in norms:
            nm.kernel = None


def test_post_pre_switch():
    """``set_post_pre``: on (the default; ``DSV4LAB_HC_POST_PRE=0`` at import turns it off), the
    expansion slot offers the one launch (``then_pre``); off it offers nothing, so the layer reads one
    attribute; a non-bool is refused."""
    from dsv4lab.kernels import dispatch

    prev = dispatch.set_post_pre(True)
    try:
        assert dispatch.mhc_post.then_pre is dispatch.mhc_post_pre and dispatch.mhc_post.pre_fuses_with is mhc_pre
        assert dispatch.set_post_pre(False) is True and dispatch.mhc_post.then_pre is None
        with pytest.raises(TypeError, match="True or False"):
            dispatch.set_post_pre("yes")
    finally:
        dispatch.set_post_pre(prev)


def test_use_kernels_switches_mhc_slots(monkeypatch):
    """use_kernels installs mhc_pre / mhc_post / mhc_head_pre where the parameters are on CUDA
    (faked here), components() shows them, the graph signature changes, and enable=False removes them."""
    cfg = tiny_config()
    m = random_model(cfg, seed=3)
    sites, head = _sites(m)
    assert use_kernels(m, "layers.*.*_hc") == 0  # CPU: nothing installed
    sig0 = model_signature(m)
    monkeypatch.setattr(install, "have_triton_cuda", lambda: True)
    monkeypatch.setattr(install, "_on_cuda", lambda t: t is not None)
    assert use_kernels(m, "layers.*.*_hc") == len(sites)
    assert use_kernels(m, "hc_head") == 1
    assert all(s.kernel is mhc_pre and s.post_kernel is mhc_post for s in sites) and head.kernel is mhc_head_pre
    df = components(m)
    impl = dict(zip(df.name, df.impl))
    assert impl["layers.0.attn_hc"] == "kernel:mhc_pre" and impl["hc_head"] == "kernel:mhc_head_pre"
    assert model_signature(m) != sig0
    ids = random_ids(cfg, n=12, b=1)
    with torch.no_grad():
        on = m(ids)
    assert use_kernels(m, "layers.1", False) >= 2  # both sites of layer 1 (and whatever else it had)
    assert m.layers[1].attn_hc.kernel is None and m.layers[1].ffn_hc.post_kernel is None
    assert use_kernels(m, "**", False) > 0
    assert model_signature(m) == sig0 and set(components(m).impl) == {"reference"}
    with torch.no_grad():
        assert torch.equal(m(ids), on)  # the CPU entry points are the reference math


def test_mhc_dispatch_falls_back_on_cpu_and_odd_shapes():
    g = torch.Generator().manual_seed(1)
    hc, D = 4, 16
    s = torch.randn(2, 3, hc, D, generator=g)
    fn, base, scale = torch.randn(24, hc * D, generator=g), torch.randn(24, generator=g), torch.rand(3, generator=g)
    pre, post, comb = mix_weights(s, fn, base, scale, 5, 1e-6, 1e-6)
    got = mhc_pre(s, fn, base, scale, 5, 1e-6, 1e-6)
    for a, b in zip(got, (pre, post, comb, collapse(pre, s))):
        assert torch.equal(a, b)
    out = torch.randn(2, 3, D, generator=g)
    assert torch.equal(mhc_post(s, out, post, comb), HyperConnection.expand(s, out, post, comb))
    hp = head_weights(s, fn[:hc], base[:hc], scale[:1], 1e-6, 1e-6)
    got = mhc_head_pre(s, fn[:hc], base[:hc], scale[:1], 1e-6, 1e-6)
    assert torch.equal(got[0], hp) and torch.equal(got[1], collapse(hp, s))


# ----------------------------------------------------------------------------- GPU, V4-Pro shapes
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and triton_importable()), reason="needs CUDA + triton")


def _v4_pro_site(B, S=1, seed=0):
    from dsv4lab.checkpoint.synth import preset_config

    cfg = preset_config("v4-pro")
    hc, D = cfg.hc_mult, cfg.hidden_size
    assert (hc, D, cfg.hc_sinkhorn_iters) == (4, 7168, 20)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    streams = torch.randn(B, S, hc, D, device=dev, generator=g).bfloat16()
    fn = torch.randn((2 + hc) * hc, hc * D, device=dev, generator=g) * 0.02  # fp32, as the checkpoints keep it
    base = torch.randn((2 + hc) * hc, device=dev, generator=g)
    scale = torch.rand(3, device=dev, generator=g) + 0.5
    return cfg, streams, fn, base, scale


def _check_bf16(got, want, atol_rel=1e-5, extra=None, name=""):
    d = (got.float() - want.float()).abs()
    bound = BF16_STEP * (want.float().abs() + (0 if extra is None else extra.float().abs())) + atol_rel * want.float().abs().max()
    if not bool((d <= bound).all()):
        i = int((d - bound).flatten().argmax())
        at = {"got": got.flatten()[i].item(), "want": want.flatten()[i].item(), "bound": bound.flatten()[i].item(),
              "extra": None if extra is None else extra.flatten()[i].item(), "index": i}
        raise AssertionError(f"{name}: {(d > bound).sum().item()} elements over the bound; worst {at}")
    return (got != want).float().mean().item()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B,S,dense", [(1, 1, None), (4, 1, None), (64, 1, None), (1, 4096, False), (1, 4096, None)])
def test_gpu_hc_pre_post_v4_pro_shapes(B, S, dense):
    """(1, 4096): a prefill chunk, on the tiles (dense False) and on the tier the rule picks there
    (the dense tier: cuBLAS products of fn's bf16 parts)."""
    from dsv4lab.kernels.mhc_fused import hc_head_pre, hc_post, hc_pre, use_dense

    assert use_dense(B * S, torch.bfloat16) == (B * S >= 1024)
    cfg, streams, fn, base, scale = _v4_pro_site(B, S)
    args = (cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    pre, post, comb = mix_weights(streams, fn, base, scale, *args)
    k_pre, k_post, k_comb, k_col = hc_pre(streams, fn, base, scale, *args, dense=dense)
    for a, b in ((k_pre, pre), (k_post, post), (k_comb, comb)):
        assert (a - b).abs().max().item() <= 2e-5
    frac = {"collapsed": _check_bf16(k_col, collapse(pre, streams), name="collapsed")}
    for _ in range(3):  # deterministic
        again = hc_pre(streams, fn, base, scale, *args, dense=dense)
        assert all(torch.equal(a, b) for a, b in zip(again, (k_pre, k_post, k_comb, k_col)))

    out = torch.randn(B, S, cfg.hidden_size, device="cuda").bfloat16()
    # the reference's comb^T.streams is a batched bf16 cuBLAS GEMM (K = hc = 4) with no promise of
    # fp32 sums: at (1, 4096) one of 117M elements came out 1.5 steps of |mixed| from the kernel's
    # one-rounding fp32 sum (H200, 2026-12-03), hence two steps of |mixed| here
    mixed = torch.matmul(comb.bfloat16().transpose(-1, -2), streams)
    frac["new_streams"] = _check_bf16(hc_post(streams, out, post, comb), HyperConnection.expand(streams, out, post, comb),
                                      0.0, 2 * mixed.float(), name="new_streams")
    # the deferred projection (PendingSinkhorn): hc_pre's logits, projected in hc_post's prologue
    logits = hc_pre(streams, fn, base, scale, *args, dense=dense, sinkhorn=False)[2]
    assert (logits - mix_logits(streams, fn, base, scale, cfg.hc_eps, cfg.rms_norm_eps)[2]).abs().max().item() <= 1e-4
    # its comb is the kernel's (within 2e-5 of the reference's), so a comb entry's bf16 rounding may
    # land one step away (H100: 3346 of 117M elements at (1, 4096)): sum_j |stream_j| steps more,
    # added to the two of |mixed| (a signed sum cancelled them: H200, 21547 elements over the bound)
    flips = streams.float().abs().sum(dim=-2, keepdim=True)
    for settled in (False, True):  # settled: launches ran since the logits were written (the reference's)
        frac[f"pending_{settled}"] = _check_bf16(
            hc_post(streams, out, post, logits, sinkhorn_iters=args[0], hc_eps=cfg.hc_eps, logits_settled=settled),
            HyperConnection.expand(streams, out, post, comb), 0.0, 2 * mixed.float().abs() + flips,
            name=f"pending settled={settled}")

    hc = cfg.hc_mult
    h_pre = head_weights(streams, fn[:hc], base[:hc], scale[:1], cfg.hc_eps, cfg.rms_norm_eps)
    k_hp, k_hcol = hc_head_pre(streams, fn[:hc], base[:hc], scale[:1], cfg.hc_eps, cfg.rms_norm_eps, dense=dense)
    assert (k_hp - h_pre).abs().max().item() <= 2e-5
    frac["head_collapsed"] = _check_bf16(k_hcol, collapse(h_pre, streams), name="head_collapsed")
    print(f"B={B} S={S} dense={dense}: fraction of bf16 elements not bitwise equal to the reference {frac}; max |pre/post/comb diff| "
          f"{max((a - b).abs().max().item() for a, b in ((k_pre, pre), (k_post, post), (k_comb, comb))):.2e}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B,S", [(1, 1), (4, 1), (1, 4096)])
def test_gpu_hc_pre_block_norm_v4_pro_shapes(B, S):
    """The layer norm folded into hc_pre (``block_norm_weight=``): the mixes within the plain
    launch's tolerance (one row runs with ``ONE_ROW_WARPS``: its K sums in another order), the
    normalised rows within three bf16 steps of ``rms_norm`` of the reference's collapsed rows (one
    for the collapse, as the plain launch's; one for (x * r) rounded after a statistic summed in
    another order, one for the weight's product), deterministic; one row also leaves its x_pairs,
    bitwise what x_pairs computes of it."""
    from dsv4lab.kernels.activation_pairs import x_pairs
    from dsv4lab.kernels.mhc_fused import hc_pre
    from dsv4lab.model.norms import rms_norm as rms_norm_ref

    cfg, streams, fn, base, scale = _v4_pro_site(B, S, seed=1)
    args = (cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    w = (1 + 0.1 * torch.randn(cfg.hidden_size, device="cuda")).bfloat16()
    pre, post, logits = mix_logits(streams, fn, base, scale, cfg.hc_eps, cfg.rms_norm_eps)
    folded = hc_pre(streams, fn, base, scale, *args, sinkhorn=False, block_norm_weight=w, block_norm_eps=cfg.rms_norm_eps)
    assert (folded[0] - pre).abs().max().item() <= 2e-5 and (folded[1] - post).abs().max().item() <= 2e-5
    assert (folded[2] - logits).abs().max().item() <= 1e-4
    want = rms_norm_ref(collapse(pre, streams), w, cfg.rms_norm_eps)
    frac = _check_bf16(folded[3], want, 1e-5, 2 * want.float(), name="normed")   # |want| + 2 |want|: three steps
    if B * S == 1:
        rows, inv = (t.clone() for t in x_pairs(folded[3]))   # the fold's pairs (no launch)
        assert all(torch.equal(a, b) for a, b in zip((rows, inv), x_pairs(folded[3].clone())))
    again = hc_pre(streams, fn, base, scale, *args, sinkhorn=False, block_norm_weight=w, block_norm_eps=cfg.rms_norm_eps)
    assert torch.equal(again[3], folded[3])
    print(f"B={B} S={S}: block norm folded, fraction of elements not bitwise rms_norm's {frac}")


@pytest.mark.gpu
@gpu
def test_gpu_hc_pre_graph_replay_is_bitwise_eager():
    from dsv4lab.kernels.mhc_fused import hc_post, hc_pre

    cfg, streams, fn, base, scale = _v4_pro_site(4)
    args = (cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    out = torch.randn(4, 1, cfg.hidden_size, device="cuda").bfloat16()

    w = torch.rand(cfg.hidden_size, device="cuda").bfloat16()

    def step():
        _, post, logits, _ = hc_pre(streams, fn, base, scale, *args, sinkhorn=False)
        _, post, comb, col = hc_pre(streams, fn, base, scale, *args)  # a launch since the logits: settled
        pending = hc_post(streams, out, post, logits, sinkhorn_iters=args[0], hc_eps=args[1], logits_settled=True)
        normed = hc_pre(streams[:1], fn, base, scale, *args, block_norm_weight=w, block_norm_eps=1e-6)[3]
        return col, hc_post(streams, out, post, comb), pending, normed

    eager = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up (compiles) off the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(static, eager))


@pytest.mark.gpu
@gpu
def test_gpu_tiny_model_with_mhc_kernels():
    """use_kernels on CUDA installs the mHC slots; logits stay within fp32 rounding of the reference,
    and graph replay equals eager bitwise."""
    from dsv4lab.decode.check import decode_check

    cfg = tiny_config()
    m = random_model(cfg, seed=5).to("cuda")
    ids = random_ids(cfg, n=40, b=1).cuda()
    with torch.no_grad():
        ref = m(ids)
    sites, head = _sites(m)
    assert use_kernels(m, "layers.*.*_hc") == len(sites) and use_kernels(m, "hc_head") == 1
    assert {"kernel:mhc_pre", "kernel:mhc_head_pre"} <= set(components(m).impl)
    try:
        with torch.no_grad():
            got = m(ids)
        assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
        s = decode_check(m, ids.cpu(), steps=24).summary()
        assert s["token_agreement"] == 1.0 and s["max_abs_logit_diff"] == 0.0
    finally:
        use_kernels(m, "**", False)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B", [1, 2])
def test_gpu_hc_post_pre_v4_pro_is_the_two_launches(B):
    """``hc_post_pre`` at a V4-Pro site (hc 4, D 7168, bf16; 112 programs a token): the new streams,
    mixes, logits and normed rows bitwise those of ``hc_post`` then ``hc_pre`` (comb given and
    pending, the next block's norm folded), one row's x_pairs too; a CUDA-graph replay bitwise
    eager. The collapse reads streams other programs of the launch wrote (``.cg``)."""
    from dsv4lab.kernels.activation_pairs import _kept_pairs
    from dsv4lab.kernels.mhc_fused import hc_post, hc_post_pre, hc_pre

    cfg, streams, fn0, base0, scale0 = _v4_pro_site(B, 1, seed=2)
    fn, base, scale = _v4_pro_site(B, 1, seed=3)[2:]
    it, eps, neps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
    out = torch.randn(B, 1, cfg.hidden_size, device="cuda").bfloat16()
    w = (1 + 0.1 * torch.randn(cfg.hidden_size, device="cuda")).bfloat16()
    _, post, logits = mix_logits(streams, fn0, base0, scale0, eps, neps)
    comb = mix_weights(streams, fn0, base0, scale0, it, eps, neps)[2]
    for c_in, kw in ((comb, {}), (logits, {"sinkhorn_iters": it, "post_eps": eps, "logits_settled": True})):
        y = hc_post(streams, out, post, c_in, sinkhorn_iters=kw.get("sinkhorn_iters", 0), hc_eps=eps,
                    logits_settled=kw.get("logits_settled", False))
        two = (y,) + hc_pre(y, fn, base, scale, it, eps, neps, sinkhorn=False, block_norm_weight=w, block_norm_eps=neps)
        pairs_two = [t.clone() for t in _kept_pairs(cfg.hidden_size // 16, streams.device)]
        one = hc_post_pre(streams, out, post, c_in, fn, base, scale, it, eps, neps, sinkhorn=False,
                          block_norm_weight=w, block_norm_eps=neps, **kw)
        assert one is not None
        names = ("streams", "pre", "post", "comb", "normed")
        assert [n for n, a, b in zip(names, one, two) if not torch.equal(a, b)] == [], kw
        if B == 1:
            assert all(torch.equal(a, b) for a, b in zip(_kept_pairs(cfg.hidden_size // 16, streams.device), pairs_two))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = hc_post_pre(streams, out, post, logits, fn, base, scale, it, eps, neps, sinkhorn=False,
                          block_norm_weight=w, block_norm_eps=neps, sinkhorn_iters=it, post_eps=eps, logits_settled=True)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, one))


@pytest.mark.gpu
@gpu
def test_gpu_embedded_model_post_pre_fusion_is_bitwise():
    """The embedded model (NVFP4, bf16, every slot installed; D = 256: 4 programs a token): decode
    logits with the attn expansion and the FFN pre in one launch (``DSV4LAB_HC_POST_PRE``) bitwise
    those with two launches over 16 steps; graph replay bitwise eager."""
    import dsv4lab
    from dsv4lab.decode.check import decode_check
    from dsv4lab.kernels import dispatch

    m = dsv4lab.load("tiny-nvfp4", device="cuda", dtype=torch.bfloat16, progress=False)
    ids = torch.randint(2, m.config.vocab_size, (1, 33), generator=torch.Generator().manual_seed(2))
    calls = []
    real = dispatch.mhc_post_pre
    prev = dispatch.set_post_pre(False)
    try:
        two = decode_logits(m, ids.cuda(), steps=16)
        dispatch.set_post_pre(True)
        dispatch.mhc_post.then_pre = lambda *a, **k: calls.append(1) or real(*a, **k)   # counted; reset below
        assert torch.equal(decode_logits(m, ids.cuda(), steps=16), two)
        n = len(m.layers)   # the prefill asks each layer once (declined: 17 tokens); a step 2 n - 1 times
        assert len(calls) == n + (2 * n - 1) * 16
        s = decode_check(m, ids, steps=16).summary()
        assert s["token_agreement"] == 1.0 and s["max_abs_logit_diff"] == 0.0
    finally:
        dispatch.set_post_pre(prev)
