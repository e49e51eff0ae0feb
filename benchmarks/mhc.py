"""mHC sites at V4-Pro shapes (hc 4, hidden 7168, mix 24, 20 Sinkhorn iterations) on the device
machine: the PyTorch reference vs the fused kernels of dsv4lab/kernels/mhc_fused.py, per site
(``pre`` = HyperConnection mixes + collapse, ``post`` = the expansion, ``head`` = HyperHead), eager
and as CUDA-graph replays over COPIES sites with their own parameters (2.75 MB of fp32 ``fn`` each,
so the working set exceeds the 50 MB L2 as in a real decode step). Prints JSON; ratios, not asserts.

    python3 benchmarks/mhc.py --json $OUT/mhc.json [--batches 1,4] [--prefill 4096]

``bench_mhc(dev, batches)`` is the entry point other benchmarks (benchmarks/decode.py) can call.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cute_pool import eager_us  # noqa: E402
from benchmarks.kernels import graph_time_us  # noqa: E402
from dsv4lab.checkpoint.synth import preset_config  # noqa: E402
from dsv4lab.kernels.dispatch import mhc_head_pre, mhc_post, mhc_pre  # noqa: E402
from dsv4lab.model.mhc import HyperConnection, HyperHead  # noqa: E402

COPIES = 24


def _sites(cfg, dev, n: int, seed: int = 0) -> tuple[list[HyperConnection], list[HyperHead]]:
    g = torch.Generator(device=dev).manual_seed(seed)
    sites, heads = [], []
    for _ in range(n):
        s, h = HyperConnection(cfg).to(dev), HyperHead(cfg).to(dev)
        for mod in (s, h):
            with torch.no_grad():
                mod.fn.copy_(torch.randn(mod.fn.shape, device=dev, generator=g) * 0.02)
                mod.base.copy_(torch.randn(mod.base.shape, device=dev, generator=g))
        sites.append(s)
        heads.append(h)
    return sites, heads


@torch.no_grad()
def bench_mhc(dev: torch.device, batches=(1, 4)) -> list[dict]:
    """Per batch and site: reference and fused time (us per call, eager and graph), and the fused
    outputs' max |diff| against the reference."""
    cfg = preset_config("v4-pro")
    hc, D = cfg.hc_mult, cfg.hidden_size
    sites, heads = _sites(cfg, dev, COPIES)
    rows = []
    for B in batches:
        streams = [torch.randn(B, 1, hc, D, device=dev).bfloat16() for _ in range(COPIES)]
        out = torch.randn(B, 1, D, device=dev).bfloat16()
        mixes = [s(x) for s, x in zip(sites, streams)]
        cases = {
            "pre": ([lambda s=s, x=x: s(x) for s, x in zip(sites, streams)],
                    [lambda s=s, x=x: mhc_pre(x, s.fn, s.base, s.scale, s.iters, s.hc_eps, s.norm_eps)
                     for s, x in zip(sites, streams)]),
            "post": ([lambda x=x, m=m: HyperConnection.expand(x, out, m[0], m[1]) for x, m in zip(streams, mixes)],
                     [lambda x=x, m=m: mhc_post(x, out, m[0], m[1]) for x, m in zip(streams, mixes)]),
            "head": ([lambda h=h, x=x: h(x) for h, x in zip(heads, streams)],
                     [lambda h=h, x=x: mhc_head_pre(x, h.fn, h.base, h.scale, h.eps, h.norm_eps)
                      for h, x in zip(heads, streams)]),
        }
        ref_col = sites[0](streams[0])[2]
        diffs = {"pre": (mhc_pre(streams[0], sites[0].fn, sites[0].base, sites[0].scale, sites[0].iters,
                                 sites[0].hc_eps, sites[0].norm_eps)[3].float() - ref_col.float()).abs().max().item(),
                 "post": (mhc_post(streams[0], out, *mixes[0][:2]).float()
                          - HyperConnection.expand(streams[0], out, *mixes[0][:2]).float()).abs().max().item(),
                 "head": (mhc_head_pre(streams[0], heads[0].fn, heads[0].base, heads[0].scale, heads[0].eps,
                                       heads[0].norm_eps)[1].float() - heads[0](streams[0]).float()).abs().max().item()}
        for site, (ref, fused) in cases.items():
            r = {"batch": B, "site": site, "ref_eager_us": eager_us(ref[0]), "fused_eager_us": eager_us(fused[0]),
                 "ref_graph_us": graph_time_us(ref), "fused_graph_us": graph_time_us(fused),
                 "fused_max_abs_diff": diffs[site]}
            r["graph_speedup"] = r["ref_graph_us"] / r["fused_graph_us"]
            rows.append(r)
            print(json.dumps(r), file=sys.stderr)
    return rows


@torch.no_grad()
def bench_prefill_pre(dev: torch.device, tokens: int) -> dict:
    """``hc_pre`` at ``tokens`` prefill tokens of one V4-Pro site against the reference, on the tiles
    and on the dense tier: us per call (eager: these calls are long), max |pre - ref|, and the bytes
    of x (the tiles read it twice, the dense tier three times) with the copy time of those bytes."""
    from dsv4lab.kernels.mhc_fused import hc_pre, use_dense  # lazy: imports triton

    cfg = preset_config("v4-pro")
    site = _sites(cfg, dev, 1)[0][0]
    x = torch.randn(1, tokens, cfg.hc_mult, cfg.hidden_size, device=dev).bfloat16()
    args = (site.fn, site.base, site.scale, site.iters, site.hc_eps, site.norm_eps)
    ref_pre = site.mixes(x)[0]
    y = torch.empty_like(x)
    row = {"tokens": tokens, "rule_picks_dense": use_dense(tokens, x.dtype), "ref_us": eager_us(lambda: site(x)),
           "x_bytes": x.numel() * x.element_size(), "copy_x_us": eager_us(lambda: y.copy_(x))}
    for tier, dense in (("tiles", False), ("dense", True)):
        row[f"{tier}_us"] = eager_us(lambda d=dense: hc_pre(x, *args, dense=d))
        row[f"{tier}_pre_max_abs"] = (hc_pre(x, *args, dense=dense)[0] - ref_pre).abs().max().item()
        row[f"{tier}_speedup"] = row["ref_us"] / row[f"{tier}_us"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--batches", default="1,4", help="comma list of decode batch sizes")
    ap.add_argument("--prefill", default="", help="also time hc_pre at these prefill token counts (comma list)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(dev), "copies": COPIES,
           "rows": bench_mhc(dev, tuple(int(b) for b in args.batches.split(",") if b))}
    if args.prefill:
        res["prefill_pre"] = [bench_prefill_pre(dev, int(t)) for t in args.prefill.split(",") if t]
    text = json.dumps(res, indent=1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
