"""Component implementations: the Triton kernel on CUDA (with triton importable), the PyTorch
reference elsewhere. Importing this module never imports triton.

* ``quant_linear(x, w)`` (alias ``nvfp4_linear``): ``QLinear.kernel``-compatible ``f(x, qweight) -> y``
  for NVFP4, MXFP4 and FP8-block weights; other formats, CPU tensors or unsupported dtypes take the
  reference (``w.dequantize`` + ``F.linear``).
* ``act_quant_nvfp4(x, global_scale)``: fake quant (drop-in for ``fake_quant_nvfp4``).
* ``moe_decode(x, ids, weights, w1, w3, w2, limit)``: routed experts for decode tokens.
* ``install_kernels(model)``: set ``.kernel = quant_linear`` on every NVFP4/MXFP4/FP8-block ``QLinear`` and
  ``.kernel = moe_decode`` on every routed ``Experts`` (CUDA only, returns how many);
  ``install_kernels(model, False)`` removes them. Per component: ``dsv4lab.analysis.components.use_kernels``.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def have_triton_cuda() -> bool:
    """True only with a CUDA device and triton importable (DSV4LAB_NO_KERNELS=1 forces False)."""
    if os.environ.get("DSV4LAB_NO_KERNELS", "0") == "1":
        return False
    return torch.cuda.is_available() and _triton_importable()


def _use_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in _KERNEL_DTYPES and have_triton_cuda()


KERNEL_FORMATS = ("nvfp4", "mxfp4", "fp8_block")


def weight_on_cuda(w) -> bool:
    """Is the stored tensor of a kernel-format QuantWeight on a CUDA device?"""
    t = getattr(w, "data" if getattr(w, "format", None) == "fp8_block" else "packed", None)
    return t is not None and t.is_cuda


def quant_linear(x: torch.Tensor, w) -> torch.Tensor:
    """y = x @ W^T for a ``QuantWeight`` W: NVFP4 through ``nvfp4_matmul``, MXFP4 / FP8-block
    through ``official_matmul`` (first call per shape checked against the reference) on CUDA;
    ``F.linear(x, w.dequantize(x.dtype))`` for anything else."""
    fmt = getattr(w, "format", None)
    if fmt in KERNEL_FORMATS and _use_kernel(x) and weight_on_cuda(w):
        if fmt == "nvfp4":
            from .nvfp4_matmul import nvfp4_matmul

            return nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale)
        from .official_matmul import supported, verified_official_matmul

        if supported(x, w):
            return verified_official_matmul(x, w)
    return F.linear(x, w.dequantize(x.dtype))


nvfp4_linear = quant_linear  # the name QLinear.kernel had when only NVFP4 had a kernel


def act_quant_nvfp4(x: torch.Tensor, global_scale) -> torch.Tensor:
    """NVFP4 fake quant of activations with the given global scale (runtime or input_scale)."""
    if _use_kernel(x) and x.shape[-1] % 16 == 0:
        from .nvfp4_act_quant import fake_quant_nvfp4_kernel

        return fake_quant_nvfp4_kernel(x, global_scale)
    from dsv4lab.quant.activations import fake_quant_nvfp4

    return fake_quant_nvfp4(x, global_scale)


def moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, w3, w2,
               limit: float | None) -> torch.Tensor:
    """Routed-expert output [T, H] for tokens x [T, H] with top-k ``ids``/``weights`` [T, k];
    w1/w3/w2 are ``kernels.moe_decode.StackedNVFP4`` / ``StackedMXFP4`` (or lists of
    ``NVFP4Weight`` / ``MXFP4Weight``, stacked here: stack once per layer and pass the stack to
    avoid the copy). MXFP4 stacks run the TMA kernels where they apply (sm_90+, H and I multiples
    of 512), else the reference."""
    from .moe_decode import StackedMXFP4, StackedNVFP4, moe_decode_ref, stack_experts  # no triton needed

    w1, w3, w2 = (w if isinstance(w, (StackedNVFP4, StackedMXFP4)) else stack_experts(w) for w in (w1, w3, w2))
    if len({type(w) for w in (w1, w3, w2)}) != 1:
        raise ValueError(f"w1/w3/w2 must share one format, got {[type(w).__name__ for w in (w1, w3, w2)]}")
    if _use_kernel(x) and w1.packed.is_cuda:
        from .moe_decode import moe_decode_triton

        if isinstance(w1, StackedMXFP4):
            from .moe_decode_tma import tma_moe_supported

            if not tma_moe_supported(x, w1, w3, w2):
                return moe_decode_ref(x, ids, weights, w1, w3, w2, limit)
        return moe_decode_triton(x, ids, weights, w1, w3, w2, limit)
    return moe_decode_ref(x, ids, weights, w1, w3, w2, limit)


def install_kernels(model: torch.nn.Module, enable: bool = True) -> int:
    """Install (or remove) the kernels on a whole model (or any module): ``quant_linear`` as the
    fast path of every NVFP4, MXFP4 and FP8-block ``QLinear`` and ``moe_decode`` as the fused decode of every NVFP4 or
    MXFP4 routed ``Experts`` block, on CUDA only; returns the count. Installs nothing when
    ``have_triton_cuda()`` is False (the reference stays in place). ``enable=False`` puts every
    component back on the reference. Same as ``dsv4lab.analysis.components.use_kernels(model)``
    (which also takes a component pattern)."""
    from dsv4lab.analysis.components import use_kernels

    return use_kernels(model, "**", enable, strict=False)
