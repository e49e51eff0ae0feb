"""Where the prefill GEMM's M = 128 time goes (issue 25's last target): the rule's tiles against
variants (no K split, half the split, 64-token tiles, 64-row weight tiles, 4 stages, BK 64) and
cuBLAS BF16 on the same shape, each replayed from a CUDA graph (``gemm.timed_graph``: the GPU alone,
L2 flushed by do_bench), every variant checked against dequantise + ``F.linear``.

    python3 benchmarks/results/kernels/m128_probe/m128_probe.py $OUT/m128.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from benchmarks.gemm import SHAPES, matmul, rand_weight, timed_graph  # noqa: E402
from dsv4lab.kernels.linear_gemm import gemm_tiles  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    dev = torch.device("cuda")
    M = 128
    rows = []
    for name in ("q_a", "q_b", "o_b", "w1/w3", "w2"):
        K, N = SHAPES[name]
        for fmt in ("nvfp4", "mxfp4"):
            w = rand_weight(fmt, N, K, dev, seed=N + K)
            x = torch.randn(M, K, device=dev).to(torch.bfloat16)
            dense = w.dequantize(torch.bfloat16)
            ref = F.linear(x, dense).float()
            base = gemm_tiles(fmt, M, N, K, dev)
            variants = {"rule": {}, "split1": {"SPLIT": 1}, "split_half": {"SPLIT": max(1, base["SPLIT"] // 2)},
                        "split_double": {"SPLIT": min(64, base["SPLIT"] * 2)}, "bm64": {"BM": 64},
                        "bn64_w4": {"BN": 64, "num_warps": 4}, "stages4": {"STAGES": 4}, "bk64": {"BK": 64},
                        "stages2": {"STAGES": 2}}
            res = {"shape": name, "format": fmt, "K": K, "N": N, "rule_tiles": base,
                   "cublas_bf16_us": timed_graph(lambda: F.linear(x, dense), dev)}
            for vname, v in variants.items():
                cfg = {**base, **v, "DENSE": False}
                if K % cfg["BK"]:
                    continue
                try:
                    err = float((matmul(x, w, cfg).float() - ref).abs().max() / ref.abs().max())
                    res[vname] = {"us": timed_graph(lambda: matmul(x, w, cfg), dev), "err": err}
                except Exception as e:  # noqa: BLE001 - a variant that does not fit: recorded
                    res[vname] = {"error": f"{type(e).__name__}: {str(e)[:100]}"}
            best = min((k for k in variants if "us" in res.get(k, {})), key=lambda k: res[k]["us"])
            print(f"{name:6s} {fmt:9s} cuBLAS {res['cublas_bf16_us']:6.1f}  rule {res['rule']['us']:6.1f} "
                  f"(split {base['SPLIT']})  " + "  ".join(f"{k} {res[k]['us']:.1f}" for k in variants
                                                           if k != "rule" and "us" in res.get(k, {}))
                  + f"  best {best}", flush=True)
            rows.append(res)
            del w, dense
            torch.cuda.empty_cache()
    if out:
        out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "M": M, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
