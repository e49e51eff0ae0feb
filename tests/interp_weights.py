"""Random quantised weights and activations for the interpreter checks (tests/*_interp_check.py):
every code, subnormal scales, outlier rows and columns; and their row-relative error count."""
import torch

from dsv4lab.quant.weights import FP8BlockWeight, MXFP4Weight, NVFP4Weight

g = torch.Generator().manual_seed(0)


def bad(y, r, rtol):
    """Elements with |y - r| > rtol * (|r| + max|r| of its row): a row-relative tolerance, so
    the outlier rows of x do not loosen the others."""
    y, r = y.float(), r.float()
    tol = rtol * (r.abs() + r.abs().amax(dim=-1, keepdim=True))
    return {"bad": int(((y - r).abs() > tol).sum()), "max_rel": float(((y - r).abs() / tol * rtol).max())}


def rand_nvfp4(n, k):
    # every code (negatives included); e4m3 scales from subnormal (2^-9) up to ~4
    sc = (torch.rand(n, k // 16, generator=g) * 4).to(torch.float8_e4m3fn)
    sc.view(torch.uint8)[:, ::3] = torch.randint(1, 8, (n, len(range(0, k // 16, 3))), generator=g, dtype=torch.uint8)
    return NVFP4Weight(torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8), sc, torch.tensor(0.37))


def rand_mxfp4(n, k):
    # E8M0 exponents from 2^-127 (a subnormal scale) to 2^8
    e = torch.randint(110, 136, (n, k // 32), generator=g, dtype=torch.uint8)
    e[0, 0] = 0
    return MXFP4Weight(torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8), e.view(torch.float8_e8m0fnu))


def rand_fp8(n, k):
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes; subnormals (exponent 0) included
    s = torch.rand((n + 127) // 128, k // 128, generator=g) * 0.1 + 1e-6
    return FP8BlockWeight(codes.view(torch.float8_e4m3fn), s)


def rand_x(m, k, dtype):
    x = torch.randn(m, k, generator=g)
    x[1] *= 1e4    # an outlier row
    x[2] *= 1e-20  # a tiny one
    x[3, ::37] = 300.0  # outlier columns inside a row
    return x.to(dtype)
