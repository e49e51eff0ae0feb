"""Which component gets which kernel, and switching them on and off.

Targets: every ``QLinear`` (``.kernel``: the matmul; ``.act_kernel``: the w4a4 activation
quantiser; ``.grouped_kernel``: the block-diagonal use, NVFP4 and FP8-block; a ``Router`` also ``.route_kernel``:
scores + choice + weights), every routed ``Experts`` block (``.kernel``: the fused decode; ``.prefill_kernel``: the
grouped-GEMM prefill), every ``SharedExpert`` (``.quant_pair_kernel``: w1 and w3 in one launch;
``.swiglu_kernel``: the clamped SwiGLU in one launch; where it is not folded into the routed kernel), every ``Compressor``
(``.kernel``: the CuTeDSL softmax pool of prefill; ``.decode_kernel``: the Triton decode step), every ``Attention``
(``.kernel``: the bounded prefill attention; ``.decode_kernel``: the decode attention;
``.norm_kernel`` / ``.rope_kernel``: the q/kv norms and RoPE, the output's inverse RoPE;
``.plain_batch_kernel``: decode's unquantised projections of x in one launch), every
``Indexer`` (``.decode_kernel``: the decode scores; ``.prefill_kernel``: the prefill scores; ``.rope_kernel``: the queries' RoPE; ``.topk_kernel``:
the decode top-k), every layer-level ``RMSNorm`` (``.kernel``; not the norms inside an ``Attention`` or
``Compressor``: their own slots fuse those), every mHC site ``HyperConnection`` (``.kernel``:
mixes + collapse; ``.post_kernel``: the expansion) and the ``HyperHead`` (``.kernel``) whose own
name, or an enclosing component's, matches the pattern.
By default a kernel goes only where it runs: weights (or, for the compressor and mHC, parameters) on CUDA with
triton (cutlass for the pool) importable; elsewhere the reference stays. Imports no triton.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from ..model.attention import Attention
from ..model.compressor import Compressor
from ..model.indexer import Indexer
from ..model.linear import QLinear
from ..model.mhc import HyperConnection, HyperHead
from ..model.moe import Experts, Router, SharedExpert
from ..model.norms import RMSNorm
from ..patterns import component_matcher, no_match_error, unmatched
from . import compressor_pool_cute as pool_cute
from .device import have_triton_cuda
from .dispatch import (KERNEL_FORMATS, act_quant_nvfp4, compressor_decode, compressor_pool, decode_attention, plain_linear,
                       grouped_quant_linear,
                       index_scores_decode, index_scores_prefill, index_top_k_decode, mhc_head_pre, mhc_post, mhc_pre, moe_decode, moe_prefill,
                       norm_pair, norm_rope, plain_linear_batch, quant_linear_pair, prefill_attention, quant_linear, rms_norm, route, swiglu,
                       weight_on_cuda)

TARGETS = (QLinear, Experts, SharedExpert, Compressor, Attention, Indexer, HyperConnection, HyperHead, RMSNorm)
FUSED_NORM_OWNERS = (Attention, Compressor)  # their RMSNorms run inside their own slots (or as their reference)


def kernel_targets(model: nn.Module, pattern="**") -> tuple[list[tuple[str, nn.Module]], bool]:
    """((name, module) of every kernel target (``TARGETS``) whose name, or an enclosing component's
    name, matches ``pattern``; whether anything matched at all)."""
    match = component_matcher(pattern)
    hit_names: set[str] = set()
    out = []
    for name, mod in model.named_modules():  # parents come before their children
        if not name and not isinstance(mod, TARGETS):
            continue  # the root itself is a target only when called on one component
        if (name and name.rpartition(".")[0] in hit_names) or match(name, mod):
            hit_names.add(name)
            if isinstance(mod, TARGETS):
                out.append((name, mod))
    return out, bool(hit_names)


def _on_cuda(t) -> bool:
    return t is not None and t.device.type == "cuda"


def experts_fp4_on_cuda(experts: Experts) -> bool:
    """Every expert projection NVFP4 (or every one MXFP4, the official experts) and on CUDA."""
    fmts = set()
    for e in range(len(experts)):
        for p in ("w1", "w3", "w2"):
            qw = getattr(getattr(experts[e], p, None), "qweight", None)
            if qw is None or qw.format not in ("nvfp4", "mxfp4") or not _on_cuda(qw.packed):
                return False
            fmts.add(qw.format)
    return len(fmts) == 1


def experts_plain_on_cuda(experts: Experts) -> bool:
    """Every expert projection unquantised (a plain weight: BF16 originals, fp32 experts) and on CUDA."""
    for e in range(len(experts)):
        for p in ("w1", "w3", "w2"):
            ql = getattr(experts[e], p, None)
            if ql is None or getattr(ql, "qweight", None) is not None or not _on_cuda(getattr(ql, "weight", None)):
                return False
    return len(experts) > 0


# the kernel attributes of each target class (every other target has one: ``kernel``)
KERNEL_SLOTS: dict[type, tuple[str, ...]] = {  # the first class that matches (Router before QLinear)
    Router: ("kernel", "act_kernel", "grouped_kernel", "plain_kernel", "route_kernel"),
    QLinear: ("kernel", "act_kernel", "grouped_kernel", "plain_kernel"),
    Experts: ("kernel", "prefill_kernel"),
    SharedExpert: ("quant_pair_kernel", "swiglu_kernel"),
    HyperConnection: ("kernel", "post_kernel"),
    Attention: ("kernel", "decode_kernel", "norm_kernel", "rope_kernel", "plain_batch_kernel", "quant_pair_kernel",
                "norm_pair_kernel"),
    Indexer: ("decode_kernel", "prefill_kernel", "rope_kernel", "topk_kernel"),
    Compressor: ("kernel", "decode_kernel", "rope_kernel"),
}


def _kernel_slots(mod: nn.Module) -> tuple[str, ...]:
    return next((slots for cls, slots in KERNEL_SLOTS.items() if isinstance(mod, cls)), ("kernel",))


def _install_default(mod: nn.Module, have_triton: bool, have_cute: bool) -> bool:
    if isinstance(mod, QLinear):
        routed = False
        if isinstance(mod, Router) and have_triton and (weight_on_cuda(mod.qweight) if mod.qweight is not None
                                                        else _on_cuda(mod.weight)):
            mod.route_kernel = route
            routed = True
        qw = mod.qweight
        if qw is None and have_triton and mod.weight is not None and _on_cuda(mod.weight):
            mod.plain_kernel = plain_linear  # the bf16 decode GEMVs (F.linear for other rows / dtypes)
            return True
        if qw is None or not have_triton or qw.format not in KERNEL_FORMATS or not weight_on_cuda(qw):
            return routed
        mod.kernel = quant_linear
        mod.act_kernel = act_quant_nvfp4  # bit-exact with fake_quant_nvfp4; used in w4a4 only
        if qw.format in ("nvfp4", "fp8_block"):  # the block-diagonal use (wo_a) in one GEMV
            mod.grouped_kernel = grouped_quant_linear
        return True
    if isinstance(mod, Experts):
        if have_triton and experts_plain_on_cuda(mod):
            mod.kernel = moe_decode  # the plain decode kernel; prefill keeps the reference loop
            return True
        if not (have_triton and experts_fp4_on_cuda(mod)):
            return False
        mod.kernel = moe_decode
        mod.prefill_kernel = moe_prefill
        return True
    if isinstance(mod, SharedExpert):  # where it runs on its own (not folded into the routed kernel)
        qw = mod.w1.qweight
        if not (have_triton and (weight_on_cuda(qw) if qw is not None else _on_cuda(mod.w1.weight))):
            return False
        mod.quant_pair_kernel = quant_linear_pair
        mod.swiglu_kernel = swiglu
        return True
    if isinstance(mod, Attention):
        if not (have_triton and _on_cuda(mod.sink)):
            return False
        mod.kernel = prefill_attention
        mod.decode_kernel = decode_attention
        mod.norm_kernel = rms_norm
        mod.rope_kernel = norm_rope
        mod.plain_batch_kernel = plain_linear_batch
        mod.norm_pair_kernel = norm_pair
        mod.quant_pair_kernel = quant_linear_pair
        return True
    if isinstance(mod, Indexer):
        if not (have_triton and _on_cuda(mod.compressor.ape)):
            return False
        mod.decode_kernel = index_scores_decode
        mod.prefill_kernel = index_scores_prefill
        mod.rope_kernel = norm_rope
        mod.topk_kernel = index_top_k_decode
        return True
    if isinstance(mod, RMSNorm):
        if not (have_triton and _on_cuda(mod.weight)):
            return False
        mod.kernel = rms_norm
        return True
    if isinstance(mod, (HyperConnection, HyperHead)):
        if not (have_triton and _on_cuda(mod.fn)):
            return False
        if isinstance(mod, HyperConnection):
            mod.kernel, mod.post_kernel = mhc_pre, mhc_post
        else:
            mod.kernel = mhc_head_pre
        return True
    if not _on_cuda(mod.ape):  # Compressor: the pool (cutlass) and the decode step (triton) each where it runs
        return False
    if have_cute:
        mod.kernel = compressor_pool
    if have_triton:
        mod.decode_kernel = compressor_decode
        mod.rope_kernel = norm_rope  # the pooled entries' norm + RoPE (prefill; the decode step fuses its own)
    return have_cute or have_triton


def install_kernels(model: nn.Module, pattern="**", enable: bool = True, *, strict: bool = False,
                    linear: Callable | None = None, experts: Callable | None = None,
                    experts_prefill: Callable | None = None) -> int:
    """Install (``enable=True``) or remove (``False``) the kernels of the components matching
    ``pattern`` (their own name or an enclosing component's: ``"layers.3"`` = every linear, expert
    block and compressor of layer 3). Returns how many components were set (enable) or put back on
    the reference (disable; only those that had a kernel). ``strict``: KeyError when nothing matches.

    Defaults: ``quant_linear`` as ``QLinear.kernel`` (NVFP4, MXFP4, FP8-block weights) with
    ``act_quant_nvfp4`` as its ``act_kernel`` and ``grouped_quant_linear`` as its ``grouped_kernel``
    (NVFP4, FP8-block), ``route`` as ``Router.route_kernel``, ``moe_decode`` as ``Experts.kernel`` and ``moe_prefill``
    as ``Experts.prefill_kernel`` (NVFP4 or MXFP4 experts), ``compressor_pool`` as ``Compressor.kernel``
    and ``compressor_decode`` / ``norm_rope`` as its ``decode_kernel`` / ``rope_kernel``,
    ``prefill_attention`` as ``Attention.kernel`` with ``decode_attention`` as its ``decode_kernel``,
    ``rms_norm`` / ``norm_rope`` as its ``norm_kernel`` / ``rope_kernel`` and ``plain_linear_batch`` as its
    ``plain_batch_kernel``,
    ``index_scores_decode`` / ``norm_rope`` / ``index_top_k_decode`` as ``Indexer.decode_kernel`` /
    ``.rope_kernel`` / ``.topk_kernel``, ``rms_norm`` as a layer-level ``RMSNorm.kernel``, ``mhc_pre`` / ``mhc_post`` as
    ``HyperConnection.kernel`` / ``.post_kernel``, ``mhc_head_pre`` as ``HyperHead.kernel``,
    ``quant_linear_pair`` / ``swiglu`` as ``SharedExpert.quant_pair_kernel`` / ``.swiglu_kernel``, each only
    where it runs (see the module
    docstring). ``linear=`` / ``experts=`` install another callable with the same signature on
    every matching quantised QLinear / Experts whatever the device (e.g. a reference-equal fake on
    CPU in tests); ``experts_prefill=`` likewise as ``Experts.prefill_kernel``."""
    targets, any_match = kernel_targets(model, pattern)
    if not any_match and strict:
        names = [n for n, _ in model.named_modules() if n]
        pats = unmatched(pattern, names) or [str(pattern)]
        raise no_match_error("component", "pattern", pats[0], names, "see model.components()")
    n = 0
    if not enable:
        for _, mod in targets:
            had = False
            for slot in _kernel_slots(mod):
                if getattr(mod, slot, None) is not None:
                    setattr(mod, slot, None)
                    had = True
            n += had
        return n
    have_triton = have_triton_cuda()
    have_cute = pool_cute.have_cute()
    owners = {n for n, m in model.named_modules() if isinstance(m, FUSED_NORM_OWNERS)}
    for name, mod in targets:
        if isinstance(mod, RMSNorm) and name.rpartition(".")[0] in owners:
            continue
        if isinstance(mod, QLinear) and linear is not None:
            if mod.qweight is None:
                continue
            mod.kernel = linear
        elif isinstance(mod, Experts) and (experts is not None or experts_prefill is not None):
            mod.kernel = experts if experts is not None else mod.kernel
            mod.prefill_kernel = experts_prefill if experts_prefill is not None else mod.prefill_kernel
        elif not _install_default(mod, have_triton, have_cute):
            continue
        n += 1
    return n


def kernel_state(model: nn.Module) -> dict:
    """name -> (kernel slot -> installed callable, None = reference) for every target; give it
    back to :func:`restore_kernels` to put that exact assignment back."""
    return {name: {s: getattr(mod, s, None) for s in _kernel_slots(mod)} for name, mod in kernel_targets(model)[0]}


def restore_kernels(model: nn.Module, saved: dict) -> None:
    for name, mod in kernel_targets(model)[0]:
        for slot, fn in saved.get(name, {}).items():
            setattr(mod, slot, fn)
