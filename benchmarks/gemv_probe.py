"""What the batch-1 f16x2 GEMV loop decodes: a triage probe for the E2M1 nibble decode.

``decode_probe(words)`` runs ``dsv4lab.kernels.weight_decode.group_dot`` (inline PTX on the GPU, its
emulation under ``TRITON_INTERPRET=1``) against x' pairs holding f16 1.0 at one element, so every
decoded weight comes out exactly; ``decode_probe_selfcheck()`` compares every E2M1 code at every
position with the reference decode. Not part of the installed kernels (a debugging tool).

    python benchmarks/gemv_probe.py            # on the GPU: prints the self-check
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton  # a benchmark script: triton is required here
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dsv4lab.kernels.host import INTERPRET  # noqa: E402
from dsv4lab.kernels.weight_decode import group_dot  # noqa: E402
from dsv4lab.kernels.device import on_input_device  # noqa: E402
from dsv4lab.quant.fp4 import e2m1_decode, unpack_fp4  # noqa: E402


@triton.jit
def _decode_probe_kernel(w_ptr, out_ptr, BN: tl.constexpr, G: tl.constexpr, USE_ASM: tl.constexpr):
    """out[r, g, e] = what the M == 1 loop decodes for element e of word w[r, g] (times 2^14):
    ``_group_dot`` against x' pairs holding f16 1.0 at element e only, so the f16 sum is exact."""
    offs = tl.arange(0, BN)[:, None] * G + tl.arange(0, G)[None, :]
    w64 = tl.load(w_ptr + offs)
    one = tl.full((1, G), 0x3C00, tl.int32)      # f16 1.0 in the low half of a pair
    zero = tl.zeros((1, G), tl.int32)
    for e in tl.static_range(16):
        h = e // 8                                 # which int32 of the word
        j = (e % 8) % 2 * 2 + (e % 8) // 4         # pair j: elements H2_PAIR_LO[j] = 0, 4, 1, 5 and +2
        hi = (e % 8) % 4 >= 2                      # the pair's high half (element + 2)
        v = one << 16 if hi else one
        k = 4 * h + j
        part = group_dot(w64, v if k == 0 else zero, v if k == 1 else zero, v if k == 2 else zero,
                          v if k == 3 else zero, v if k == 4 else zero, v if k == 5 else zero,
                          v if k == 6 else zero, v if k == 7 else zero, BN, G, USE_ASM)
        tl.store(out_ptr + offs * 16 + e, part * 16384.0)


@on_input_device
def decode_probe(words: torch.Tensor) -> torch.Tensor:
    """The E2M1 values the batch-1 f16x2 loop decodes from int64 weight words [R, 16] (R a power
    of two >= 16): float32 [R, 16, 16], element e of word (r, g) at [r, g, e]. It must equal the
    reference decode of the same bytes (``tests/test_gemv_probe.py`` checks it exactly, through the
    interpreter and with the inline PTX on the GPU); a triage tool when a decode is suspected."""
    R, G = words.shape
    if words.dtype != torch.int64 or G != 16 or R < 16 or R & (R - 1):
        raise ValueError(f"decode_probe wants int64 words [R, 16], R a power of two >= 16; got {words.dtype} {tuple(words.shape)}")
    out = torch.empty((R, G, 16), dtype=torch.float32, device=words.device)
    _decode_probe_kernel[(1,)](words.contiguous(), out, BN=R, G=G, USE_ASM=words.is_cuda and not INTERPRET,
                               num_warps=1 if INTERPRET else 4)
    return out


def decode_probe_selfcheck(device: str | torch.device = "cuda") -> dict:
    """Every E2M1 code at every element of a word (code (3r + 5g + e) % 16 at element e of word
    (r, g)) through ``decode_probe`` against the reference decode of the same bytes. Returns
    {exact, pairs_covered (256 = all 16 codes at all 16 positions), nonzero}."""
    r, g, e = torch.meshgrid(torch.arange(16), torch.arange(16), torch.arange(16), indexing="ij")
    codes = ((3 * r + 5 * g + e) % 16).to(torch.uint8).reshape(16, 256)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    got = decode_probe(packed.to(device).view(torch.int64)).cpu()
    ref = e2m1_decode(unpack_fp4(packed)).reshape(16, 16, 16)
    covered = {(int(c), i % 16) for i, c in enumerate(codes.reshape(-1).tolist())}
    return {"exact": bool(torch.equal(got, ref)), "pairs_covered": len(covered), "nonzero": int((ref != 0).sum())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="default: cuda, or cpu under TRITON_INTERPRET=1")
    args = ap.parse_args(argv)
    device = args.device or ("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")
    print(json.dumps(decode_probe_selfcheck(device)))


if __name__ == "__main__":
    main()
