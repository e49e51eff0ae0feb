"""Component implementations: the kernel on CUDA (with triton / cutlass importable), the PyTorch
reference elsewhere. Importing this module imports neither triton nor cutlass: the Triton kernel
modules are imported together on the first kernel call (``_TritonModules``), cutlass by its module.

* ``quant_linear(x, w)`` (alias ``nvfp4_linear``): ``QLinear.kernel``-compatible ``f(x, qweight) -> y``
  for NVFP4, MXFP4 and FP8-block weights; other formats, CPU tensors or unsupported dtypes take the
  reference (``w.dequantize`` + ``F.linear``).
* ``plain_linear(x, w)``: ``QLinear.plain_kernel``, unquantised (bf16 / fp16) weights at decode
  rows in one Triton GEMV launch; ``F.linear`` elsewhere.
* ``grouped_quant_linear(x, w, groups)``: ``QLinear.grouped_kernel``, the block-diagonal use (wo_a)
  in one GEMV for one NVFP4 or FP8-block token.
* ``swiglu(gate, up, limit)``: ``SharedExpert.swiglu_kernel``, ``clamped_swiglu`` in one launch.
* ``act_quant_nvfp4(x, global_scale)``: NVFP4 fake quant of activations (``QLinear.act_kernel``,
  drop-in for ``fake_quant_nvfp4``, bit-exact).
* ``moe_decode(x, ids, weights, w1, w3, w2, limit)``: routed experts for decode tokens.
* ``moe_prefill(x, ids, weights, w1, w3, w2, limit, weight_before_w2)``: routed experts for prefill
  tokens (grouped GEMMs over the tokens sorted by expert).
* ``compressor_pool(kv, gate)``: the Compressor's softmax pool (CuTeDSL kernel).
* ``compressor_decode(comp, kv, z, pos, st)``: ``Compressor.decode_kernel``, the decode step after
  the two projections (ring write, masked pool + norm + RoPE + entry write) in one Triton launch.
* ``prefill_attention(q, sink, scale, window, window_keys, q_start, k_start, entries, ratio,
  selected, ...)``: ``Attention.kernel``, the bounded prefill attention (Triton).
* ``mhc_pre(streams, fn, base, scale, iters, hc_eps, norm_eps)`` / ``mhc_post(streams, block_out,
  post, comb)`` / ``mhc_head_pre(streams, fn, base, scale, eps, norm_eps)``: the fused mHC sites
  (``HyperConnection.kernel`` / ``.post_kernel``, ``HyperHead.kernel``; Triton).
* ``decode_attention(q, sink, scale, window_ring, pos, entries, n_entries, selected)``:
  ``Attention.decode_kernel``, one decode token over the ring and the valid entries (Triton).
* ``index_scores_decode(q, w_raw, keys, n_valid, w_scale)``: ``Indexer.decode_kernel``, the
  indexer's decode scores (Triton).
* ``index_scores_prefill(q, w_raw, keys, n_valid, w_scale)``: ``Indexer.prefill_kernel``, the
  indexer's prefill scores without the [B, S, Hi, T] transient (Triton).
* ``index_top_k_decode(scores, n_valid, k)``: ``Indexer.topk_kernel``, the decode top-k of those
  scores (Triton, one launch).
* ``rms_norm(x, weight, eps)`` / ``norm_rope(x, positions, inv_freq, ...)``: ``Attention.norm_kernel``
  / ``rope_kernel``, the q_norm and the norm + RoPE (+ kv_fp8) / inverse RoPE launches (Triton).
* ``route(logits, top_k, scoring, scale, bias, tid2eid, input_ids)``: ``Router.route_kernel``,
  scores + choice + weights after the gate matmul (Triton).
Which component gets which: ``dsv4lab.kernels.install``.
"""
from __future__ import annotations

import importlib
import os

import torch
import torch.nn.functional as F

from ..quant.activations import fake_quant_nvfp4
from ..quant.stacked import StackedMXFP4, StackedNVFP4, stack_experts
from . import compressor_pool_cute as pool_cute
from .device import KERNEL_DTYPES, have_triton_cuda, kernel_can_take
from ..model.bounded_attention import bounded_attention
from ..model.linear import grouped_linear
from ..model.mhc import HyperConnection, collapse, head_weights, mix_logits, mix_weights, sinkhorn
from ..model.moe import route as route_ref
from ..model.swiglu import clamped_swiglu
from ..model.norms import rms_norm as rms_norm_ref
from ..model.decode_attention import decode_attention as decode_attention_ref
from ..model.indexer import index_scores_decode as index_scores_decode_ref
from ..model.indexer import index_scores_prefill as index_scores_prefill_ref
from ..model.indexer import index_top_k_decode as index_top_k_decode_ref
from ..model.compressor import Compressor
from ..model.state import CompressorState
from .moe_decode_ref import moe_decode_plain_ref, moe_decode_ref
from .moe_prefill_ref import moe_prefill_ref
from .norm_rope_ref import check_ring, norm_rope_ref

class _TritonModules:
    """The Triton kernel modules, imported together on the first kernel call: triton is an optional
    dependency (without it every entry point here runs its reference, and importing this module
    imports no kernel module), and an ``import`` statement inside a hot function costs ~2 us a
    call (29 a V4-Pro eager decode layer). Attributes, not copies: a test's stand-in for a
    module attribute is seen."""

    MODULES = ("act_quant_nvfp4", "attention_bounded", "attention_decode", "compressor_decode", "indexer_decode",
               "indexer_prefill", "indexer_topk", "gate_route", "linear_fp8_tma", "linear_nvfp4", "linear_official",
               "linear_plain", "mhc_fused",
               "moe_decode", "moe_decode_plain", "moe_decode_tma", "moe_prefill", "norm_rope", "router_topk")

    def __getattr__(self, name: str):
        if name not in self.MODULES:
            raise AttributeError(f"no Triton kernel module {name!r} in dsv4lab.kernels; one of {self.MODULES}")
        # import_module, not ``from . import``: the package re-exports functions of these names
        # (``dsv4lab.kernels.norm_rope`` the dispatcher, not the module). Lazy: imports triton.
        for m in self.MODULES:
            self.__dict__[m] = importlib.import_module(f"{__package__}.{m}")
        return self.__dict__[name]


_tk = _TritonModules()

KERNEL_FORMATS = ("nvfp4", "mxfp4", "fp8_block")
ROUTE_MAX_EXPERTS = 4096  # the router kernel holds one token's scores in registers
PLAIN_GEMV_MAX_N = 1024  # output rows up to which it does (H200: 64-384 rows faster than cuBLAS's GEMV +
                         # reduce; 1024 rows 8.4 vs 8.0 us alone, but one launch instead of two, and the
                         # same bits as the batched launch that runs the compressors' 512 / 1024 rows)

__all__ = ["KERNEL_FORMATS", "have_triton_cuda", "weight_on_cuda", "quant_linear", "nvfp4_linear", "plain_linear",
           "plain_linear_batch", "grouped_quant_linear",
           "act_quant_nvfp4", "moe_decode", "moe_prefill", "compressor_pool", "compressor_decode", "prefill_attention", "decode_attention",
           "index_scores_decode", "index_scores_prefill", "index_top_k_decode", "mhc_pre", "mhc_post", "mhc_post_pre", "set_post_pre", "mhc_head_pre", "rms_norm", "norm_rope", "norm_pair", "route", "gate_route", "set_gate_route", "quant_linear_pair", "swiglu"]


def weight_on_cuda(w) -> bool:
    """Is the stored tensor of a kernel-format QuantWeight on a CUDA device?"""
    t = getattr(w, "data" if getattr(w, "format", None) == "fp8_block" else "packed", None)
    return t is not None and t.is_cuda


def quant_linear(x: torch.Tensor, w) -> torch.Tensor:
    """y = x @ W^T for a ``QuantWeight`` W: NVFP4 through ``linear_nvfp4.nvfp4_matmul``, MXFP4 /
    FP8-block through ``linear_official`` (first call per shape checked against the reference) on
    CUDA; ``F.linear(x, w.dequantize(x.dtype))`` for anything else."""
    fmt = getattr(w, "format", None)
    if fmt in KERNEL_FORMATS and kernel_can_take(x) and weight_on_cuda(w):
        if fmt == "nvfp4":
            return _tk.linear_nvfp4.nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale)
        if _tk.linear_official.supported(x, w):
            return _tk.linear_official.verified_official_matmul(x, w)
    return F.linear(x, w.dequantize(x.dtype))


nvfp4_linear = quant_linear  # the name QLinear.kernel had when only NVFP4 had a kernel


def quant_linear_pair(x: torch.Tensor, wa, wb) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``Attention.quant_pair_kernel``: (x @ A^T, x @ B^T) in one launch for one decode token and
    two NVFP4 weights whose M = 1 GEMVs fit one grid (``linear_nvfp4.nvfp4_pair_matmul``) or two
    FP8-block ones (``linear_official.verified_official_pair``), each output the bits of
    ``quant_linear(x, w)``; None otherwise (the caller runs each on its own)."""
    fa, fb = getattr(wa, "format", None), getattr(wb, "format", None)
    if fa == fb and fa in ("nvfp4", "fp8_block") and kernel_can_take(x) and weight_on_cuda(wa) and weight_on_cuda(wb):
        if fa == "nvfp4":
            return _tk.linear_nvfp4.nvfp4_pair_matmul(x, wa, wb)
        return _tk.linear_official.verified_official_pair(x, wa, wb)
    return None


quant_linear.pairs_with = quant_linear_pair  # QLinear.pair_weight: a slot whose outputs the pair reproduces


def plain_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``QLinear.plain_kernel``: y = x @ w^T for an unquantised weight: ``linear_plain.plain_gemv``
    (one launch) on CUDA for bf16 / fp16 decode rows (``linear_plain.plain_gemv_takes``) and at
    most ``PLAIN_GEMV_MAX_N`` outputs; ``F.linear`` otherwise (fp32; prefill, where cuBLAS runs at
    its floor; wide weights, where its GEMV + reduce measured faster)."""
    if kernel_can_take(x) and x.dtype != torch.float32 and w.shape[0] <= PLAIN_GEMV_MAX_N:
        if _tk.linear_plain.plain_gemv_takes(x, w):
            return _tk.linear_plain.launch_plain_gemv(x, w)
    return F.linear(x, w)


def plain_linear_batch(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """``Attention.plain_batch_kernel``: [x @ w^T for w in weights] in one launch
    (``linear_plain.plain_gemv_batch``, each output the bits of ``plain_linear(x, w)``) for bf16 / fp16
    decode rows on CUDA; None where that does not apply (the callers then run each linear)."""
    if (kernel_can_take(x) and x.dtype != torch.float32 and all(w.shape[0] <= PLAIN_GEMV_MAX_N for w in weights)
            and _tk.linear_plain.plain_gemv_batch_takes(x, weights)):
        return _tk.linear_plain.launch_plain_gemv_batch(x, tuple(weights))
    return None


def grouped_quant_linear(x: torch.Tensor, w, groups: int) -> torch.Tensor | None:
    """x [..., G, in] times the G row blocks of a ``QuantWeight`` -> [..., G, out/G]: NVFP4 on CUDA
    through ``linear_nvfp4.nvfp4_grouped_matmul`` (one GEMV for one token); FP8-block through
    ``linear_fp8_tma.fp8_grouped_gemv`` for one token and None otherwise (``QLinear.grouped`` then
    runs ``kernel`` per row block: no dequantised copy); else the dense reference
    (``grouped_linear`` of ``w.dequantize(x.dtype)``)."""
    fmt = getattr(w, "format", None)
    if fmt in ("nvfp4", "fp8_block") and kernel_can_take(x) and weight_on_cuda(w):
        if fmt == "nvfp4":
            return _tk.linear_nvfp4.nvfp4_grouped_matmul(x, w.packed, w.block_scale, w.global_scale)
        return _tk.linear_fp8_tma.fp8_grouped_gemv(x, w, groups)
    return grouped_linear(x, w.dequantize(x.dtype), groups)


SWIGLU_KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # where the one-launch SwiGLU was checked bitwise


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``SharedExpert.swiglu_kernel``: ``clamped_swiglu(gate, up, limit)`` bit for bit in one launch
    (``moe_prefill.swiglu``: the clamps before SiLU, silu in fp32 by libdevice, the reference's
    roundings) for bf16 / fp16 CUDA tensors of one shape; the reference otherwise (fp32, CPU,
    an autograd graph to build)."""
    if (kernel_can_take(gate) and gate.dtype in SWIGLU_KERNEL_DTYPES and up.dtype == gate.dtype
            and up.shape == gate.shape and gate.is_contiguous() and up.is_contiguous()
            and not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad))):
        return _tk.moe_prefill.swiglu(gate, up, limit, None)
    return clamped_swiglu(gate, up, limit)


def act_quant_nvfp4(x: torch.Tensor, global_scale) -> torch.Tensor:
    """NVFP4 fake quant of activations with the given global scale (runtime or input_scale)."""
    if kernel_can_take(x) and x.shape[-1] % 16 == 0:
        return _tk.act_quant_nvfp4.fake_quant_nvfp4_kernel(x, global_scale)
    return fake_quant_nvfp4(x, global_scale)


def moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, w3, w2,
               limit: float | None, shared: tuple | None = None) -> torch.Tensor:
    """Routed-expert output [T, H] for tokens x [T, H] with top-k ``ids``/``weights`` [T, k];
    w1/w3/w2 are ``dsv4lab.quant.stacked.StackedNVFP4`` / ``StackedMXFP4`` (or lists of
    ``NVFP4Weight`` / ``MXFP4Weight``, stacked here: stack once per layer and pass the stack to
    avoid the copy). MXFP4 stacks run the TMA kernels where they apply (sm_90+, H and I multiples
    of 512), else the reference.

    ``shared``: the shared expert's (w1, w3, w2) as one-expert stacks (``quant.stacked.stack_one``);
    the result is then routed + shared, each rounded to x.dtype and added in x.dtype (``MoE.forward``'s
    sum), and the TMA kernels run the shared expert as one more pair in their two GEMV launches.

    Plain stacks (unquantised tensors w1 / w3 [E, I, H], w2 [E, H, I]: BF16 originals, fp32
    experts) run ``moe_decode_plain`` on CUDA (the chosen experts' rows only), else the reference."""
    if all(isinstance(w, torch.Tensor) for w in (w1, w3, w2)):
        return _moe_decode_plain(x, ids, weights, w1, w3, w2, limit, shared)
    w1, w3, w2 = (w if isinstance(w, (StackedNVFP4, StackedMXFP4)) else stack_experts(w) for w in (w1, w3, w2))
    if len({type(w) for w in (w1, w3, w2)}) != 1:
        raise ValueError(f"w1/w3/w2 must share one format, got {[type(w).__name__ for w in (w1, w3, w2)]}")
    if kernel_can_take(x) and w1.packed.is_cuda:
        if not (isinstance(w1, StackedMXFP4) and not _tk.moe_decode_tma.tma_moe_supported(x, w1, w3, w2)):
            return _tk.moe_decode.moe_decode_triton(x, ids, weights, w1, w3, w2, limit, shared=shared)
    routed = moe_decode_ref(x, ids, weights, w1, w3, w2, limit)
    if shared is None:
        return routed
    one = torch.zeros((x.shape[0], 1), dtype=torch.long, device=x.device)
    return routed.to(x.dtype) + moe_decode_ref(x, one, torch.ones(one.shape, device=x.device), *shared, limit).to(x.dtype)


def _moe_decode_plain(x, ids, weights, w1, w3, w2, limit, shared):
    """``moe_decode`` for plain stacks; ``shared`` (plain one-expert stacks) is added as a second call."""
    if kernel_can_take(x) and w1.is_cuda:
        plain = _tk.moe_decode_plain
        run = plain.moe_decode_plain_triton if plain.plain_moe_supported(x, w1, w3, w2) else moe_decode_plain_ref
    else:
        run = moe_decode_plain_ref
    routed = run(x, ids, weights, w1, w3, w2, limit)
    if shared is None:
        return routed
    one = torch.zeros((x.shape[0], 1), dtype=torch.long, device=x.device)
    return routed.to(x.dtype) + run(x, one, torch.ones(one.shape, device=x.device), *shared, limit).to(x.dtype)


moe_decode.folds_shared = True  # MoE.forward may pass the shared expert (``shared=``) to this kernel


def moe_prefill(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, w3, w2, limit: float | None,
                weight_before_w2: bool = False) -> torch.Tensor:
    """Routed-expert output [T, H] for prefill tokens x [T, H] with top-k ``ids`` / ``weights``
    [T, k] (``Experts.prefill_kernel``): the grouped-GEMM kernels (``moe_prefill.moe_prefill_triton``)
    for CUDA tokens and same-format NVFP4 / MXFP4 stacks they support (sm_90+), else
    ``moe_prefill_ref``. Stacks as for ``moe_decode``."""
    w1, w3, w2 = (w if isinstance(w, (StackedNVFP4, StackedMXFP4)) else stack_experts(w) for w in (w1, w3, w2))
    if kernel_can_take(x) and w1.packed.is_cuda:
        if _tk.moe_prefill.moe_prefill_supported(x, w1, w3, w2):
            return _tk.moe_prefill.moe_prefill_triton(x, ids, weights, w1, w3, w2, limit, weight_before_w2)
    return moe_prefill_ref(x, ids, weights, w1, w3, w2, limit, weight_before_w2)


def compressor_pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """softmax(gate, dim=2) weighted sum of kv [B, nW, L, d] -> [B, nW, d]: the CuTeDSL kernel on
    CUDA with cutlass importable, ``compressor_pool_ref`` elsewhere."""
    return pool_cute.compressor_pool(kv, gate)


def compressor_decode(comp: Compressor, kv: torch.Tensor, z: torch.Tensor, pos: torch.Tensor,
                      st: CompressorState) -> torch.Tensor:
    """``Compressor.decode`` after its projections kv = wkv(x), z = wgate(x) (the raw gate, no
    ape): the Triton kernel for CUDA tensors of a kernel dtype, ``comp.decode_window`` (the
    reference) elsewhere. Returns the entry count (pos + 1) // ratio on the device."""
    if kernel_can_take(kv) and st.ring_kv.is_cuda:
        return _tk.compressor_decode.compressor_decode_triton(
            kv, z, pos, st.ring_kv, st.ring_gate, st.entries, comp.ape, comp.norm.weight, comp.rotary.inv_freq,
            comp.norm.eps, comp.overlap)
    return comp.decode_window(kv, comp.gate_logits(z, (pos % comp.ratio).view(1)), pos, st)


def prefill_attention(q: torch.Tensor, sink: torch.Tensor, scale: float, window: int, window_keys: torch.Tensor,
                      q_start: int, k_start: int, entries: torch.Tensor | None = None, ratio: int = 0,
                      selected: torch.Tensor | None = None, q_block: int | None = None, k_block: int | None = None,
                      block_bytes: int = 0) -> torch.Tensor:
    """``bounded_attention`` (same signature): the Triton kernel for CUDA keys of a kernel dtype,
    the PyTorch reference elsewhere."""
    if kernel_can_take(window_keys):
        return _tk.attention_bounded.bounded_attention_triton(q, sink, scale, window, window_keys, q_start, k_start,
                                                              entries, ratio, selected)
    return bounded_attention(q, sink, scale, window, window_keys, q_start, k_start, entries, ratio, selected,
                             q_block, k_block, block_bytes)


def _mhc_kernel_can_take(streams: torch.Tensor, *params: torch.Tensor) -> bool:
    if streams.dim() != 4 or not kernel_can_take(streams):
        return False
    dev = streams.device
    for p in params:  # a loop, not all(genexpr): 4 calls an eager layer
        if p.device != dev:
            return False
    return True


def _mhc_params_fit(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, mix: int,
                    n_scale: int) -> bool:
    """fn [mix, hc*D], base [mix], scale [n_scale] (else the reference runs and raises its own error)."""
    hc, D = streams.shape[-2:]
    return fn.shape == (mix, hc * D) and base.shape == (mix,) and scale.shape == (n_scale,)


def mhc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
            hc_eps: float, norm_eps: float, *, sinkhorn: bool = True, block_norm_weight: torch.Tensor | None = None,
            block_norm_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre, post, comb, collapsed) of one mHC site for streams [B,S,hc,D]: ``mhc_fused.hc_pre`` (one
    launch) on CUDA, ``mix_weights`` + ``collapse`` elsewhere. ``sinkhorn=False``: comb's logits
    instead (``mix_logits``), for an ``mhc_post`` that projects them itself. ``block_norm_weight``
    (declared by ``norms_with``: the ``rms_norm`` slot's result): the block's RMSNorm of collapsed
    instead of collapsed, ``rms_norm(collapsed, block_norm_weight, block_norm_eps)`` (on CUDA in the
    same launch)."""
    hc = streams.shape[-2] if streams.dim() == 4 else 0
    if (_mhc_kernel_can_take(streams, fn, base, scale) and _mhc_params_fit(streams, fn, base, scale, (2 + hc) * hc, 3)
            and (block_norm_weight is None or block_norm_weight.dtype in KERNEL_DTYPES)):
        return _tk.mhc_fused.hc_pre(streams, fn, base, scale, iters, hc_eps, norm_eps, sinkhorn=sinkhorn,
                                    block_norm_weight=block_norm_weight, block_norm_eps=block_norm_eps)
    if sinkhorn:
        pre, post, comb = mix_weights(streams, fn, base, scale, iters, hc_eps, norm_eps)
    else:
        pre, post, comb = mix_logits(streams, fn, base, scale, hc_eps, norm_eps)
    collapsed = collapse(pre, streams)
    if block_norm_weight is not None:
        collapsed = rms_norm(collapsed, block_norm_weight, block_norm_eps)
    return pre, post, comb, collapsed


def mhc_post(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
             sinkhorn_iters: int = 0, hc_eps: float = 0.0, logits_settled: bool = False) -> torch.Tensor:
    """New streams of one mHC site (``HyperConnection.expand``): ``mhc_fused.hc_post`` on CUDA when
    block_out has the streams' dtype and every shape is the un-broadcast one, the reference elsewhere.
    ``sinkhorn_iters`` > 0: comb holds logits (``mhc_pre(sinkhorn=False)``), projected here first;
    ``logits_settled``: they were written at least two launches ago (a block ran since), so the
    kernel may read them before its PDL wait."""
    if _mhc_kernel_can_take(streams, block_out, post, comb) and block_out.dtype == streams.dtype:
        B, S, hc, D = streams.shape
        if block_out.shape == (B, S, D) and post.shape == (B, S, hc) and comb.shape == (B, S, hc, hc):
            return _tk.mhc_fused.hc_post(streams, block_out, post, comb, sinkhorn_iters=sinkhorn_iters,
                                         hc_eps=hc_eps, logits_settled=logits_settled)
    if sinkhorn_iters:
        comb = sinkhorn(comb, sinkhorn_iters, hc_eps)
    return HyperConnection.expand(streams, block_out, post, comb)


mhc_pre.takes_pending_sinkhorn = True   # HyperConnection.defers_sinkhorn: this pair projects comb in mhc_post
mhc_post.takes_pending_sinkhorn = True

# An expansion and the next site's pre in one launch (on by default; DSV4LAB_HC_POST_PRE=0 or
# ``set_post_pre(False)`` turns it off); the setting is ``mhc_post.then_pre`` itself. Full depth, graph:
# H200 13.64 -> 13.49 ms with both joins (stop 55); H100 16.23 -> 16.04 with this one alone, 16.27 with
# the gate + route join alone (stop 57). Eager was 22-26 % slower with both on the H200's host at stop
# 55, 23 % faster in an H100 round; stop 57's H100 runs put eager at 94-164 ms across ten processes
# of one machine, the joins' either side, with host_op_us 6.9-10.7: host noise, not the join, and the
# join takes 35 Python calls off a CSA or HCA layer step (CPU stub, deterministic)


def mhc_post_pre(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
                 norm_eps: float, *, sinkhorn_iters: int = 0, post_eps: float = 0.0, logits_settled: bool = False,
                 sinkhorn: bool = True, block_norm_weight: torch.Tensor | None = None, block_norm_eps: float = 0.0
                 ) -> tuple | None:
    """``mhc_post`` and then ``mhc_pre`` of the next site over the new streams as one launch
    (``mhc_fused.hc_post_pre``, the same bits): (new streams, pre, post, comb, collapsed or normed),
    or None where it does not apply (off CUDA, a shape ``post_pre_fits`` declines): the caller then
    runs the two. ``HyperConnection.combine_then`` calls it while ``set_post_pre`` is on."""
    if not (_mhc_kernel_can_take(streams, block_out, post, comb, fn, base, scale) and block_out.dtype == streams.dtype):
        return None
    B, S, hc, D = streams.shape
    if not (block_out.shape == (B, S, D) and post.shape == (B, S, hc) and comb.shape == (B, S, hc, hc)
            and _mhc_params_fit(streams, fn, base, scale, (2 + hc) * hc, 3)
            and (block_norm_weight is None or (block_norm_weight.dtype in KERNEL_DTYPES
                                               and block_norm_weight.device == streams.device))):
        return None
    return _tk.mhc_fused.hc_post_pre(streams, block_out, post, comb, fn, base, scale, iters, hc_eps, norm_eps,
                                     sinkhorn_iters=sinkhorn_iters, post_eps=post_eps, logits_settled=logits_settled,
                                     sinkhorn=sinkhorn, block_norm_weight=block_norm_weight,
                                     block_norm_eps=block_norm_eps)


def set_post_pre(on: bool) -> bool:
    """Turn the one-launch expansion + next pre on or off for this process (``DSV4LAB_HC_POST_PRE``
    at import); returns the previous setting. Off, ``mhc_post.then_pre`` is None, so the decode
    layer pays one attribute read for it (``HyperConnection.combine_then``)."""
    if not isinstance(on, bool):
        raise TypeError(f"set_post_pre(on) takes True or False; got {on!r}")
    prev = getattr(mhc_post, "then_pre", None) is not None
    mhc_post.then_pre = mhc_post_pre if on else None   # HyperConnection.combine_then: this expansion fuses
    return prev                                         # with a next site whose pre is ``pre_fuses_with``


mhc_post.pre_fuses_with = mhc_pre
set_post_pre(os.environ.get("DSV4LAB_HC_POST_PRE", "1") != "0")


def mhc_head_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
                 norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(pre, collapsed) of the HyperHead: ``mhc_fused.hc_head_pre`` on CUDA, ``head_weights`` +
    ``collapse`` elsewhere."""
    hc = streams.shape[-2] if streams.dim() == 4 else 0
    if _mhc_kernel_can_take(streams, fn, base, scale) and _mhc_params_fit(streams, fn, base, scale, hc, 1):
        return _tk.mhc_fused.hc_head_pre(streams, fn, base, scale, eps, norm_eps)
    pre = head_weights(streams, fn, base, scale, eps, norm_eps)
    return pre, collapse(pre, streams)


def decode_attention(q: torch.Tensor, sink: torch.Tensor, scale: float, window_ring: torch.Tensor, pos: torch.Tensor,
                     entries: torch.Tensor | None = None, n_entries: torch.Tensor | None = None,
                     selected: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
                     q_eps: float | None = None) -> torch.Tensor:
    """``dsv4lab.model.decode_attention.decode_attention`` (same signature): the Triton kernel for
    CUDA keys of a kernel dtype, the PyTorch reference elsewhere. The extras (``unropes_with`` /
    ``ropes_q_with``: the rope_kernel whose results they give): ``inv_freq``, the output also inverse-rotated at
    ``pos`` as ``norm_rope(out, pos, inv_freq, inverse=True)`` gives it (on CUDA in the combine
    launch); with ``q_eps`` too, q is wq_b's raw output, first ``norm_rope(q, pos, inv_freq, q_eps)``
    (on CUDA in the split programs)."""
    if q_eps is not None and inv_freq is None:
        raise ValueError(f"decode_attention: q_eps={q_eps} (q still to normalise and rotate) needs inv_freq")
    if kernel_can_take(window_ring):
        return _tk.attention_decode.decode_attention_triton(q, sink, scale, window_ring, pos, entries, n_entries,
                                                            selected, inv_freq=inv_freq, q_eps=q_eps)
    if q_eps is not None:
        q = norm_rope(q, pos.view(1), inv_freq, q_eps)
    out = decode_attention_ref(q, sink, scale, window_ring, pos, entries, n_entries, selected)
    return out if inv_freq is None else norm_rope(out, pos.view(1), inv_freq, inverse=True, inplace=True)


def index_scores_decode(q: torch.Tensor, w_raw: torch.Tensor, keys: torch.Tensor, n_valid: torch.Tensor,
                        w_scale: float, positions: torch.Tensor | None = None,
                        inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """``dsv4lab.model.indexer.index_scores_decode`` (same signature): the Triton kernel for CUDA
    keys of a kernel dtype, the PyTorch reference elsewhere. ``positions`` / ``inv_freq``
    (``ropes_q_with``: the rope_kernel whose result it gives): q is wq_b's raw output, first
    ``norm_rope(q, positions, inv_freq)`` (on CUDA in the scores kernel's programs)."""
    if (positions is None) != (inv_freq is None):
        raise ValueError("index_scores_decode: positions and inv_freq come together (q still to rotate); got "
                         f"positions {'given' if positions is not None else 'None'}, "
                         f"inv_freq {'given' if inv_freq is not None else 'None'}")
    if kernel_can_take(keys) and q.dtype in KERNEL_DTYPES:
        return _tk.indexer_decode.index_scores_decode_triton(q, w_raw, keys, n_valid, w_scale, positions=positions,
                                                             inv_freq=inv_freq)
    if positions is not None:
        q = norm_rope(q, positions, inv_freq)
    return index_scores_decode_ref(q, w_raw, keys, n_valid, w_scale)


def index_scores_prefill(q: torch.Tensor, w_raw: torch.Tensor, keys: torch.Tensor, n_valid: torch.Tensor,
                         w_scale: float) -> torch.Tensor:
    """``dsv4lab.model.indexer.index_scores_prefill`` (same signature): the Triton kernel for CUDA
    keys of a kernel dtype, the PyTorch reference elsewhere."""
    if kernel_can_take(keys) and q.dtype in KERNEL_DTYPES:
        return _tk.indexer_prefill.index_scores_prefill_triton(q, w_raw, keys, n_valid, w_scale)
    return index_scores_prefill_ref(q, w_raw, keys, n_valid, w_scale)


def index_top_k_decode(scores: torch.Tensor, n_valid: torch.Tensor, k: int) -> torch.Tensor:
    """``dsv4lab.model.indexer.index_top_k_decode`` (same signature): one Triton launch for CUDA fp32
    scores [B,1,T] of up to ``indexer_topk.TOPK_MAX_ENTRIES`` entries, the reference elsewhere."""
    if kernel_can_take(scores) and scores.dtype == torch.float32 and scores.dim() == 3 and scores.shape[1] == 1:
        if scores.shape[-1] <= _tk.indexer_topk.TOPK_MAX_ENTRIES:
            return _tk.indexer_topk.index_top_k_decode_triton(scores, n_valid, k)
    return index_top_k_decode_ref(scores, n_valid, k)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``dsv4lab.model.norms.rms_norm`` (RMSNorm's math): one Triton launch on CUDA."""
    if kernel_can_take(x) and weight.dtype in KERNEL_DTYPES:
        nr = _tk.norm_rope
        return nr.launch_norm_rope(x, torch.promote_types(weight.dtype, x.dtype), norm=nr.NORM_WEIGHTED, eps=eps,
                                   weight=weight, one_head=True)
    return rms_norm_ref(x, weight, eps)


def norm_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float | None = None,
              weight: torch.Tensor | None = None, inverse: bool = False, fp8_nope: bool = False,
              inplace: bool = False, ring: torch.Tensor | None = None) -> torch.Tensor:
    """``norm_rope_ref`` (same signature; x [..., S, H, D], positions [S] on the device): one Triton
    launch on CUDA, the angles computed from the positions there (no tables, no host sync).
    ``inplace`` (RoPE alone): the kernel may rewrite x's RoPE channels in place (the caller no
    longer needs x) and reads / writes only those. ``ring``: the same launch also writes the
    result into the decode ring (a ring in another dtype or layout: the reference's index_copy_)."""
    if x.dim() < 3 or x.shape[-3] != positions.numel() or 2 * inv_freq.shape[-1] > x.shape[-1]:
        raise ValueError(f"norm_rope: x must be [..., S, H, D] with S = len(positions) and D >= 2 * len(inv_freq); "
                         f"got x {tuple(x.shape)}, {positions.numel()} positions, {inv_freq.shape[-1]} frequencies "
                         "(one head: unsqueeze(-2))")
    if kernel_can_take(x) and (weight is None or weight.dtype in KERNEL_DTYPES) and x.shape[-1] % 2 == 0:
        if ring is not None:
            check_ring(x, positions, ring)
        nr = _tk.norm_rope
        norm = nr.NORM_NONE if eps is None else nr.NORM_PLAIN if weight is None else nr.NORM_WEIGHTED
        out_dtype = x.dtype if norm != nr.NORM_WEIGHTED else torch.promote_types(weight.dtype, x.dtype)
        fused_ring = ring is not None and ring.dtype == out_dtype and ring.stride(-1) == 1
        y = nr.launch_norm_rope(x, out_dtype, norm=norm, eps=eps or 0.0, weight=weight, positions=positions,
                                inv_freq=inv_freq, inverse=inverse, fp8_nope=fp8_nope, inplace=inplace,
                                ring=ring if fused_ring else None)
        if ring is not None and not fused_ring:
            ring.index_copy_(1, positions % ring.shape[1], y.squeeze(-2).to(ring.dtype))
        return y
    return norm_rope_ref(x, positions, inv_freq, eps, weight, inverse, fp8_nope, inplace, ring)


norm_rope.takes_ring = True  # Attention.decode hands it the ring (see norm_rope_ref.takes_ring)


def norm_pair(a: torch.Tensor, q_weight: torch.Tensor, q_eps: float, kv: torch.Tensor, positions: torch.Tensor,
              inv_freq: torch.Tensor, kv_weight: torch.Tensor, kv_eps: float, fp8_nope: bool,
              ring: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``Attention.norm_pair_kernel``: one decode token's ``rms_norm(a, q_weight, q_eps)`` and
    ``norm_rope(kv, positions, inv_freq, kv_eps, kv_weight, fp8_nope=..., ring=ring)`` in one launch
    (``norm_rope.launch_norm_pair``); None where it does not fit (the caller runs the two slots)."""
    if (kernel_can_take(a) and kernel_can_take(kv) and q_weight.dtype in KERNEL_DTYPES
            and kv_weight.dtype in KERNEL_DTYPES and positions.device == a.device and ring.device == a.device):
        return _tk.norm_rope.launch_norm_pair(a, q_weight, q_eps, kv, kv_weight, kv_eps, positions, inv_freq,
                                              fp8_nope, ring)
    return None


# What an entry point's extra arguments reproduce of another slot (Attention / Indexer check it before
# handing work over): the q_norm + kv pair both norm launches; decode attention's ``inv_freq=`` the
# rope_kernel's inverse RoPE and its ``q_eps=`` the q norm + RoPE; the indexer scores' ``positions=``
# the indexer's q RoPE; mHC pre's ``block_norm_weight=`` the layer norm after it (HyperConnection).
rms_norm.pairs_with = norm_rope.pairs_with = norm_pair
mhc_pre.norms_with = rms_norm
decode_attention.unropes_with = decode_attention.ropes_q_with = norm_rope
index_scores_decode.ropes_q_with = norm_rope


def route(logits: torch.Tensor, top_k: int, scoring: str, scale: float, bias: torch.Tensor | None = None,
          tid2eid: torch.Tensor | None = None, input_ids: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``dsv4lab.model.moe.route`` (same signature): one Triton launch on CUDA (up to
    ``ROUTE_MAX_EXPERTS`` experts, one program's row), the reference elsewhere."""
    if not 0 < top_k <= logits.shape[-1] or (tid2eid is not None and input_ids is None):
        raise ValueError(f"route: top_k must be in 1..{logits.shape[-1]} (the experts) and hash routing needs "
                         f"input_ids; got top_k={top_k}, input_ids {'missing' if input_ids is None else 'given'}")
    if (kernel_can_take(logits) and logits.dim() == 2 and logits.shape[-1] <= ROUTE_MAX_EXPERTS
            and scoring in ("sqrtsoftplus", "sigmoid", "softmax")):
        return _tk.router_topk.route_triton(logits, top_k, scoring, scale, bias, tid2eid, input_ids)
    return route_ref(logits, top_k, scoring, scale, bias, tid2eid, input_ids)


# DSV4LAB_GATE_ROUTE=1 (or ``set_gate_route(True)``): the router's gate GEMV and its route in one
# launch; the setting is ``route.with_gate`` itself. Opt-in: 61 launches a token fewer but no graph gain
# measured (stop 57, H100: 16.27 ms alone against 16.23 without either join, 16.05-16.07 with both
# against 16.04 with the expansion + pre join alone)


def gate_route(x: torch.Tensor, w: torch.Tensor, top_k: int, scoring: str, scale: float,
               bias: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
               input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``route(plain_linear(x, w), ...)`` as one launch (``gate_route.gate_route_triton``: the same
    logits bits, so the same ids) for bf16 / fp16 decode rows on CUDA: (ids, weights), or None where
    it does not apply (the caller runs the two). ``Router.forward`` calls it while ``set_gate_route``
    is on."""
    if not (kernel_can_take(x) and x.dtype != torch.float32 and w.shape[0] <= min(PLAIN_GEMV_MAX_N, ROUTE_MAX_EXPERTS)
            and (bias is None or bias.device == x.device) and (tid2eid is None or input_ids is not None)
            and _tk.gate_route.gate_route_takes(x, w, top_k, scoring)):
        return None
    return _tk.gate_route.gate_route_triton(x, w, top_k, scoring, scale, bias, tid2eid,
                                            None if input_ids is None else input_ids.to(x.device))


def set_gate_route(on: bool) -> bool:
    """Turn the one-launch gate + route on or off for this process (``DSV4LAB_GATE_ROUTE`` at import);
    returns the previous setting. Off, ``route.with_gate`` is None (``Router.forward`` reads one attribute)."""
    if not isinstance(on, bool):
        raise TypeError(f"set_gate_route(on) takes True or False; got {on!r}")
    prev = getattr(route, "with_gate", None) is not None
    route.with_gate = gate_route if on else None   # Router.forward: this route fuses with a gate whose
    return prev                                     # plain slot is ``gate_fuses_with``


route.gate_fuses_with = plain_linear
set_gate_route(os.environ.get("DSV4LAB_GATE_ROUTE", "0") == "1")
