"""Floors and counters the CUDA benchmarks share: copy ceiling, BF16 matmul rate, timing,
kernels per call (from the CUDA profiler) and the memory a call adds on top of what it started
with. Every benchmark states its results as ratios against floors measured in the same run.
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Callable, Iterable

import torch


def copy_ceiling(dev, nbytes: int = 4 * 2**30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth on ``dev``, bytes read + written per second."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    torch.cuda.synchronize(dev)
    return 2 * nbytes * iters / (time.perf_counter() - t0)


def matmul_rate(dev, n: int = 8192, iters: int = 10) -> float:
    """Dense BF16 matmul FLOP/s on ``dev`` (cuBLAS; the compute floors' denominator)."""
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize(dev)
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def timed(fn: Callable[[], object], iters: int, devices: Iterable = (None,), warmup: int = 3) -> float:
    """Mean seconds per call of ``fn`` after ``warmup`` calls, synchronising every device used."""
    devices = list(devices)
    for _ in range(warmup):
        fn()
    synchronize(devices)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(devices)
    return (time.perf_counter() - t0) / iters


def host_us(fn: Callable[[], object], iters: int = 2000) -> float:
    """Mean host microseconds per call of ``fn`` (CUDA work queued, not waited for), after 50 calls."""
    cuda = torch.cuda.is_initialized()
    for _ in range(50):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dt = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
    return dt / iters * 1e6


def host_op_us(dev, iters: int = 2000, repeats: int = 5) -> float:
    """The host's floor for eager work: the median over ``repeats`` of the mean host microseconds of
    one bare torch op (``x.add_(1)`` on a one-element tensor on ``dev``). Eager decode waits on the
    host, and device machines of one kind differ 2-3x in host speed (a full-depth eager token 57 ms on
    one H100's host, 110-186 ms on others), so eager results are also stated in these units."""
    dev = torch.device(dev)
    x = torch.zeros(1, device=dev)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        runs = sorted(host_us(lambda: x.add_(1), iters) for _ in range(repeats))
    return runs[len(runs) // 2]


def synchronize(devices: Iterable = (None,)) -> None:
    """Wait for every device in ``devices`` (None: the current one)."""
    for d in devices:
        torch.cuda.synchronize(d)


def kernels_per_call(fn: Callable[[], object], reps: int = 3, top: int = 12, devices: Iterable = (None,)) -> dict:
    """What one call of ``fn`` launches on ``devices``, from the CUDA profiler (kernels inside graph
    replays included): kernel count, memcpy/memset count, device time, and the names taking most time."""
    from torch.profiler import ProfilerActivity, profile  # only the benchmarks profile

    devices = list(devices)
    fn()
    synchronize(devices)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        synchronize(devices)
    n_kernels = n_copies = 0
    device_us = 0.0
    by_name: Counter = Counter()
    spans = []
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        name = e.name
        if name.startswith(("Memcpy", "Memset", "memcpy", "memset")):
            n_copies += 1
        else:
            n_kernels += 1
        device_us += e.device_time
        by_name[name[:60]] += e.device_time
        spans.append((e.device_index, e.time_range.start, e.time_range.end, name[:60]))
    idle = idle_gaps(spans, top)
    return {"kernels": n_kernels / reps, "copies": n_copies / reps, "device_us": device_us / reps,
            "span_us": idle["span_us"] / reps, "idle_us": idle["idle_us"] / reps,
            "top_us": {k: round(v / reps, 2) for k, v in by_name.most_common(top)},
            "top_idle_us": {k: round(v / reps, 2) for k, v in idle["by_pair"].items()}}


def idle_gaps(spans: list[tuple[int, float, float, str]], top: int = 12) -> dict:
    """Where each device sat idle between its kernels: ``spans`` = (device, start us, end us, name);
    returns the summed span (first start to last end per device), the idle time inside it, and the
    ``top`` (kernel before -> kernel after) pairs by idle time. A host sync, or host work slower
    than the kernels it launches, shows up here and not in the kernels' device time."""
    span = idle = 0.0
    by_pair: Counter = Counter()
    for dev in {s[0] for s in spans}:
        mine = sorted(s[1:] for s in spans if s[0] == dev)
        span += mine[-1][1] - mine[0][0]
        end, before = mine[0][1], mine[0][2]
        for start, stop, name in mine[1:]:
            if start > end:
                idle += start - end
                by_pair[f"{before} -> {name}"] += start - end
            if stop > end:
                end, before = stop, name
    return {"span_us": span, "idle_us": idle, "by_pair": dict(by_pair.most_common(top))}


def peak_extra_bytes(fn: Callable[[], object], dev) -> tuple[object, int]:
    """(result of ``fn``, the most memory allocated on ``dev`` during it beyond what was allocated before)."""
    out, extra = peak_extra_bytes_by_device(fn, [dev])
    return out, extra[0]


def peak_extra_bytes_by_device(fn: Callable[[], object], devices: list) -> tuple[object, list[int]]:
    """(result of ``fn``, per device of ``devices`` the most memory allocated during it beyond
    what was allocated before)."""
    synchronize(devices)
    base = [torch.cuda.memory_allocated(d) for d in devices]
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    out = fn()
    synchronize(devices)
    return out, [torch.cuda.max_memory_allocated(d) - b for d, b in zip(devices, base)]
