"""The host side of the decode launches (CPU, no GPU): the per-weight plan cache
(``dsv4lab.kernels.host.weight_cached``) invalidates on a replaced weight and is reused for the same
one, and the cached ``quant_linear`` path launches the kernels with the same arguments as the uncached
path (launches stubbed by ``benchmarks/host_overhead.py``)."""
from __future__ import annotations

import gc
import math

import pytest
import torch

from oracle_util import benchmark_module

pytest.importorskip("triton")


def _host_overhead():
    return benchmark_module("host_overhead")


def test_weight_cached_reuses_and_invalidates():
    from dsv4lab.kernels import host

    builds = []

    def build(tag):
        builds.append(tag)
        return object()

    w = torch.zeros(4, 8, dtype=torch.uint8)
    a = host.weight_cached(w, ("k",), lambda: build("a"))
    assert host.weight_cached(w, ("k",), lambda: build("again")) is a            # same weight: reused
    assert host.weight_cached(w, ("other",), lambda: build("b")) is not a        # another key: new entry
    w2 = w.clone()                                                               # a replaced weight
    assert host.weight_cached(w2, ("k",), lambda: build("c")) is not a
    w.data = torch.ones(4, 8, dtype=torch.uint8)                                 # swapped storage
    assert host.weight_cached(w, ("k",), lambda: build("d")) is not a
    assert builds == ["a", "b", "c", "d"]
    i = id(w2)
    del w2
    gc.collect()
    assert i not in host._PER_WEIGHT                                             # no dead weight kept


def test_weight_cached_keeps_no_weight_alive():
    import weakref

    from dsv4lab.kernels import host

    w = torch.zeros(16, 16, dtype=torch.uint8)
    ref = weakref.ref(w)
    host.weight_cached(w, (), lambda: w.view(torch.int64))     # a value holding a view of the weight
    del w
    gc.collect()
    assert ref() is None


def _norm(v, weight_ptrs):
    """Launch arguments made comparable: fresh per-call buffers by geometry, weight storage by address."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), v.dtype, v.stride(), v.data_ptr() if v.data_ptr() in weight_ptrs else None)
    if isinstance(v, TensorDescriptor):
        return ("D", _norm(v.base, weight_ptrs), tuple(v.shape), tuple(v.strides), tuple(v.block_shape), v.padding)
    return v


def _launches(log, weight_ptrs):
    return [(name, grid, [_norm(a, weight_ptrs) for a in args], {k: _norm(v, weight_ptrs) for k, v in kw.items()})
            for name, grid, args, kw in log]


@pytest.mark.parametrize("M", [1, 4])
def test_cached_quant_linear_launches_like_uncached(M):
    """quant_linear's cached M <= 16 TMA path (second and third call) launches exactly what
    ``nvfp4_matmul`` with the same config given explicitly (the uncached path) launches."""
    from dsv4lab.kernels import dispatch, linear_nvfp4
    from dsv4lab.kernels.linear_nvfp4_tma import tma_default_config
    from dsv4lab.quant.weights import quantize_nvfp4

    ho = _host_overhead()
    w = quantize_nvfp4(torch.randn(512, 1024))
    x = torch.randn(M, 1024).to(torch.bfloat16)
    ptrs = {w.packed.data_ptr(), w.block_scale.data_ptr(), w.global_scale.data_ptr()}
    log: list = []
    with ho.stubbed_launches(log):
        for _ in range(3):
            dispatch.quant_linear(x, w)
        cached = _launches(log, ptrs)
        log.clear()
        cfg = tma_default_config(512, 1024, x.device, M)
        linear_nvfp4.nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale, config=cfg)
        uncached = _launches(log, ptrs)
    n = 2 if M == 1 else 1  # M == 1: x-pairs prelude + GEMV
    assert len(cached) == 3 * n and len(uncached) == n
    assert cached[:n] == uncached and cached[n:2 * n] == uncached and cached[2 * n:] == uncached
    assert cached[-1][0] == ("linear_nvfp4_tma._gemv_tma_kernel" if M == 1 else "linear_nvfp4_tma._gemv_tma_dot_kernel")


def _flat(launches):
    """Launches with each activation tensor named by its element count, not its shape and strides."""
    def f(v):
        return ("T", math.prod(v[1]), v[2], v[4]) if isinstance(v, tuple) and v[:1] == ("T",) else v
    return [(name, grid, [f(a) for a in args], {k: f(v) for k, v in kw.items()}) for name, grid, args, kw in launches]


def test_one_token_gemvs_read_x_by_address():
    """The decode GEMVs take a contiguous one-token x of any rank as it is (no [1, K] view made):
    the launches of the uncached path for the same storage, x's shape aside, and an output shaped
    like x's leading dims; the grouped one-token GEMV (wo_a) likewise against its explicit launch."""
    from dsv4lab.kernels import dispatch, linear_nvfp4
    from dsv4lab.kernels.linear_nvfp4_tma import launch_gemv_tma, tma_default_config
    from dsv4lab.quant.weights import quantize_nvfp4

    ho = _host_overhead()
    w = quantize_nvfp4(torch.randn(512, 1024))
    ptrs = {w.packed.data_ptr(), w.block_scale.data_ptr(), w.global_scale.data_ptr()}
    x = torch.randn(1, 1, 1024).to(torch.bfloat16)
    xg = torch.randn(1, 1, 2, 1024).to(torch.bfloat16)
    log: list = []
    with ho.stubbed_launches(log):
        y = dispatch.quant_linear(x, w)
        fast = _launches(log, ptrs)
        log.clear()
        cfg = tma_default_config(512, 1024, x.device, 1)
        linear_nvfp4.nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale, config=cfg)
        uncached = _launches(log, ptrs)
        log.clear()
        yg = linear_nvfp4.nvfp4_grouped_matmul(xg, w.packed, w.block_scale, w.global_scale)
        grouped = _launches(log, ptrs)
        log.clear()
        launch_gemv_tma(xg.reshape(2, 1024), w.packed, w.block_scale.view(torch.uint8), w.global_scale.reshape(1),
                        torch.empty(512, dtype=torch.bfloat16), cfg, groups=2)
        explicit = _launches(log, ptrs)
    assert tuple(y.shape) == (1, 1, 512) and tuple(yg.shape) == (1, 1, 2, 256)
    assert len(fast) == 2 and fast != uncached and _flat(fast) == _flat(uncached)  # only x's shape differs
    # the grouped one also writes y's pairs for wo_b (the emitting GEMV): the explicit launch's
    # prelude and GEMV arguments, then the kept pairs buffers of y's 512 / 16 groups
    g_flat, e_flat = _flat(grouped), _flat(explicit)
    assert len(grouped) == 2 and g_flat[0] == e_flat[0]
    assert grouped[-1][0] == "linear_nvfp4_tma._gemv_tma_emit_kernel"
    assert explicit[-1][0] == "linear_nvfp4_tma._gemv_tma_kernel"
    assert g_flat[1][1] == e_flat[1][1] and g_flat[1][2][:12] == e_flat[1][2][:12] and g_flat[1][3] == e_flat[1][3]
    assert g_flat[1][2][14:] == [512 // 16, 64]   # y's groups, 1/xs padded to a whole box


def test_replaced_weight_gets_a_new_plan():
    """set_weight-style replacement: the new weight's launches use its own storage, not a stale plan's."""
    from dsv4lab.kernels import dispatch
    from dsv4lab.quant.weights import quantize_nvfp4

    ho = _host_overhead()
    x = torch.randn(1, 1024).to(torch.bfloat16)
    log: list = []
    with ho.stubbed_launches(log):
        w = quantize_nvfp4(torch.randn(512, 1024))
        dispatch.quant_linear(x, w)
        first = log[-1][2][0].base.data_ptr()   # the weight descriptor of the GEMV
        assert first == w.packed.data_ptr()
        w2 = quantize_nvfp4(torch.randn(512, 1024))
        dispatch.quant_linear(x, w2)
        assert log[-1][2][0].base.data_ptr() == w2.packed.data_ptr() != first
        w2.packed.data = w2.packed.clone()      # swapped storage under the same tensor object
        dispatch.quant_linear(x, w2)
        assert log[-1][2][0].base.data_ptr() == w2.packed.data_ptr()


def test_stub_keeps_the_wrapper():
    """The stub replaces the launches only: the wrapper's argument checks still run."""
    from dsv4lab.kernels import linear_nvfp4
    from dsv4lab.quant.weights import quantize_nvfp4

    ho = _host_overhead()
    w = quantize_nvfp4(torch.randn(512, 1024))
    with ho.stubbed_launches([]):
        with pytest.raises(ValueError, match="in_features"):
            linear_nvfp4.nvfp4_matmul(torch.randn(1, 512), w.packed, w.block_scale, w.global_scale)
    assert not torch.zeros(1).is_cuda  # restored
