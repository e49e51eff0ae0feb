"""Host-side helpers of the kernel launchers: the Python a launch runs before the kernel.

Triton's interpreter flag (``INTERPRET``) and the process-wide settings the kernels were checked
with (the interpreter patch for numpy >= 2.4, FP fusion on); ``cdiv`` / ``next_pow2`` without
Triton's per-call host cost; device facts kept per device (``device_capability``, ``num_sms``); the
tl.dot operand dtype; per-weight launch plans (``weight_cached``) and TMA descriptors re-based onto
another tensor (``rebased``); kept buffers for kernels' internal operands (``scratch``) and split-K
tile counters (``counters``), one per decode lane; the MoE kernels' flat expert ids. No
``@triton.jit`` function lives here: the device-helper modules import this one, never the reverse.

Imports triton (import this module only from kernel modules; ``dsv4lab.kernels`` stays
triton-free). Under ``TRITON_INTERPRET=1`` it patches the interpreter for numpy >= 2.4 once.
"""
from __future__ import annotations

import functools
import math
import os
import weakref
from typing import Callable, TypeVar

import numpy as np
import torch
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..lanes import current_lane


def patch_interpreter_for_numpy2() -> None:
    """TRITON_INTERPRET=1 with numpy >= 2.4: triton 3.6's interpreter turns 0-d scalars into
    1-element arrays and calls ``int()`` on them in ``range(...)`` bounds, which numpy 2.4 refuses.
    Patch ``tensor.__index__`` to take the single element. No-op unless interpreting."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    from triton.runtime import interpreter as interp  # only exists to be patched when interpreting

    if getattr(interp, "_dsv4lab_patched", False):
        return
    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    interp._dsv4lab_patched = True


patch_interpreter_for_numpy2()

# Every kernel of dsv4lab.kernels was checked and timed with Triton's FP fusion (FMA contraction) on: its default
# through 3.9, which warns that 3.10 turns it off. Kernels whose products must round as the
# reference's separate ones launch with ``enable_fp_fusion=False`` themselves; a setting of the
# user's own wins.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
T = TypeVar("T")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host ints. ``triton.cdiv`` is a ``constexpr_function`` in triton 3.6: ~2 us
    of argument unwrapping per host call, paid several times per launch."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as ``triton.next_power_of_2`` without its host cost."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


_PER_WEIGHT: dict[int, tuple[weakref.ref, dict]] = {}  # id(tensor) -> (weakref to it, {key: value})
PER_WEIGHT_ENTRIES = 8  # per tensor; a miss beyond this clears its entries (a swapped .data, dtypes)


def _drop_weight(i: int, ref: weakref.ref) -> None:
    if _PER_WEIGHT.get(i, (None,))[0] is ref:
        del _PER_WEIGHT[i]


def weight_cached(t: torch.Tensor, key: tuple, build: Callable[[], T]) -> T:
    """``build()`` once per (tensor object ``t``, its data_ptr / shape / strides, ``key``): what the
    launch of a weight derives from it alone (configs, split arithmetic, TMA descriptors over it).

    Safe against stale entries: keyed on ``t``'s identity through a weak reference (a new weight
    object, e.g. after ``QLinear.set_weight``, misses; an entry goes when its tensor dies, so no
    dead weight is kept alive by the cache) and on its data_ptr / shape / strides (``t.data = ...``
    misses). ``key`` must name everything else the value depends on (other tensors by id AND
    data_ptr, dtypes, devices, env switches)."""
    i = id(t)
    slot = _PER_WEIGHT.get(i)
    if slot is None or slot[0]() is not t:
        slot = _PER_WEIGHT[i] = (weakref.ref(t, lambda r, i=i: _drop_weight(i, r)), {})
    full = (t.data_ptr(), t.shape, t.stride(), key)
    entries = slot[1]
    v = entries.get(full)
    if v is None:
        if len(entries) >= PER_WEIGHT_ENTRIES:
            entries.clear()
        v = entries[full] = build()
    return v


def rebased(template: TensorDescriptor, base: torch.Tensor) -> TensorDescriptor:
    """``template`` over another tensor of the same shape, strides and dtype (16-byte aligned, as
    every allocation is): a copy with ``base`` swapped, skipping ``TensorDescriptor``'s validation
    (~4 us a call) that ``template`` already passed for this geometry."""
    if not hasattr(template, "__dict__"):  # a triton whose descriptor keeps its fields in slots: rebuild
        return template if base is None else TensorDescriptor(base, template.shape, template.strides,
                                                              template.block_shape)
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(template.__dict__)
    d.base = base
    return d


_SCRATCH: dict = {}  # (tag, shape, dtype, device, lane) -> a kept buffer (never dropped: graphs keep its address)
SCRATCH_IDS: set = set()  # id() of each kept buffer (alive forever, so an id names one buffer)
SCRATCH_MAX_ELEMS = 1 << 22  # larger requests (prefill sizes) get a fresh allocation instead


def scratch(tag: str, shape: tuple, dtype: torch.dtype, device: torch.device, lane: int | None = None) -> torch.Tensor:
    """A buffer for a kernel's internal operands (x pairs, split-K partials, the MoE's SwiGLU rows):
    written and read back by the launches of one call, never handed to the caller. One kept tensor
    per (tag, shape, dtype, device) instead of an allocation per call (~3-5 us of host each on the
    H200's host, ~30 a V4-Pro eager decode layer). Safe because those launches run in order on the
    device's stream: a later call's first write waits for the earlier call's last read (a PDL
    launch waits for the previous grid before its first access). Kept forever: a CUDA graph
    captured over it holds its address. Requests above ``SCRATCH_MAX_ELEMS`` are allocated fresh.
    One buffer per decode lane (``dsv4lab.lanes``; ``lane``: that lane's, default the current one):
    the side lane's launches run beside the main's."""
    key = (tag, shape, dtype, device, current_lane() if lane is None else lane)
    t = _SCRATCH.get(key)
    if t is None:
        t = torch.empty(shape, dtype=dtype, device=device)
        if math.prod(shape) <= SCRATCH_MAX_ELEMS:
            _SCRATCH[key] = t
            SCRATCH_IDS.add(id(t))
    return t


_COUNTERS: dict = {}  # (device type, index, lane) -> split-K tile counters


def counters(device: torch.device, n: int) -> torch.Tensor:
    """Split-K tile counters (zero at rest: each tile's last program resets its own), one array per
    device and decode lane (``dsv4lab.lanes``: two lanes' launches run at once)."""
    key = (device.type, device.index, current_lane())
    c = _COUNTERS.get(key)
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = c
    return c


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int]:
    """The CUDA capability of ``device``, kept per device: the kernels' support checks ask on every
    call (a device-properties query each time)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``, kept per device (split rules ask on every decode
    launch: a properties query each time otherwise); 4 for the CPU (interpreter, stubs)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def dot_dtype(x: torch.Tensor | torch.dtype):
    """The tl.dot operand dtype for activations x (a tensor or its dtype)."""
    if INTERPRET:  # triton 3.6's interpreter mis-computes bf16 tl.dot under numpy 2.x; fp32 is
        return tl.float32  # the same math here (operands are exact bf16 values)
    return tl.float16 if getattr(x, "dtype", x) == torch.float16 else tl.bfloat16


def expert_ids(ids: torch.Tensor) -> torch.Tensor:
    """The MoE kernels' flat expert ids [T * k]: the router's int64 ids as they are (the kernels load
    either width), anything else as int32; a ``.to(int32)`` was one more CUDA kernel a decode layer."""
    flat = ids.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):
        flat = flat.to(torch.int32)
    return flat if flat.is_contiguous() else flat.contiguous()
