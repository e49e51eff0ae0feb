"""Prefill benchmark for the device machine (CUDA): one V4-Pro-sized decoder layer (the builder of
benchmarks/decode.py: hidden 7168, 128 heads x 512, window 128, index top-k 1024, NVFP4 linears)
prefilled over ``--context`` tokens in ``--chunk``-token calls of ``DecoderLayer.prefill``, for
the dense attention path (``prefill_path="dense"``: [H, C, L] logits) and the bounded one
(online softmax per block; the Triton kernel when installed, ``bounded_ref`` the PyTorch blocks). Per (layer, path): tokens/s and
the peak transient = ``torch.cuda.max_memory_allocated`` minus what was allocated before the
prefill (weights, decode state, the input chunk), and the last chunk's max |bounded - dense|.

    python3 benchmarks/prefill.py --context 65536 --chunk 4096 --json $OUT/prefill_h200.json
    python3 benchmarks/prefill.py --paths bounded --profile --json $OUT/prefill_profile.json   # + the last chunk's kernels
    python3 benchmarks/prefill.py --cpu-smoke          # shrunken layer on the CPU (tested)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.measure import kernels_per_call  # noqa: E402
from dsv4lab.model.state import DecodeState  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
KINDS = {"csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}


def decode_bench():
    """benchmarks/decode.py as a module (its V4-Pro layer builder)."""
    spec = importlib.util.spec_from_file_location("bench_decode", HERE / "decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def prefill_run(layer, cfg, dev, context: int, chunk: int, path: str, x: torch.Tensor, profile: bool = False) -> dict:
    """Prefill ``context`` tokens (the same chunk input each call) on a fresh state; ``profile``:
    also the kernels of the last chunk, called again at the same position (CUDA profiler)."""
    layer.attn.prefill_path = "dense" if path == "dense" else "auto"
    kernel = layer.attn.kernel
    if path == "bounded_ref":  # the PyTorch bounded path even where the Triton kernel is installed
        layer.attn.kernel = None
    st = DecodeState.allocate(cfg, 1, context, torch.bfloat16, dev)
    ids = torch.zeros(1, chunk, dtype=torch.long, device=dev)
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    t0 = time.perf_counter()
    out = None
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        out = layer.prefill(x[:, :n], ids[:, :n], start, st.layers[0])
    sync(dev)
    s = time.perf_counter() - t0
    res = {"path": path, "ran": layer.attn.last_prefill_path, "context": context, "chunk": chunk, "seconds": s,
           "attention_kernel": getattr(None if path == "bounded_ref" else kernel, "__name__", None),
           "tokens_per_s": context / s, "out_finite": bool(torch.isfinite(out).all())}
    if dev.type == "cuda":
        res["peak_transient_GB"] = (torch.cuda.max_memory_allocated(dev) - base) / 1e9
        if profile:
            last = context - n
            res["last_chunk_kernels"] = kernels_per_call(
                lambda: layer.prefill(x[:, :n], ids[:, :n], last, st.layers[0]), reps=1, top=30, devices=[dev])
    layer.attn.kernel = kernel
    return res, out.float().cpu()


def bench(kind: str, dev, context: int, chunk: int, paths: list[str], small: bool, fmt: str,
          use_kernels: bool, index_topk: int, profile: bool = False, indexer_kernel: bool = True) -> dict:
    dec = decode_bench()
    dec.V4_PRO = dict(dec.V4_PRO, index_topk=index_topk)
    before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    layer, cfg, _ = dec.build_layer(KINDS[kind], dev, small=small, fmt=fmt)
    if use_kernels:
        from dsv4lab.kernels.install import install_kernels  # lazy: needs triton and a GPU
        install_kernels(layer)
        if not indexer_kernel and layer.attn.indexer is not None:
            layer.attn.indexer.prefill_kernel = None
    res = {"layer": kind, "indexer_prefill_kernel": use_kernels and indexer_kernel, "hidden": cfg.hidden_size,
           "heads": cfg.num_attention_heads, "head_dim": cfg.head_dim,
           "window": cfg.sliding_window, "index_topk": cfg.index_topk, "format": fmt, "kernels": use_kernels,
           "weights_GB": ((torch.cuda.memory_allocated(dev) - before) / 1e9) if dev.type == "cuda" else None}
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(1, chunk, cfg.hc_mult, cfg.hidden_size, device=dev, generator=g).to(torch.bfloat16)
    outs = {}
    for path in paths:
        # warm-up over the whole context: kernels specialise on sizes that change as entries accumulate,
        # and their one-time compiles must not land in the timed pass (the first pass is kept as a number)
        first, _ = prefill_run(layer, cfg, dev, context, chunk, path, x)
        res[path], outs[path] = prefill_run(layer, cfg, dev, context, chunk, path, x, profile)
        res[path]["first_pass_tokens_per_s"] = first["tokens_per_s"]
    first = next(iter(outs.values()))
    res["last_chunk_max_abs"] = first.abs().max().item()
    for p in paths[1:]:
        res[f"last_chunk_max_abs_diff_{p}_vs_{paths[0]}"] = (outs[p] - first).abs().max().item()
    for p in ("bounded", "bounded_ref"):
        if "dense" in res and p in res:
            res[f"speedup_{p}_over_dense"] = res[p]["tokens_per_s"] / res["dense"]["tokens_per_s"]
    del layer
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="csa,hca", help="comma list of csa, hca")
    ap.add_argument("--paths", default="dense,bounded,bounded_ref",
                    help="comma list of dense, bounded (with the Triton kernel where installed), bounded_ref (PyTorch)")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--format", choices=("nvfp4", "official"), default="nvfp4")
    ap.add_argument("--index-topk", type=int, default=1024, help="V4-Pro's index_topk (decode.py's layer has 512)")
    ap.add_argument("--no-kernels", dest="kernels", action="store_false", help="reference linears, no Triton kernels")
    ap.add_argument("--json", type=Path, nargs="?", default=None, const=RESULTS / "prefill.json",
                    help="write the results here (bare --json: benchmarks/results/prefill.json)")
    ap.add_argument("--cpu-smoke", action="store_true", help="shrunken layer on the CPU, 256 tokens in 64-token chunks")
    ap.add_argument("--profile", action="store_true", help="also list the last chunk's kernels by device time (CUDA)")
    ap.add_argument("--reference-indexer", dest="indexer_kernel", action="store_false",
                    help="the indexer's prefill scores by the PyTorch reference (the kernel's baseline)")
    args = ap.parse_args()
    layers = [s for s in args.layers.split(",") if s]
    paths = [s for s in args.paths.split(",") if s]
    for name, vals, ok in (("--layers", layers, KINDS), ("--paths", paths, ("dense", "bounded", "bounded_ref"))):
        bad = [v for v in vals if v not in ok]
        if bad or not vals:
            ap.error(f"{name}: {bad or vals} not in {sorted(ok)}")
    if args.json is not None and "prefill" not in args.json.name:
        ap.error(f"--json {args.json}: the file name must contain 'prefill' (e.g. prefill_h200.json)")
    if args.cpu_smoke:
        dev, small, context, chunk, kernels = torch.device("cpu"), True, 256, 64, False
    else:
        if not torch.cuda.is_available():
            ap.error("needs CUDA (or --cpu-smoke)")
        dev, small, context, chunk, kernels = torch.device("cuda"), False, args.context, args.chunk, args.kernels
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "results": [bench(k, dev, context, chunk, paths, small, args.format, kernels, args.index_topk, args.profile,
                             args.indexer_kernel)
                       for k in layers]}
    text = json.dumps(res, indent=1)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
