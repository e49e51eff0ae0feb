"""The compressor decode kernel (dsv4lab/kernels/compressor_decode.py) through Triton's interpreter
on CPU tensors against the reference ``Compressor.decode``: run by
tests/test_compressor_decode_kernel.py in a subprocess with TRITON_INTERPRET=1 (set before triton
is imported). Prints one line ``RESULT{json}``.

Cases: ratio 4 with overlap (CSA), ratios 8 and 16 without (HCA-like); d 16 and 24 (not a power
of two; slot tiles of 4, so several tiles per softmax pass); fp32 module and state, bf16 module
and state, and (ratio 4) a bf16 module with an fp32 state. Each runs three windows of decode
steps from an empty state and after a prefill of every residue mod the ratio (ratio 16: residues
1, 7, 15); after each step the kernel's state (its own, never reset to the reference's) is
compared with the reference's: the rings must be identical, the entries within tolerance where
the reference wrote one and identical elsewhere, the entry counts equal.
"""
import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from dsv4lab.kernels.compressor_decode import compressor_decode_triton  # noqa: E402
from dsv4lab.model.compressor import Compressor  # noqa: E402
from dsv4lab.model.state import CompressorState  # noqa: E402
from oracle_util import tiny_config  # noqa: E402


def round_bf16_like_the_gpu() -> None:
    """The interpreter casts fp32 -> bf16 by truncation; the GPU (and PyTorch) round to nearest
    even. Patch the interpreter's cast so the bf16 comparison measures the kernel, not the cast."""
    orig = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            u = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
            return np.where(np.isnan(data), np.uint16(0x7FC0), r)
        return orig(data, src, dst, rounding_mode)

    interpreter._convert_float = convert


round_bf16_like_the_gpu()


def kernel_slot(comp, kv, z, pos, st, ape_scale=1.0, block_l=16):
    return compressor_decode_triton(kv, z, pos, st.ring_kv, st.ring_gate, st.entries, comp.ape * ape_scale,
                                    comp.norm.weight, comp.rotary.inv_freq, comp.norm.eps, comp.overlap,
                                    block_l=block_l)


def make(cfg, dim, ratio, overlap, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    comp = Compressor(cfg, dim, ratio, overlap)
    with torch.no_grad():
        for name, p in comp.named_parameters():
            if p.ndim >= 2 and name != "ape":
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            elif name == "ape":
                p.copy_(torch.randn(p.shape, generator=g))  # large: a wrong place for it shows
            else:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    return comp.to(dtype).eval()


def run_case(cfg, dim, ratio, overlap, dtype, st_dtype, prefill_len, B=2, seed=0, ape_scale=1.0,
             block_l=16):
    comp = make(cfg, dim, ratio, overlap, dtype, seed)
    g = torch.Generator().manual_seed(100 + prefill_len)
    steps = 3 * ratio
    n_max = (prefill_len + steps) // ratio + 1
    x = (torch.randn(B, prefill_len + steps, cfg.hidden_size, generator=g) * 2).to(dtype)
    ref = CompressorState.empty(B, ratio, dim, overlap, n_max * ratio, st_dtype, "cpu")
    with torch.no_grad():
        if prefill_len:
            comp.prefill(x[:, :prefill_len], 0, ref)
    ker = CompressorState(ref.ring_kv.clone(), ref.ring_gate.clone(), ref.entries.clone())
    worst = {"entry_err": 0.0, "ref_max": 0.0, "rings_equal": True, "unwritten_equal": True, "n_equal": True,
             "closes": 0, "kernel_calls": 0}
    for t in range(prefill_len, prefill_len + steps):
        pos = torch.tensor(t)
        xt = x[:, t : t + 1]
        with torch.no_grad():
            comp.decode_kernel = None
            n_ref = comp.decode(xt, pos, ref)
            calls = []
            comp.decode_kernel = lambda *a: calls.append(1) or kernel_slot(*a, ape_scale=ape_scale, block_l=block_l)
            n_ker = comp.decode(xt, pos, ker)
        worst["kernel_calls"] += len(calls)
        worst["n_equal"] &= bool(torch.equal(n_ref, n_ker)) and n_ker.shape == n_ref.shape
        worst["rings_equal"] &= bool(torch.equal(ref.ring_kv, ker.ring_kv) and torch.equal(ref.ring_gate, ker.ring_gate))
        n_written = (t + 1) // ratio
        worst["unwritten_equal"] &= bool(torch.equal(ref.entries[:, n_written:], ker.entries[:, n_written:]))
        if (t + 1) % ratio == 0:
            worst["closes"] += 1
        e_ref, e_ker = ref.entries[:, :n_written].float(), ker.entries[:, :n_written].float()
        if n_written:
            worst["entry_err"] = max(worst["entry_err"], (e_ref - e_ker).abs().max().item())
            worst["ref_max"] = max(worst["ref_max"], e_ref.abs().max().item())
    return worst


cfg = tiny_config()
res = {}
F32, BF16 = (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)
MIXED = (torch.bfloat16, torch.float32)  # a bf16 module with an fp32 state
for ratio, overlap, dim, dtypes in ((4, True, 16, (F32, BF16, MIXED)), (4, True, 24, (F32, BF16, MIXED)),
                                    (8, False, 16, (F32, BF16)), (16, False, 24, (F32, BF16))):
    for dtype, st_dtype in dtypes:
        residues = range(ratio) if ratio <= 8 else (0, 1, 7, 15)
        for r in residues:
            plen = 0 if r == 0 else ratio + r  # r == 0: from an empty state; else after a prefill
            key = f"m{ratio}_{'csa' if overlap else 'hca'}_d{dim}_{str(dtype)[6:]}_st{str(st_dtype)[6:]}_p{plen}"
            # d 24: slot tiles of 4 (several tiles per pass; CSA: one per half)
            res[key] = run_case(cfg, dim, ratio, overlap, dtype, st_dtype, plen, block_l=4 if dim == 24 else 16)
        if ratio == 4 and dim == 16:  # a prefill that ends on a window boundary too
            key = f"m4_csa_d16_{str(dtype)[6:]}_st{str(st_dtype)[6:]}_p8"
            res[key] = run_case(cfg, dim, ratio, overlap, dtype, st_dtype, 8)
# a kernel that loses the position bias must fail the comparison (the test can fail)
res["wrong_no_ape"] = run_case(cfg, 16, 4, True, torch.float32, torch.float32, 5, ape_scale=0.0)
print("RESULT" + json.dumps(res))
