"""Triton kernels for quantised DSV4 inference, each beside a plain PyTorch reference.

* ``kernels.nvfp4_matmul``    W4A16 matmul (split-K GEMV for M <= 16, tiled GEMM for prefill);
* ``kernels.nvfp4_gemv_tma``  the TMA-fed decode GEMV (M <= 16) that nvfp4_matmul takes on sm_90+;
* ``kernels.nvfp4_act_quant`` NVFP4 activation quantisation (fake quant + packed codes/scales);
* ``kernels.moe_decode``      MoE decode path (top-k experts, clamped SwiGLU, w2, weighted sum),
                              TMA-fed on sm_90+ (``kernels.moe_decode_tma``);
* ``kernels.official_matmul`` MXFP4 and FP8-block matmul (the official checkpoint formats);
* ``kernels.dispatch``        the public entry points: the kernel on CUDA with triton, the
                              PyTorch reference elsewhere. Importing ``kernels`` or
                              ``kernels.dispatch`` never imports triton.

See docs/kernels.md for layouts, tolerances and measured numbers.
"""
from __future__ import annotations

import os

__all__ = ["have_triton_cuda", "quant_linear", "nvfp4_linear", "moe_decode", "act_quant_nvfp4", "install_kernels"]


def patch_interpreter_for_numpy2() -> None:
    """TRITON_INTERPRET=1 with numpy >= 2.4: triton 3.6's interpreter turns 0-d scalars into
    1-element arrays and calls ``int()`` on them in ``range(...)`` bounds, which numpy 2.4 refuses.
    Patch ``tensor.__index__`` to take the single element. No-op unless interpreting."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter as interp

    if getattr(interp, "_dsv4lab_patched", False):
        return
    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    interp._dsv4lab_patched = True


def __getattr__(name):  # lazy: keep `import kernels` free of triton
    if name in __all__:
        from . import dispatch

        return getattr(dispatch, name)
    raise AttributeError(name)
