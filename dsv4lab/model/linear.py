"""QLinear: one linear layer whose weight may stay quantised, run under a precision mode.

Modes (DESIGN section 4; the words are dsv4lab.quant.modes, shared with the policies):
  ``bf16``   weight dequantised once and cached in the compute dtype;
  ``w4a16``  quantised weight kept as stored, dequantised per call (Hopper's FP4 path);
  ``w4a4``   activations also fake-quantised to NVFP4 (global scale from runtime amax or the
             checkpoint ``input_scale``: ``act_scale``);
  ``w4a8``   activations fake-quantised to FP8 per 128 block, fp32 scales amax/448 (power-of-two
             scales with the ``act_fp8_pow2`` round trip);
  ``official`` DeepSeek's reference ``linear()``: a quantised (FP8/FP4) weight gets its input FP8
             per 128 with power-of-two scales, a plain weight runs plain.
A plain (unquantised) weight is an ``nn.Parameter`` and runs densely whatever the mode, except
that ``w4a4``/``w4a8`` still quantise its activations. ``round_trips`` holds the policy's
round-trip switches for this linear (only ``act_fp8_pow2`` applies: ``w4a16`` then behaves as
``official``). The grouped use (wo_a) never takes the official activation round trip: the
reference runs wo_a as a BF16 einsum.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..quant import activations as A
from ..quant.modes import LINEAR_MODES, ActScale, Mode, RoundTrip, as_act_scale, as_mode
from ..quant.weights import PlainWeight, QuantWeight
from .component import Component

MODES = LINEAR_MODES
ACT_FOR_MODE = {Mode.BF16: "none", Mode.W4A16: "none", Mode.W4A4: "nvfp4", Mode.W4A8: "fp8", Mode.OFFICIAL: "fp8_pow2"}


class QLinear(Component):
    """Linear y = x W^T with a plain Parameter or a QuantWeight, under a precision mode."""

    ROUND_TRIPS = (RoundTrip.ACT_FP8_POW2,)  # the round trips a policy can switch on here
    _offered: tuple[torch.Tensor, torch.Tensor] | None = None  # (x, y) from ``offer``; per call, not a switch

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.qweight = None  # dsv4lab.quant.weights.QuantWeight when quantised
        self.mode = Mode.W4A16
        self.act_scale = ActScale.AMAX
        self.round_trips: frozenset = frozenset()  # of RoundTrip; set by dsv4lab.precision
        self._dense_cache: torch.Tensor | None = None
        self.kernel: Callable | None = None  # optional fast path f(x, qweight) -> y
        self.act_kernel: Callable | None = None  # optional NVFP4 activation fake quant f(x, gs), bit-exact
        # optional grouped fast path f(x [..., G, in], qweight, G) -> [..., G, out/G] (``grouped``),
        # or None where it does not take the call (the row blocks then run ``kernel`` each)
        self.grouped_kernel: Callable | None = None
        # optional fast path f(x, weight) -> y for an unquantised weight (the bf16 decode GEMVs)
        self.plain_kernel: Callable | None = None
        # streamed precision (dsv4lab.precision.streaming): f(dtype) -> this call's dense weight, never kept
        self.weight_source: Callable[[torch.dtype], torch.Tensor] | None = None

    # ---------------------------------------------------------------- weights
    @property
    def quantized(self) -> bool:
        return self.qweight is not None

    @property
    def format(self) -> str:
        return self.qweight.format if self.qweight is not None else "plain"

    def set_weight(self, w) -> None:
        """Install a plain tensor (as Parameter) or a QuantWeight (kept quantised)."""
        if isinstance(w, PlainWeight):
            w = w.data
        if isinstance(w, QuantWeight):
            if tuple(w.shape) != (self.out_features, self.in_features):
                raise ValueError(f"weight shape {tuple(w.shape)} != {(self.out_features, self.in_features)}")
            self.qweight = w
            self.weight = None
        else:
            if tuple(w.shape) != (self.out_features, self.in_features):
                raise ValueError(f"weight shape {tuple(w.shape)} != {(self.out_features, self.in_features)}")
            self.qweight = None
            self.weight = nn.Parameter(w.detach().clone() if w.requires_grad else w, requires_grad=False)
        self._dense_cache = None
        self._groups_cache = None

    def set_mode(self, mode: str, act_scale: str | None = None) -> None:
        """One of LINEAR_MODES (``orig`` is a policy word: dsv4lab.precision swaps the weight)."""
        mode = as_mode(mode, LINEAR_MODES)
        if act_scale is not None:
            self.act_scale = as_act_scale(act_scale)
        self.mode = mode
        if mode != Mode.BF16:
            self._dense_cache = None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense matrix in ``dtype`` (cached only in ``bf16`` mode, and not while a
        ``weight_source`` streams it: then it lives for the one call that asked)."""
        if self.weight_source is not None:
            return self.weight_source(dtype)
        if self.qweight is None:
            return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)
        if self.mode == Mode.BF16:
            if self._dense_cache is None or self._dense_cache.dtype != dtype or self._dense_cache.device != self.qweight.device:
                self._dense_cache = self.qweight.dequantize(dtype)
            return self._dense_cache
        return self.qweight.dequantize(dtype)

    def memory_bytes(self) -> int:
        n = 0 if self.qweight is None else self.qweight.nbytes
        if self.weight is not None:
            n += self.weight.numel() * self.weight.element_size()
        if self._dense_cache is not None:
            n += self._dense_cache.numel() * self._dense_cache.element_size()
        return n

    # ---------------------------------------------------------------- compute
    def act_format(self, grouped: bool = False) -> str:
        """How this linear's input is quantised: "none", "nvfp4", "fp8" or "fp8_pow2"."""
        pow2 = RoundTrip.ACT_FP8_POW2 in self.round_trips
        if self.mode == Mode.W4A8:
            return "fp8_pow2" if pow2 else "fp8"
        if self.mode == Mode.OFFICIAL or (pow2 and self.mode == Mode.W4A16):
            return "fp8_pow2" if self.quantized and not grouped else "none"
        return ACT_FOR_MODE[self.mode]

    def quantize_input(self, x: torch.Tensor, grouped: bool = False) -> torch.Tensor:
        act = self.act_format(grouped)
        if act == "none":
            return x
        if act == "fp8":
            return A.fake_quant_fp8_block(x)
        if act == "fp8_pow2":
            return A.fake_quant_fp8_block(x, scale_format="e8m0")
        if self.act_scale == ActScale.INPUT_SCALE:
            scale = getattr(self.qweight, "input_scale", None) if self.qweight is not None else None
            if scale is None:
                raise ValueError("act_scale='input_scale' needs a checkpoint input_scale on this weight")
            gs = scale.to(x.device, torch.float32)
        else:
            gs = A.nvfp4_global_scale(x)
        return (self.act_kernel or A.fake_quant_nvfp4)(x, gs)

    def offer(self, x: torch.Tensor | None, y: torch.Tensor | None = None) -> None:
        """Hand this linear its output ``y`` for input ``x``, computed elsewhere (one batched launch
        for several linears of one x: ``Attention.plain_batch_kernel``): the next call returns ``y``
        if its input is ``x`` itself (forward hooks fire on it as usual; a pre-hook that replaces x
        computes afresh). The next call takes the offer either way; ``offer(None)`` withdraws it."""
        self.__dict__["_offered"] = None if x is None else (x, y)  # a per-call value: no Module bookkeeping

    def batchable(self, x: torch.Tensor) -> torch.Tensor | None:
        """The weight a batched launch may use for this call on x (an unquantised weight in x's
        dtype, ``plain_kernel`` installed, no activation quantisation, not streamed), else None."""
        w = self.weight
        if (w is None or self.weight_source is not None or w.dtype != x.dtype or self.act_format() != "none"
                or not self.uses_plain_kernel(x, w)):
            return None
        return w

    def pair_weight(self, x: torch.Tensor, pair_kernel: Callable):
        """The quantised weight ``pair_kernel`` may use for this call on x (``Attention.quant_pair_kernel``:
        two linears of one x in one launch): this linear's kernel is one whose outputs the pair
        reproduces (``pairs_with``), no activation quantisation, not streamed; else None."""
        if (not self.uses_kernel() or getattr(self.kernel, "pairs_with", None) is not pair_kernel
                or self.weight_source is not None or self.act_format() != "none"):
            return None
        return self.qweight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offered = self._offered
        if offered is not None:
            self.__dict__["_offered"] = None
            if offered[0] is x:
                return offered[1]
        x = self.quantize_input(x)
        if self.uses_kernel():
            return self.kernel(x, self.qweight)
        w = self.dense_weight(x.dtype)
        if self.uses_plain_kernel(x, w):
            return self.plain_kernel(x, w)
        return F.linear(x, w)

    def uses_plain_kernel(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Does this call run ``self.plain_kernel``? Installed, an unquantised weight, ``dense_weight``
        not overridden, and no autograd graph to build (the kernel has no backward)."""
        return (self.plain_kernel is not None and self.qweight is None and type(self).dense_weight is QLinear.dense_weight
                and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))

    def uses_kernel(self) -> bool:
        """Does a call run ``self.kernel``? Installed, a quantised weight, not ``bf16`` mode, and
        ``dense_weight`` not overridden (the kernel computes the stock dequantisation; a replaced
        one, e.g. a bug-zoo variant, runs as written)."""
        return (self.kernel is not None and self.qweight is not None and self.mode != Mode.BF16
                and type(self).dense_weight is QLinear.dense_weight)

    def _group_weights(self, groups: int) -> list | None:
        """The weight's G row blocks as weights of its format (views of the stored tensors,
        cached), or None where they do not split (FP8-block rows not whole 128-row scale blocks)."""
        c = getattr(self, "_groups_cache", None)
        if c is None or c[0] is not self.qweight or c[1] != groups:
            w, rows = self.qweight, self.out_features // groups
            ws = [w.row_block(g * rows, rows) for g in range(groups)]
            c = self._groups_cache = (self.qweight, groups, None if any(b is None for b in ws) else ws)
        return c[2]

    def grouped(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        """Block-diagonal use (grouped output projection): x [..., G, in] -> [..., G, out/G]."""
        x = self.quantize_input(x, grouped=True)
        if self.uses_kernel() and self.grouped_kernel is not None:  # all row blocks in one call
            y = self.grouped_kernel(x, self.qweight, groups)
            if y is not None:  # None: not this call (e.g. FP8-block with several tokens)
                return y
        blocks = self._group_weights(groups) if self.uses_kernel() else None
        if blocks is not None:  # one kernel call per row block: no dequantised copy of the weight
            xg = x.movedim(-2, 0).contiguous()  # [G, ..., in]
            return torch.stack([self.kernel(xg[g], wg) for g, wg in enumerate(blocks)], dim=-2)
        return grouped_linear(x, self.dense_weight(x.dtype), groups)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        if self.qweight is not None:
            # move quantised tensors to the new device but never change their dtypes
            self.qweight = self.qweight.to(fn(torch.empty(0)).device)
            self._dense_cache = None
            self._groups_cache = None
        return self

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, format={self.format}, mode={self.mode}"


def offer_pair(pair_kernel: Callable | None, x: torch.Tensor, a: "QLinear", b: "QLinear") -> bool:
    """Run linears a and b of the same x as one ``pair_kernel`` launch and ``offer`` each its output
    (each the bits of its own launch, so hooks on either fire on the same tensor either way). False
    where no kernel is given, a linear cannot take part (``QLinear.pair_weight``) or the kernel
    declines (then each runs on its own)."""
    if pair_kernel is None:
        return False
    wa = a.pair_weight(x, pair_kernel)
    wb = None if wa is None else b.pair_weight(x, pair_kernel)
    ys = None if wb is None else pair_kernel(x, wa, wb)
    if ys is None:
        return False
    a.offer(x, ys[0])
    b.offer(x, ys[1])
    return True


def grouped_linear(x: torch.Tensor, w: torch.Tensor, groups: int) -> torch.Tensor:
    """Block-diagonal linear: x [..., G, in] times row block g of the dense w [out, in] ->
    [..., G, out/G] (one bmm; the reference of ``QLinear.grouped_kernel``)."""
    w = w.view(groups, -1, x.shape[-1])  # [G, out/G, in]
    lead = x.shape[:-2]
    xg = x.reshape(-1, groups, x.shape[-1]).transpose(0, 1)  # [G, T, in]
    y = torch.bmm(xg, w.transpose(1, 2)).transpose(0, 1)  # [T, G, out/G]
    return y.reshape(*lead, groups, -1)
