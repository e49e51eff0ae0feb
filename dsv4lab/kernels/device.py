"""Where the kernels may run, without importing triton: the availability check and the launch-device guard.

Triton (and the CuTe launcher) launch on the *current* CUDA device and its current stream, not on
the device of the tensors they are given. With a model split over GPUs (device maps), a layer on
cuda:1 called while cuda:0 is current would run on GPU 0, read GPU 1's memory over NVLink and be
ordered on GPU 0's stream instead of after the GPU 1 work that produced its inputs: on the
embedded NVFP4 model split over two H200s that raced to logits off by up to 1.8 (tokens still
identical), while the BF16 model (plain torch ops) stayed bitwise equal.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401  (probed, not used: importing it is the check)
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _cuda_and_triton() -> bool:
    """Asked on every kernel call (``kernel_can_take``): ``torch.cuda.is_available()`` queries the
    driver each time (~3 us on the H200 host, 27 times an eager layer step); a process keeps its
    answer once CUDA is initialised."""
    return torch.cuda.is_available() and triton_importable()


# ``os.environ`` keeps its values in ``_data`` under encoded keys (POSIX CPython): a dict lookup there
# is ~0.1 us against ~1 us for ``os.environ.get`` (key encoding, Mapping.get); the kernels' switches
# are read on every call (tests and notebooks set them at run time), so they are read this way
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEYS: dict[str, object] = {}


def env_value(name: str, default: str) -> str:
    """``os.environ.get(name, default)``, read now, at a tenth of its host cost where CPython allows."""
    if _ENV_DATA is None or not hasattr(os.environ, "encodekey"):
        return os.environ.get(name, default)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.environ.encodekey(name)
    v = _ENV_DATA.get(key)
    return default if v is None else os.environ.decodevalue(v)


def have_triton_cuda() -> bool:
    """True only with a CUDA device and triton importable (DSV4LAB_NO_KERNELS=1 forces False, read
    on every call: tests and notebooks switch it at run time)."""
    if env_value("DSV4LAB_NO_KERNELS", "0") == "1":
        return False
    return _cuda_and_triton()


def kernel_can_take(x: torch.Tensor) -> bool:
    """A CUDA tensor of a dtype the Triton kernels handle, with the kernels available."""
    return x.is_cuda and x.dtype in KERNEL_DTYPES and have_triton_cuda()


_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)   # absent from CPU-only builds
_TORCH_CURRENT_DEVICE = torch.cuda.current_device  # a test's stand-in (CPU stubs) replaces it: then it is asked


def fast_device_getter(getter: Callable[[], int]) -> Callable[[], int]:
    """``getter``, or where it is torch's ``current_device`` the same answer without its lazy-init
    checks (~1 us a call on the H200 host): valid once a CUDA tensor exists, i.e. on every launch."""
    if getter is _TORCH_CURRENT_DEVICE and _GET_DEVICE is not None:
        return _GET_DEVICE
    return getter


def on_input_device(fn):
    """Decorator: run ``fn(x, ...)`` with the current CUDA device set to ``x``'s device (a no-op
    for CPU tensors and when it already is current). The launcher is opaque to ``torch.compile``:
    Inductor would re-emit the kernel's Triton source and fails on its inline PTX (measured on the
    H200: a SyntaxError in the generated module), so it compiles the glue around the launch."""

    is_compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def guarded(x, *args, **kwargs):
        # Dynamo traces this test as True and hands the call to the opaque launcher (which runs
        # this function again with Dynamo off, where the test is False); eager calls skip the
        # disable wrapper's two eval-frame switches (~13 us of host a launch on a CPU stub).
        # A CUDA tensor means CUDA is initialised: the current device is read as ``fast_device_getter``
        # does (inlined: a frame less on every launch), without torch's lazy-init checks;
        # ``get_device`` makes no device object.
        if is_compiling():
            return opaque(x, *args, **kwargs)
        if getattr(x, "is_cuda", False):
            get = torch.cuda.current_device
            if x.get_device() != (_GET_DEVICE if get is _TORCH_CURRENT_DEVICE and _GET_DEVICE is not None else get)():
                with torch.cuda.device(x.device):
                    return fn(x, *args, **kwargs)
        return fn(x, *args, **kwargs)

    opaque = torch.compiler.disable(guarded)
    guarded.launch_guard = True  # what tests look for on every public launcher
    return guarded


def copy_to_host(t: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """Start copying ``t`` to the host without waiting (pinned memory, an event after the copy),
    so the caller can queue more GPU work before it waits: a plain ``.tolist()`` would drain the
    stream first. CPU tensors come back as they are, with no event."""
    if not t.is_cuda:
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def wait_for_host(host: torch.Tensor, ready: "torch.cuda.Event | None") -> torch.Tensor:
    """``host`` once the copy ``copy_to_host`` started has landed (waits for that copy only)."""
    if ready is not None:
        ready.synchronize()
    return host
