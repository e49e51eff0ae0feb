"""Host time per launch (CUDA): what an eager decode step pays per kernel before the GPU does
anything. Eager is where hooks fire, and at decode sizes it is host-bound: a V4-Pro layer runs
~620 launches eagerly in ~35 ms (H200, before fusion). This separates the costs: a bare PyTorch op,
a trivial Triton kernel with few and with many arguments, the same behind ``on_input_device``
(``torch.compiler.disable`` + the device guard), and our NVFP4 GEMV through ``dispatch.quant_linear``.
The trivial kernel and ``quant_linear`` (NVFP4, M = 1: x-pairs prelude + TMA GEMV) are timed three
times in the same run: the direct launch path (``dsv4lab.kernels.launch``) off (``*_normal_us``:
every launch through ``JITFunction.run``), on through Triton's Python launcher (``*_direct_us``), and
on through its C launcher with kept TMA descriptors (``*_raw_us``; Triton 3.6's layout only).

    python3 benchmarks/launch_overhead.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.measure import host_us  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import triton  # a benchmark script: triton is required here
    import triton.language as tl

    from dsv4lab.kernels import dispatch
    from dsv4lab.kernels import launch as direct
    from dsv4lab.kernels.device import on_input_device
    from dsv4lab.quant.weights import NVFP4Weight

    @triton.jit
    def _one(x_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(x_ptr + i, tl.load(x_ptr + i) + 1)

    @triton.jit
    def _many(x_ptr, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, s1, s2, s3, s4, N: tl.constexpr,
              B1: tl.constexpr, B2: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(x_ptr + i, tl.load(x_ptr + i) + s1)

    dev = torch.device("cuda")
    x = torch.zeros(64, device=dev)
    ptrs = [torch.zeros(64, device=dev) for _ in range(12)]
    guarded_one = on_input_device(lambda t: _one[(1,)](t, N=64))
    g = torch.Generator(device=dev).manual_seed(0)
    w = NVFP4Weight(torch.randint(0, 256, (512, 3584), dtype=torch.uint8, device=dev, generator=g),
                    (torch.rand(512, 448, device=dev, generator=g) + 0.5).to(torch.float8_e4m3fn),
                    torch.tensor(0.01, device=dev))
    xa = torch.randn(1, 7168, device=dev, dtype=torch.bfloat16)
    wd = w.dequantize(torch.bfloat16)
    res = {
        "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
        "torch_add_us": host_us(lambda: x.add_(1)),
        "triton_1_arg_us": host_us(lambda: _one[(1,)](x, N=64)),
        "triton_16_args_us": host_us(lambda: _many[(1,)](x, *ptrs, 1.0, 2.0, 3, 4, N=64, B1=16, B2=32)),
        "triton_1_arg_guarded_us": host_us(lambda: guarded_one(x)),
        "quant_linear_nvfp4_7168x512_m1_us": host_us(lambda: dispatch.quant_linear(xa, w), iters=500),
        "F_linear_bf16_7168x512_m1_us": host_us(lambda: torch.nn.functional.linear(xa, wd), iters=500),
    }
    site = direct.LaunchSite(_one, N=64)
    # normal: every launch through JITFunction.run; direct: the site's compiled.run (Triton's Python
    # CudaLauncher); raw: the C launcher with the descriptors expanded by dsv4lab (kept for weights)
    for path, on, raw in (("normal", False, False), ("direct", True, False), ("raw", True, True)):
        prev, prev_raw = direct.set_direct_launch(on), direct.set_raw_launch(raw)
        direct.clear()   # sites rebuilt under this setting
        try:
            res[f"triton_1_arg_launch_{path}_us"] = host_us(lambda: direct.launch(_one, (1,), x, N=64))
            res[f"triton_1_arg_site_{path}_us"] = host_us(lambda: site((1,), x))
            res[f"quant_linear_nvfp4_7168x512_m1_{path}_us"] = host_us(lambda: dispatch.quant_linear(xa, w), iters=500)
            res[f"direct_launches_{path}"] = direct.stats["direct"]
            res[f"raw_launches_{path}"] = direct.stats["raw"]
        finally:
            direct.set_direct_launch(prev)
            direct.set_raw_launch(prev_raw)
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
