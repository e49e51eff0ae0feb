"""Benchmark the compressor decode step (after the wkv / wgate projections): the Triton kernel
(``dsv4lab.kernels.compressor_decode``, one launch) against the PyTorch reference
(``Compressor.decode_window`` after ``gate_logits``) at V4-Pro shapes in bf16, batch 1 and 8:
the attention's CSA (ratio 4, overlap) and HCA (ratio 128) compressors at d 512, and the
indexer's (ratio 4, overlap) at d 128.

Per kind and backend: ``open_us`` (a step that only writes the ring, pos = 0), ``close_us`` (a step
that closes the window and writes an entry, pos = ratio - 1), both as CUDA-graph replays (no
Python launch overhead), and ``step_us`` = the mean over a window ((ratio - 1) open + 1 close).
Also the max |kernel - reference| of the closing step's entry relative to max|ref|.

    python3 benchmarks/compressor_decode.py --json out.json
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels import graph_time_us, rel_err  # noqa: E402
from dsv4lab.config import named_config  # noqa: E402
from dsv4lab.kernels.compressor_decode import compressor_decode_triton  # noqa: E402
from dsv4lab.model.compressor import Compressor  # noqa: E402
from dsv4lab.model.state import CompressorState  # noqa: E402


def build(kind: str):
    cfg = named_config("v4-pro")
    dim, ratio, overlap = {"csa": (cfg.head_dim, 4, True), "hca": (cfg.head_dim, 128, False),
                           "indexer": (cfg.index_head_dim, 4, True)}[kind]
    comp = Compressor(cfg, dim, ratio, overlap, rotate=kind == "indexer")
    with torch.no_grad():
        comp.ape.normal_(0, 0.3)
        comp.norm.weight.normal_(1, 0.3)
    del comp.wkv, comp.wgate  # not timed: the projections stay QLinear calls before the step
    return comp.to("cuda", torch.bfloat16).eval()


def step_fns(comp, B: int, pos_value: int):
    c = 2 if comp.overlap else 1
    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(B, 1, c * comp.dim, device="cuda", generator=g).bfloat16()
    z = torch.randn(B, 1, c * comp.dim, device="cuda", generator=g).bfloat16()
    pos = torch.tensor(pos_value, device="cuda")
    states = []
    for _ in range(2):
        st = CompressorState.empty(B, comp.ratio, comp.dim, comp.overlap, 4 * comp.ratio, torch.bfloat16, "cuda")
        st.ring_kv.normal_(generator=g)
        st.ring_gate.normal_(generator=g)
        states.append(st)
    ref_st, ker_st = states
    ker_st.ring_kv.copy_(ref_st.ring_kv)
    ker_st.ring_gate.copy_(ref_st.ring_gate)

    def ref():
        comp.decode_window(kv, comp.gate_logits(z, (pos % comp.ratio).view(1)), pos, ref_st)

    def ker():
        compressor_decode_triton(kv, z, pos, ker_st.ring_kv, ker_st.ring_gate, ker_st.entries, comp.ape,
                                 comp.norm.weight, comp.rotary.inv_freq, comp.norm.eps, comp.overlap)

    return ref, ker, ref_st, ker_st


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    rows = []
    with torch.no_grad():
        for kind in ("csa", "hca", "indexer"):
            comp = build(kind)
            m = comp.ratio
            for B in (1, 8):
                row = {"kind": kind, "ratio": m, "d": comp.dim, "batch": B}
                for name, p in (("open", 0), ("close", m - 1)):
                    ref, ker, ref_st, ker_st = step_fns(comp, B, p)
                    row[f"ref_{name}_us"] = graph_time_us([ref])
                    row[f"kernel_{name}_us"] = graph_time_us([ker])
                    if name == "close":
                        row["close_rel_err"] = rel_err(ker_st.entries[:, 0], ref_st.entries[:, 0])
                for b in ("ref", "kernel"):
                    row[f"{b}_step_us"] = ((m - 1) * row[f"{b}_open_us"] + row[f"{b}_close_us"]) / m
                rows.append(row)
                print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
