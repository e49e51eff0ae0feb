"""Host time of one eager decode step of a V4-Pro layer with every kernel installed, and where it goes.

Issue #24 asks eager decode <= 100 ms/token at full depth: ~1.6 ms a layer, where today the GPU
waits on the host (wall == host). This times ``DecoderLayer.decode`` eagerly (median of
``--steps`` after warm-up; on CUDA also the wall time after a synchronise) and profiles it with
cProfile: the functions with the most own time and the most cumulative time per step. Hosts
differ 2-3x in speed, so each row also gives ``host_op_us`` (``measure.host_op_us``, one bare torch
op's host time, measured before the timing) and the step in those units (``step_over_host_op``).

* on CUDA (default there): real launches.
* ``--cpu-stub`` (any machine): CPU tensors with the launches stubbed as in ``host_overhead.py``
  (the Python around the launches only; aten ops run on the CPU, so the BF16 projections cost
  real CPU time: ``--stub-bf16`` returns empty outputs for them).

    python3 benchmarks/eager_layer.py --json $OUT/eager_layer.json [--experts 8 384] [--copies 30]
    python benchmarks/eager_layer.py --cpu-stub --stub-bf16 --layer csa
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import launch_inventory as inventory  # noqa: E402  (the layer builder and the CPU stubs)
from measure import host_op_us  # noqa: E402  (the host's floor: one bare torch op)

from dsv4lab.kernels.install import install_kernels  # noqa: E402
from dsv4lab.model.state import DecodeState  # noqa: E402


def _empty_linear(x, w, b=None):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def profile_text(prof: cProfile.Profile, top: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumtime").print_stats(top)
    return out.getvalue()


def measure(layer_key: str, experts: int, stub: bool, stub_bf16: bool, steps: int, top: int,
            copies: int = 1) -> dict:
    """Median host us of one eager decode step of a layer (and wall us on CUDA), installed kernels,
    the profile. ``copies`` distinct layers run in turn and the times are per layer: a one-layer loop
    keeps its Python objects and the driver's state hot, where a 61-layer model does not (H100:
    1.7 ms of host a CSA step alone, ~2.9 ms a layer at depth)."""
    dev = torch.device("cpu" if stub else "cuda")
    built = [inventory.build(inventory.LAYERS[layer_key], dev, experts) for _ in range(copies)]
    cfg = built[0][1]
    states = [DecodeState.allocate(cfg, 1, 4096, torch.bfloat16, dev) for _ in built]
    h = torch.randn(1, 1, cfg.hc_mult, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
    for st in states:
        st.pos_on(dev).fill_(1000)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        if stub:
            stack.enter_context(mock.patch.dict(os.environ, {"DSV4LAB_KERNEL_VERIFY": "0"}))
            stack.enter_context(inventory.counted_launches(lambda: "?", [], True))
            stack.enter_context(inventory._cpu_install_allowed())
            if stub_bf16:
                stack.enter_context(mock.patch.object(F, "linear", _empty_linear))
        installed = sum(install_kernels(layer) for layer, _, _ in built) // copies
        if stub:
            for layer, _, _ in built:
                for m in layer.modules():
                    if hasattr(m, "kernel_devices"):
                        m.kernel_devices = ("cuda", "cpu")
        runs = [(layer, st, st.pos_on(dev)) for (layer, _, _), st in zip(built, states)]

        def step():
            for layer, st, pos in runs:
                layer.decode(h, ids, pos, st.layers[0])

        for _ in range(3):
            step()
        if not stub:
            torch.cuda.synchronize()
        op_us = host_op_us(dev)  # what one bare torch op costs this host, next to the timing
        host, cpu = [], []
        t_all = time.perf_counter()
        for _ in range(steps):
            t, c = time.perf_counter(), time.thread_time()
            step()
            host.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
        if not stub:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t_all) / steps / copies
        prof = cProfile.Profile()
        n_prof = min(steps, 30)
        prof.enable()
        for _ in range(n_prof):
            step()
        prof.disable()
        calls = pstats.Stats(prof).total_calls / n_prof / copies
    return {"layer": layer_key, "experts": experts, "copies": copies, "mode": "cpu-stub" if stub else "cuda",
            "installed": installed, "host_us_per_step": statistics.median(host) / copies * 1e6,
            "host_op_us": op_us, "step_over_host_op": statistics.median(host) / copies * 1e6 / op_us,
            "thread_cpu_us_per_step": statistics.median(cpu) / copies * 1e6, "calls_per_step": calls,
            "wall_us_per_step": None if stub else wall * 1e6,
            "profile": profile_text(prof, top)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-stub", action="store_true", help="CPU tensors, launches stubbed (default without CUDA)")
    ap.add_argument("--stub-bf16", action="store_true", help="with --cpu-stub: empty outputs for the BF16 projections")
    ap.add_argument("--layer", choices=("csa", "hca", "both"), default="both")
    ap.add_argument("--experts", type=int, nargs="+", default=[8], help="routed experts of the layer (V4-Pro: 384)")
    ap.add_argument("--steps", type=int, default=100, help="timed eager steps (the profile takes <= 30 more)")
    ap.add_argument("--top", type=int, default=40, help="functions listed per profile ordering")
    ap.add_argument("--copies", type=int, default=1,
                    help="distinct layers run in turn, times per layer (depth: 30 is a V4-Pro's share of one type)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.copies < 1:
        ap.error(f"--copies must be >= 1, got {args.copies}")
    if any(e < 1 for e in args.experts):
        ap.error(f"--experts must be >= 1 each, got {args.experts}")
    if args.stub_bf16 and not args.cpu_stub:
        ap.error("--stub-bf16 needs --cpu-stub (on CUDA the BF16 projections run for real)")
    stub = args.cpu_stub or not torch.cuda.is_available()
    if stub:
        torch.set_num_threads(1)
    rows = []
    for key in (("csa", "hca") if args.layer == "both" else (args.layer,)):
        for e in args.experts:
            r = measure(key, e, stub, args.stub_bf16, args.steps, args.top, args.copies)
            wall = "" if r["wall_us_per_step"] is None else f", wall {r['wall_us_per_step']:.0f} us"
            print(f"{key} {e} experts x{args.copies} ({r['mode']}): host {r['host_us_per_step']:.0f} us a layer step "
                  f"(thread CPU {r['thread_cpu_us_per_step']:.0f} us){wall}, "
                  f"{r['calls_per_step']:.0f} function calls a step (cProfile, deterministic), "
                  f"{r['step_over_host_op']:.0f} bare ops of {r['host_op_us']:.2f} us, "
                  f"{r['installed']} kernels installed", flush=True)
            rows.append(r)
            if not stub:
                torch.cuda.empty_cache()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name() if not stub else "cpu",
                                         "torch": torch.__version__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
