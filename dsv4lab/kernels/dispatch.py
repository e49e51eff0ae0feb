"""Component implementations: the kernel on CUDA (with triton / cutlass importable), the PyTorch
reference elsewhere. Importing this module imports neither triton nor cutlass: the kernel modules
are imported inside the calls that use them (lazily, for that reason).

* ``quant_linear(x, w)`` (alias ``nvfp4_linear``): ``QLinear.kernel``-compatible ``f(x, qweight) -> y``
  for NVFP4, MXFP4 and FP8-block weights; other formats, CPU tensors or unsupported dtypes take the
  reference (``w.dequantize`` + ``F.linear``).
* ``act_quant_nvfp4(x, global_scale)``: NVFP4 fake quant of activations (``QLinear.act_kernel``,
  drop-in for ``fake_quant_nvfp4``, bit-exact).
* ``moe_decode(x, ids, weights, w1, w3, w2, limit)``: routed experts for decode tokens.
* ``compressor_pool(kv, gate)``: the Compressor's softmax pool (CuTeDSL kernel).
* ``compressor_decode(comp, kv, z, pos, st)``: ``Compressor.decode_kernel``, the decode step after
  the two projections (ring write, masked pool + norm + RoPE + entry write) in one Triton launch.
* ``prefill_attention(q, sink, scale, window, window_keys, q_start, k_start, entries, ratio,
  selected, ...)``: ``Attention.kernel``, the bounded prefill attention (Triton).
Which component gets which: ``dsv4lab.kernels.install``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant.activations import fake_quant_nvfp4
from ..quant.stacked import StackedMXFP4, StackedNVFP4, stack_experts
from . import compressor_pool_cute as pool_cute
from .device import have_triton_cuda, kernel_can_take
from ..model.bounded_attention import bounded_attention
from ..model.compressor import Compressor
from ..model.state import CompressorState
from .moe_decode_ref import moe_decode_ref

KERNEL_FORMATS = ("nvfp4", "mxfp4", "fp8_block")

__all__ = ["KERNEL_FORMATS", "have_triton_cuda", "weight_on_cuda", "quant_linear", "nvfp4_linear",
           "act_quant_nvfp4", "moe_decode", "compressor_pool", "compressor_decode",
           "prefill_attention"]


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
            from .linear_nvfp4 import nvfp4_matmul  # lazy: imports triton

            return nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale)
        from .linear_official import supported, verified_official_matmul  # lazy: imports triton

        if supported(x, w):
            return verified_official_matmul(x, w)
    return F.linear(x, w.dequantize(x.dtype))


nvfp4_linear = quant_linear  # the name QLinear.kernel had when only NVFP4 had a kernel


def act_quant_nvfp4(x: torch.Tensor, global_scale) -> torch.Tensor:
    """NVFP4 fake quant of activations with the given global scale (runtime or input_scale)."""
    if kernel_can_take(x) and x.shape[-1] % 16 == 0:
        from .act_quant_nvfp4 import fake_quant_nvfp4_kernel  # lazy: imports triton

        return fake_quant_nvfp4_kernel(x, global_scale)
    return fake_quant_nvfp4(x, global_scale)


def moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, w3, w2,
               limit: float | None) -> torch.Tensor:
    """Routed-expert output [T, H] for tokens x [T, H] with top-k ``ids``/``weights`` [T, k];
    w1/w3/w2 are ``dsv4lab.quant.stacked.StackedNVFP4`` / ``StackedMXFP4`` (or lists of
    ``NVFP4Weight`` / ``MXFP4Weight``, stacked here: stack once per layer and pass the stack to
    avoid the copy). MXFP4 stacks run the TMA kernels where they apply (sm_90+, H and I multiples
    of 512), else the reference."""
    w1, w3, w2 = (w if isinstance(w, (StackedNVFP4, StackedMXFP4)) else stack_experts(w) for w in (w1, w3, w2))
    if len({type(w) for w in (w1, w3, w2)}) != 1:
        raise ValueError(f"w1/w3/w2 must share one format, got {[type(w).__name__ for w in (w1, w3, w2)]}")
    if kernel_can_take(x) and w1.packed.is_cuda:
        from .moe_decode import moe_decode_triton  # lazy: imports triton
        from .moe_decode_tma import tma_moe_supported

        if isinstance(w1, StackedMXFP4) and not tma_moe_supported(x, w1, w3, w2):
            return moe_decode_ref(x, ids, weights, w1, w3, w2, limit)
        return moe_decode_triton(x, ids, weights, w1, w3, w2, limit)
    return moe_decode_ref(x, ids, weights, w1, w3, w2, limit)


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
        from .compressor_decode import compressor_decode_triton  # lazy: imports triton

        return compressor_decode_triton(kv, z, pos, st.ring_kv, st.ring_gate, st.entries, comp.ape, comp.norm.weight,
                                        comp.rotary.inv_freq, comp.norm.eps, comp.overlap)
    return comp.decode_window(kv, comp.gate_logits(z, (pos % comp.ratio).view(1)), pos, st)


def prefill_attention(q: torch.Tensor, sink: torch.Tensor, scale: float, window: int, window_keys: torch.Tensor,
                      q_start: int, k_start: int, entries: torch.Tensor | None = None, ratio: int = 0,
                      selected: torch.Tensor | None = None, q_block: int | None = None, k_block: int | None = None,
                      block_bytes: int = 0) -> torch.Tensor:
    """``bounded_attention`` (same signature): the Triton kernel for CUDA keys of a kernel dtype,
    the PyTorch reference elsewhere."""
    if kernel_can_take(window_keys):
        from .attention_bounded import bounded_attention_triton  # lazy: heavy optional dependency

        return bounded_attention_triton(q, sink, scale, window, window_keys, q_start, k_start, entries, ratio, selected)
    return bounded_attention(q, sink, scale, window, window_keys, q_start, k_start, entries, ratio, selected,
                             q_block, k_block, block_bytes)
