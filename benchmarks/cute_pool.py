"""Benchmark the CuTeDSL compressor softmax-pool kernel against the PyTorch reference (device machine).

V4-Pro-like shapes: rows (B*nW) 1, 64, 4096; L 8 (CSA, ratio 4 with overlap) and 128 (HCA); d 512;
kv bf16 (``--dtypes bf16,fp32`` adds fp32). For each backend that is available:
  * ``jit``: ``compressor_pool_cute`` (cute.compile on the device; nvidia-cutlass-dsl importable);
  * ``aot``: ``compressor_pool_aot`` with the cubins in $DSV4LAB_CUTE_AOT_DIR (export-aot);
  * ``ref``: ``compressor_pool_ref`` (PyTorch eager: softmax, cast, mul, sum),
it reports the GPU time per call as CUDA-graph replays over enough input copies to exceed the L2
(``graph_us``: no Python launch overhead) and the eager per-call time (``eager_us``: Python and
launch included), the achieved bandwidth (kv + gate read + output written, once, / graph time) and
its fraction of a device-to-device copy measured in the same run, and the kernel's max error
against the reference relative to max|ref|.

    python3 benchmarks/cute_pool.py --json [--dtypes bf16,fp32] [--sweep]

``--sweep`` also times other launch configs (max threads per row, chunk) of the jit backend.
"""
import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels import copy_ceiling, graph_time_us  # noqa: E402
from dsv4lab.kernels import compressor_pool_cute as cp  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # default --json location

ROWS = (1, 64, 4096)
SLOTS = (8, 128)
D = 512
L2_BYTES = 256 << 20  # rotate input copies until the working set is well past H200's 50 MB L2
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def make_inputs(rows: int, L: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn(1, rows, L, d, generator=g, device="cuda").to(dtype)
    gate = torch.randn(1, rows, L, d, generator=g, device="cuda") * 2
    mask = torch.rand(1, rows, L, d, generator=g, device="cuda") < 0.25
    mask[:, :, -1:] = False  # never a whole column of -inf
    return kv, gate.masked_fill(mask, float("-inf"))


def io_bytes(rows: int, L: int, d: int, dtype: torch.dtype) -> int:
    es = torch.empty((), dtype=dtype).element_size()
    return rows * L * d * (es + 4) + rows * d * es


def eager_us(fn, reps: int = 100) -> float:
    """Mean wall time per call (us) of back-to-back calls, CUDA events around the loop."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    for _ in range(reps):
        fn()
    en.record()
    torch.cuda.synchronize()
    return st.elapsed_time(en) * 1e3 / reps


def graph_us(calls, reps: int = 20) -> float | None:
    """``benchmarks.kernels.graph_time_us`` (graph replays, us per call); None when capture fails
    (the number is then only in eager_us)."""
    try:
        return graph_time_us(calls, reps)
    except Exception as e:  # noqa: BLE001 - report and go on with eager numbers
        print(f"  (graph capture failed: {type(e).__name__}: {e})", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def backends(dtype: torch.dtype, L: int, d: int) -> dict:
    out = {}
    if cp.have_cute():
        out["jit"] = cp.compressor_pool_cute
    aot = os.environ.get("DSV4LAB_CUTE_AOT_DIR", "")
    if aot and cp.aot_has(aot, dtype, L, d):
        out["aot"] = lambda kv, gate: cp.compressor_pool_aot(kv, gate, aot)
    out["ref"] = cp.compressor_pool_ref
    return out


def bench_case(rows: int, L: int, dtype: torch.dtype, ceiling: float, fns: dict, label: str = "") -> list[dict]:
    nbytes = io_bytes(rows, L, D, dtype)
    copies = max(1, min(64, math.ceil(L2_BYTES / nbytes)))
    data = [make_inputs(rows, L, D, dtype, seed=i) for i in range(copies)]
    ref0 = cp.compressor_pool_ref(*data[0]).float()
    res = []
    for name, fn in fns.items():
        y = fn(*data[0]).float()
        err = ((y - ref0).abs().max() / ref0.abs().max()).item()
        g = graph_us([lambda a=a, f=fn: f(*a) for a in data])
        e = eager_us(lambda a=data[0], f=fn: f(*a))
        t = g if g is not None else e
        gbs = nbytes / (t * 1e-6) / 1e9
        res.append(dict(backend=name + label, rows=rows, L=L, d=D, dtype=str(dtype).replace("torch.", ""),
                        bytes=nbytes, copies=copies, graph_us=g, eager_us=e, gbs=gbs,
                        frac_of_copy=gbs / ceiling, max_err_rel_max=err))
    data.clear()
    torch.cuda.empty_cache()
    return res


def fmt(r: dict) -> str:
    g = f"{r['graph_us']:9.2f}" if r["graph_us"] is not None else "        -"
    return (f"{r['backend']:>14} {r['dtype']:>8} {r['rows']:>5} {r['L']:>4} {r['d']:>4} {g} "
            f"{r['eager_us']:9.2f} {r['gbs']:8.1f} {r['frac_of_copy']:6.2f} {r['max_err_rel_max']:9.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, nargs="?", default=None, const=RESULTS / "cute_pool.json",
                    help="write the results here (bare --json: benchmarks/results/cute_pool.json)")
    ap.add_argument("--dtypes", default="bf16", help="comma list of kv dtypes (bf16, fp32, fp16)")
    ap.add_argument("--sweep", action="store_true", help="also time other jit launch configs")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    try:
        import cutlass

        version = getattr(cutlass, "__version__", "?")
    except Exception:  # noqa: BLE001
        version = None
    from triton.testing import do_bench

    ceiling = copy_ceiling(do_bench)
    torch.cuda.empty_cache()
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  cutlass-dsl {version}  "
          f"copy ceiling {ceiling:.0f} GB/s  AOT dir {os.environ.get('DSV4LAB_CUTE_AOT_DIR') or '-'}")
    print(f"{'backend':>14} {'dtype':>8} {'rows':>5} {'L':>4} {'d':>4} {'graph_us':>9} {'eager_us':>9} "
          f"{'GB/s':>8} {'copy':>6} {'err/max':>9}")
    results, sweep = [], []
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        for L in SLOTS:
            for rows in ROWS:
                for r in bench_case(rows, L, dtype, ceiling, backends(dtype, L, D)):
                    print(fmt(r), flush=True)
                    results.append(r)
                if args.sweep and cp.have_cute():
                    for mt in (128, 256, 512):
                        for k in (2, 4, 8):
                            try:
                                cfg = cp.make_config(dtype, L, D, max_threads=mt, chunk=k)
                            except ValueError:
                                continue
                            fn = {"jit": lambda kv, g, c=cfg: cp.compressor_pool_cute(kv, g, config=c)}
                            for rows in ROWS:
                                for r in bench_case(rows, L, dtype, ceiling, fn, label=f"[{mt},{k}]"):
                                    r["config"] = cfg.key
                                    print(fmt(r), flush=True)
                                    sweep.append(r)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), torch=torch.__version__, cutlass_dsl=version,
            copy_ceiling_gbs=ceiling, aot_dir=os.environ.get("DSV4LAB_CUTE_AOT_DIR"),
            time=time.strftime("%Y-%m-%d %H:%M:%S"), results=results, sweep=sweep), indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
