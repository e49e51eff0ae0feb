"""Decode attention core benchmark for the device machine (CUDA): one decode step's attention over
the window ring and the compressed entries at V4-Pro shapes (128 heads x 512, window 128; CSA
ratio 4 with the indexer's 64 x 128 scores and top-k 1024, HCA ratio 128), the reference
(``decode_attention`` + for CSA ``index_scores_decode`` and ``Indexer.select``: cat, biases,
matmuls, softmax) against the Triton kernels, as CUDA-graph replays (launch latency included).
Per (kind, batch, context): us per step, the bytes of the valid keys, and max |kernel - ref| / max|ref|.
``--splits`` sweeps the decode kernel's split count (default: its rule, ``decode_splits``).

    python3 benchmarks/decode_attention.py --json $OUT/decode_attention.json [--splits 0,4,9,18,33]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.kernels import graph_time_us  # noqa: E402
from dsv4lab.config import named_config  # noqa: E402
from dsv4lab.model.decode_attention import decode_attention  # noqa: E402
from dsv4lab.model.indexer import Indexer, index_scores_decode  # noqa: E402

H, D, W, HI, IH, TOPK = 128, 512, 128, 64, 128, 1024  # named_config("v4-pro")


def graph_us(fn, iters: int = 200) -> float:
    """Mean us of ``fn`` as CUDA-graph replays (``kernels.graph_time_us`` of one call)."""
    return graph_time_us([fn], reps=iters)


def case(kind: str, B: int, context: int, splits: list[int]) -> dict:
    from dsv4lab.kernels.attention_decode import decode_attention_triton, decode_splits  # lazy: needs triton
    from dsv4lab.kernels.indexer_decode import index_scores_decode_triton

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    pos = torch.tensor(context - 1, device=dev)
    q = torch.randn(B, 1, H, D, device=dev, generator=g).bfloat16()
    ring = torch.randn(B, W, D, device=dev, generator=g).bfloat16()
    sink = torch.randn(H, device=dev, generator=g)
    ratio = {"sliding": 0, "hca": 128, "csa": 4}[kind]
    T = context // ratio if ratio else 0
    ent = torch.randn(B, T, D, device=dev, generator=g).bfloat16() if ratio else None
    n_ent = (pos + 1) // ratio if ratio else None
    ix = Indexer(named_config("v4-pro"), 4)  # its select(): the top-k with the -1 rule (CPU weights unused)
    if kind == "csa":
        iq = torch.randn(B, 1, HI, IH, device=dev, generator=g).bfloat16()
        iw = torch.randn(B, 1, HI, device=dev, generator=g).bfloat16()
        ik = torch.randn(B, T, IH, device=dev, generator=g).bfloat16()

    def run(scores_fn, attn_fn):
        sel = ix.select(scores_fn(iq, iw, ik, n_ent, HI ** -0.5), n_ent.view(1)) if kind == "csa" else None
        return attn_fn(q, sink, D ** -0.5, ring, pos, ent, n_ent, sel)

    ref = run(index_scores_decode, decode_attention)
    res = {"kind": kind, "batch": B, "context": context, "key_bytes": B * (min(context, W) + min(T, TOPK if kind == "csa" else T)) * D * 2,  # valid keys, bf16
           "reference_us": graph_us(lambda: run(index_scores_decode, decode_attention))}
    for s in splits:
        n = s or decode_splits(B, H, W + (TOPK if kind == "csa" else T), dev)

        def attn(*a, n=n):
            return decode_attention_triton(*a, splits=n)

        got = run(index_scores_decode_triton, attn)
        res[f"kernel_us_splits{n}"] = graph_us(lambda: run(index_scores_decode_triton, attn))
        res[f"max_err_rel_splits{n}"] = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    if kind == "csa":
        res["index_scores_kernel_us"] = graph_us(lambda: index_scores_decode_triton(iq, iw, ik, n_ent, HI ** -0.5))
        res["index_scores_reference_us"] = graph_us(lambda: index_scores_decode(iq, iw, ik, n_ent, HI ** -0.5))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--contexts", default="4096,65536", help="comma-separated positions + 1 (entry capacity = context / ratio)")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--splits", default="0", help="comma-separated split counts for the decode kernel (0 = its rule)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    splits = [int(s) for s in args.splits.split(",")]
    rows = [case(kind, B, ctx, splits) for kind in ("sliding", "hca", "csa")
            for B in map(int, args.batches.split(",")) for ctx in map(int, args.contexts.split(","))]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
