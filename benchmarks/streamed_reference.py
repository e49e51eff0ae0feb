"""Peak memory of one reference run, dense vs streamed (dsv4lab.precision.streaming), as JSON.

Each (mode, path) runs in a fresh process: load the model, one warm-up ``w4a16`` run on 8 tokens,
then the reference run under ``bf16`` or ``orig`` (originals read from ``--reference``). The
peak above the warm-up is ``torch.cuda.max_memory_allocated`` summed over the model's GPUs on
CUDA, the peak RSS on the CPU (mapped shard pages of the originals count there). Printed next to
it: the dense bytes the non-streamed run adds and the largest single dense weight (the streamed
run's stated bound).

    python3 benchmarks/streamed_reference.py [--model tiny-nvfp4] [--reference tiny] [--device cpu] [--tokens 64]

On a model that does not fit twice, ``--paths streamed`` skips the dense run (it would not fit).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys


def one(args) -> dict:
    import torch

    import dsv4lab
    from dsv4lab.checkpoint.locate import resolve_path
    from dsv4lab.precision import Originals
    from dsv4lab.precision.streaming import dense_bytes, largest_dense_bytes
    from dsv4lab.precision.sweep import reference_run

    torch.set_num_threads(1)
    m = dsv4lab.load(args.model, device=args.device, progress=False)
    orig = Originals.from_checkpoint(resolve_path(args.reference), m.dtype) \
        if args.mode == "orig" else None
    ids = torch.randint(0, m.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(m.device)
    cuda = [d for d in {torch.device(x) for x in m.layer_devices()} if d.type == "cuda"]
    reference_run(m, ids[:, :8], "w4a16", streaming=False)
    gc.collect()
    for d in cuda:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)
    base_cuda = sum(torch.cuda.memory_allocated(d) for d in cuda)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    run = reference_run(m, ids, args.mode, orig, streaming=args.path == "streamed")
    peak = sum(torch.cuda.max_memory_allocated(d) for d in cuda) - base_cuda if cuda else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    return {"mode": args.mode, "path": args.path, "device": args.device, "tokens": args.tokens,
            "measure": "cuda max_memory_allocated" if cuda else "peak RSS",
            "peak_above_warmup_bytes": int(peak), "dense_bytes": sum(dense_bytes(m, args.mode).values()),
            "largest_dense_bytes": largest_dense_bytes(m, args.mode),
            "how": run.how}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-nvfp4")
    ap.add_argument("--reference", default="tiny", help="checkpoint of the original weights (orig)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--modes", default="bf16,orig")
    ap.add_argument("--paths", default="dense,streamed")
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(one(args)))
        return
    rows = []
    for mode in args.modes.split(","):
        for path in args.paths.split(","):
            cmd = [sys.executable, __file__, "--model", args.model, "--reference", args.reference,
                   "--device", args.device, "--tokens", str(args.tokens), "--mode", mode, "--path", path]
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}   # freed buffers leave RSS
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
