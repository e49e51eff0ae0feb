"""Prefill attention tiles on the device machine (CUDA): ``bounded_attention_triton`` at V4-Pro
shapes (128 heads x 512, window 128, bf16) for one 4k chunk, per (heads per program, keys per
tile, warps): ms per call, TFLOP/s of its dots, and max |difference| from the default tiles.

Shapes: ``sliding`` (window only), ``hca`` (window + closed entries, ratio 128), ``csa`` (window +
1024 selected of 16k entries: a chunk at 64k context), ``csa_first`` (a prompt's first 4k chunk:
query t has (t + 1) // 4 closed entries, all selected, then -1s, as ``Indexer.select`` orders
them). The full-depth prefill profile put this kernel at ~8 ms a layer on a 4k chunk
(``full_model.py --profile``), 10x its dots at the BF16 rate.

    python3 benchmarks/prefill_attention.py --json $OUT/prefill_attention.json
    python3 benchmarks/prefill_attention.py --cpu-smoke      # tiny shapes through the reference (tested)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.measure import timed  # noqa: E402
from dsv4lab.model.bounded_attention import bounded_attention  # noqa: E402

TILES = [(32, 32, 8), (16, 32, 4), (16, 64, 4), (32, 64, 8), (32, 16, 4), (16, 16, 4), (64, 32, 8), (64, 16, 8), (32, 32, 4),
         (64, 32, 4), (64, 64, 8), (128, 32, 8), (128, 16, 8), (64, 32, 16), (128, 32, 16), (128, 64, 16),
         (64, 32, 8, 1), (64, 32, 8, 2), (64, 32, 8, 4), (64, 16, 8, 1), (64, 16, 8, 2), (64, 64, 8, 1)]  # + num_stages
SHAPES = ("sliding", "hca", "csa", "csa_first")


def inputs(shape: str, dev, S: int = 4096, H: int = 128, D: int = 512, window: int = 128, context: int = 65536,
           topk: int = 1024, dtype=torch.bfloat16, seed: int = 0) -> tuple[tuple, dict, float]:
    """Positional args of ``bounded_attention`` for the last ``S`` tokens of ``context`` (sliding /
    hca: of S), and the FLOPs of its two dots per call (valid keys only)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    start = (context - S) if shape == "csa" else 0
    q = torch.randn(1, S, H, D, device=dev, generator=g, dtype=torch.float32).to(dtype)
    keys = torch.randn(1, S + window - 1, D, device=dev, generator=g, dtype=torch.float32).to(dtype)
    sink = torch.randn(H, device=dev, generator=g)
    k_start = start - (window - 1)
    keys_per_q = min(window, S)
    kw: dict = {}
    if shape == "hca":
        kw = {"entries": torch.randn(1, (start + S) // 128, D, device=dev, generator=g).to(dtype), "ratio": 128}
        keys_per_q += (start + S) // 128 / 2
    elif shape == "csa":
        n = (start + S) // 4
        kw = {"entries": torch.randn(1, n, D, device=dev, generator=g).to(dtype), "ratio": 4,
              "selected": torch.randint(0, n - S // 4, (1, S, topk), device=dev, generator=g)}
        keys_per_q += topk
    elif shape == "csa_first":  # the indexer's rule (top_k_valid): top-k of the closed, -1 after them
        n = S // 4
        t = torch.arange(S, device=dev)
        vis = (t + 1) // 4
        scores = torch.rand(1, S, n, device=dev, generator=g).masked_fill(
            torch.arange(n, device=dev) >= vis.view(1, -1, 1), float("-inf"))
        top = scores.topk(min(topk, n), dim=-1).indices
        kw = {"entries": torch.randn(1, n, D, device=dev, generator=g).to(dtype), "ratio": 4,
              "selected": torch.where(top < vis.view(1, -1, 1), top, torch.full_like(top, -1))}
        keys_per_q = float((t + 1).clamp(max=window).float().mean() + vis.clamp(max=topk).float().mean())
    flops = 4 * S * H * D * keys_per_q
    return (q, sink, D ** -0.5, window, keys, start, k_start), kw, flops


def sweep(dev, shapes: list[str], iters: int, tiles: list[tuple[int, ...]]) -> list[dict]:
    """Per shape and tile (heads per program, keys per tile, warps[, pipeline stages]): ms, TFLOP/s."""
    from dsv4lab.kernels.attention_bounded import bounded_attention_triton  # lazy: imports triton

    rows = []
    for shape in shapes:
        args, kw, flops = inputs(shape, dev)
        ref = bounded_attention_triton(*args, **kw)
        for tile in tiles:
            bh, bn, nw = tile[:3]
            tkw = {"block_h": bh, "block_n": bn, "num_warps": nw, "num_stages": tile[3] if len(tile) > 3 else None}
            r = {"shape": shape, **tkw}
            try:
                out = bounded_attention_triton(*args, **kw, **tkw)
                s = timed(lambda: bounded_attention_triton(*args, **kw, **tkw), iters, [dev])
                r.update({"ms": s * 1e3, "TFLOPs": flops / s / 1e12,
                          "max_abs_diff_vs_default": float((out.float() - ref.float()).abs().max())})
            except Exception as e:  # a tile that does not compile (shared memory) must not lose the others
                r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(json.dumps(r), flush=True)
            rows.append(r)
        torch.cuda.empty_cache()
    return rows


def cpu_smoke() -> dict:
    """The inputs at tiny sizes through the PyTorch reference: shapes and finiteness only."""
    out = {}
    for shape in SHAPES:
        args, kw, flops = inputs(shape, torch.device("cpu"), S=32, H=4, D=16, window=8, context=256, topk=8,
                                 dtype=torch.float32)
        y = bounded_attention(*args, **kw)
        out[shape] = {"shape": list(y.shape), "finite": bool(torch.isfinite(y).all()), "flops": flops}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tiles", default=None, help="first..last of TILES to try, e.g. 9:16 (default all)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes through the reference on the CPU")
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        ap.error(f"--shapes: {bad or shapes} not in {list(SHAPES)}")
    if args.cpu_smoke:
        print(json.dumps(cpu_smoke()))
        return
    if not torch.cuda.is_available():
        ap.error("needs CUDA (or --cpu-smoke)")
    dev = torch.device("cuda")
    lo, hi = (int(x) for x in args.tiles.split(":")) if args.tiles else (0, len(TILES))
    res = {"device": torch.cuda.get_device_name(dev), "rows": sweep(dev, shapes, args.iters, TILES[lo:hi])}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
