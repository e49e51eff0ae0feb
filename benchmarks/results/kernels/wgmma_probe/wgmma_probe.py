"""The Gluon W4A16 GEMM (``linear_gemm_wgmma``: async wgmma, the next tile decoded while it runs)
against the Triton prefill GEMM's rule and cuBLAS BF16 on the same shape, M = 64 / 128 / 256, V4-Pro
shapes, NVFP4 and MXFP4; each replayed from a CUDA graph (``gemm.timed_graph``, L2 flushed),
each checked against dequantise + ``F.linear``.

    python3 benchmarks/results/kernels/wgmma_probe/wgmma_probe.py $OUT/wgmma.json [M,M,...] [rule]
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from benchmarks.gemm import SHAPES, matmul, rand_weight, timed_graph  # noqa: E402
from dsv4lab.kernels.linear_gemm import gemm_tiles  # noqa: E402
from dsv4lab.kernels.linear_gemm_wgmma import launch_wgmma_gemm, wgmma_tiles  # noqa: E402
from dsv4lab.kernels.host import num_sms  # noqa: E402


RULE_ONLY = False  # argv[3] == "rule": the rule's tiles only (no variants)


def parts(w):
    if w.format == "nvfp4":
        return w.packed, w.block_scale, w.global_scale
    return w.packed, w.scale, None


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    ms = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else [128]
    global RULE_ONLY
    RULE_ONLY = len(sys.argv) > 3 and sys.argv[3] == "rule"
    dev = torch.device("cuda")
    rows = []
    for M in ms:
        for name in ("q_a", "q_b", "o_b", "wkv", "w1/w3", "w2"):
            K, N = SHAPES[name]
            for fmt in ("nvfp4", "mxfp4"):
                w = rand_weight(fmt, N, K, dev, seed=N + K)
                x = torch.randn(M, K, device=dev).to(torch.bfloat16)
                dense = w.dequantize(torch.bfloat16)
                ref = F.linear(x, dense).float()
                p, s, gs = parts(w)
                base = wgmma_tiles(M, N, K, num_sms(dev))
                res = {"shape": name, "format": fmt, "M": M, "K": K, "N": N, "wgmma_tiles": base,
                       "cublas_bf16_us": timed_graph(lambda: F.linear(x, dense), dev)}
                tcfg = {**gemm_tiles(fmt, M, N, K, dev), "DENSE": False}
                res["triton_us"] = timed_graph(lambda: matmul(x, w, tcfg), dev)
                res["old_path_us"] = timed_graph(lambda: matmul(x, w, {"TILED": True}), dev)  # issue 25's "today"
                variants = {"rule": {}, "split1": {"SPLIT": 1}, "split_x2": {"SPLIT": min(64, base["SPLIT"] * 2)},
                            "no_decode": {"PROBE": 1}, "no_mma": {"PROBE": 2}, "bm64": {"BM": 64},
                            "bm64_split_x2": {"BM": 64, "SPLIT": min(64, base["SPLIT"] * 2)},
                            "bk128_s3": {"BK": 128, "STAGES": 3}}
                if RULE_ONLY:
                    variants = {"rule": {}}
                for vname, v in variants.items():
                    if fmt == "mxfp4" and vname not in ("rule",):
                        continue
                    cfg = {**base, **v}
                    y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
                    try:
                        launch_wgmma_gemm(x, fmt, p, s, gs, y, cfg)
                        torch.cuda.synchronize()
                        err = float((y.float() - ref).abs().max() / ref.abs().max())
                        res[vname] = {"us": timed_graph(lambda: launch_wgmma_gemm(x, fmt, p, s, gs, y, cfg), dev),
                                      "err": err}
                    except Exception as e:  # noqa: BLE001 - a variant that does not fit: recorded
                        res[vname] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                        if vname == "rule":
                            traceback.print_exc()
                ok = [k for k in variants if "us" in res.get(k, {})]
                best = min(ok, key=lambda k: res[k]["us"]) if ok else None
                r = res["rule"]
                print(f"M={M} {name:6s} {fmt:6s} cuBLAS {res['cublas_bf16_us']:6.1f} old {res['old_path_us']:6.1f} "
                      f"triton {res['triton_us']:6.1f} "
                      f"wgmma {r.get('us', float('nan')):6.1f} err {r.get('err', r.get('error'))} split {base['SPLIT']} | "
                      + "  ".join(f"{k} {res[k]['us']:.1f} (err {res[k]['err']:.1e})" for k in ok if k != "rule") + f"  best {best}", flush=True)
                rows.append(res)
                del w, dense
                torch.cuda.empty_cache()
    if out:
        out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
