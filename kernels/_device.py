"""Launch kernels on the device that holds their inputs.

Triton (and the CuTe launcher) launch on the *current* CUDA device and its current stream, not on
the device of the tensors they are given. With a model split over GPUs (device maps), a layer on
cuda:1 called while cuda:0 is current would run on GPU 0, read GPU 1's memory over NVLink and be
ordered on GPU 0's stream instead of after the GPU 1 work that produced its inputs: on the
embedded NVFP4 model split over two H200s that raced to logits off by up to 1.8 (tokens still
identical), while the BF16 model (plain torch ops) stayed bitwise equal. Importing this module
does not import triton.
"""
from __future__ import annotations

import functools

import torch


def on_input_device(fn):
    """Decorator: run ``fn(x, ...)`` with the current CUDA device set to ``x``'s device (a no-op
    for CPU tensors and when it already is current)."""

    @functools.wraps(fn)
    def run(x, *args, **kwargs):
        if getattr(x, "is_cuda", False) and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                return fn(x, *args, **kwargs)
        return fn(x, *args, **kwargs)

    return run
