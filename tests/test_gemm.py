"""The prefill GEMM (``dsv4lab.kernels.linear_gemm``, M >= 64, NVFP4 / MXFP4 / FP8-block) and the
grouped routed-experts prefill (``dsv4lab.kernels.moe_prefill``).

CPU: both through Triton's interpreter in a subprocess (tests/gemm_interp_check.py, tiny shapes:
M = 64, 97, 130 against N = 40, random codes incl. negatives, subnormal scales, outlier rows and
columns in x), and the ``Experts`` wiring of ``prefill_kernel`` with a reference-equal fake.
GPU (``-m gpu``): V4-Pro shapes at M = 128 and 4096, and the grouped prefill at V4-Pro expert sizes.

Tolerances (every element, ``ref`` = dequantise then ``F.linear`` / the per-expert reference):
* GEMM bf16: |y - ref| <= 1e-2 (|ref| + max|ref| of its row) (bf16 output, fp32 accumulation in
  another order, the NVFP4 reference rounds W * global scale to bf16); fp32 (interpreter): 1e-5.
* MoE prefill bf16: 2e-2 (|ref| + max|ref| of its row): gate and up are rounded to bf16 before the
  SwiGLU in both, but a 1-ulp difference there passes through w2; fp32 (interpreter): 1e-5.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dsv4lab.kernels.moe_prefill_ref import moe_prefill_ref
from dsv4lab.quant.weights import quantize_nvfp4
from dsv4lab.workbench import random_model
from oracle_util import tiny_config

ROOT = Path(__file__).resolve().parents[1]
HAVE_TRITON = importlib.util.find_spec("triton") is not None
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA and triton")


@pytest.fixture(scope="module")
def interp():
    assert HAVE_TRITON, "triton is part of the test set-up (pip install -e '.[kernels]')"
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "gemm_interp_check.py")], cwd=ROOT, capture_output=True,
                       text=True, timeout=900, env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT"))[6:])


def test_interp_gemm(interp):
    """Every format, M, dtype, tile orientation and split K; the dispatcher's M >= 64 path; BK 128."""
    r = {k: v for k, v in interp.items() if k.startswith("gemm_")}
    assert len(r) == 3 * (3 * 2 * 2 * 2 + 2), sorted(r)
    assert all(v["bad"] == 0 for v in r.values()), {k: v for k, v in r.items() if v["bad"]}


def test_interp_moe_prefill(interp):
    r = {k: v for k, v in interp.items() if k.startswith("moe_")}
    assert len(r) == 2 * 2 * 2 * 2, sorted(r)
    assert all(v["bad"] == 0 for v in r.values()), {k: v for k, v in r.items() if v["bad"]}
    assert interp["schedule"] == {"rows_once": True, "one_expert": True, "pos_inverse": True, "src": True}


def test_tile_rule(monkeypatch):
    """The fixed tile rule on a 132-SM GPU: up to 128 tokens of an FP4 format whose 128-row tiles do
    not cover the SMs (split K) take 64 weight rows and 4 warps at the same split; q_b (512 row
    tiles), FP8-block and larger batches keep 128 rows and 8 warps."""
    pytest.importorskip("triton")
    from dsv4lab.kernels import linear_gemm as lg

    monkeypatch.setattr(lg, "INTERPRET", False)
    monkeypatch.setattr(lg, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    q_a = lg.gemm_tiles("nvfp4", 128, 1536, 7168, cpu)
    assert (q_a["BN"], q_a["num_warps"], q_a["SPLIT"]) == (64, 4, 11)  # the split of 12 tiles of 128 rows
    assert lg.gemm_tiles("mxfp4", 128, 3072, 7168, cpu)["BN"] == 64
    q_b = lg.gemm_tiles("nvfp4", 128, 65536, 1536, cpu)
    assert (q_b["BN"], q_b["num_warps"], q_b["SPLIT"], q_b["BK"]) == (128, 8, 1, 64)
    assert lg.gemm_tiles("fp8_block", 128, 1536, 7168, cpu)["BN"] == 128
    assert lg.gemm_tiles("nvfp4", 256, 1536, 7168, cpu)["BN"] == 128
    assert lg.gemm_tiles("nvfp4", 4096, 1536, 7168, cpu)["BM"] == 256


def _nvfp4_experts(n_experts=12, seed=3):
    cfg = tiny_config(n_routed_experts=n_experts, num_experts_per_tok=3, moe_intermediate_size=32)
    m = random_model(cfg, seed=seed)
    ex = m.layers[1].mlp.experts
    for e in range(cfg.n_routed_experts):
        for p in ("w1", "w2", "w3"):
            ql = getattr(ex[e], p)
            ql.set_weight(quantize_nvfp4(ql.weight.data))
    ex.kernel_devices = ("cpu", "cuda")
    return ex


class Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0
        self.__name__ = "counting_moe_prefill_ref"

    def __call__(self, *a, **k):
        self.calls += 1
        return self.fn(*a, **k)


@pytest.mark.parametrize("before", [False, True])
def test_experts_prefill_kernel_wiring(before):
    """The sparse (prefill) path of ``Experts`` hands the stacks, limit and weight order to
    ``prefill_kernel`` and returns what it returns: with the reference as the kernel, the output
    equals the loop's; ``hook_expert_out`` listening runs the loop instead; graph-safe decode is
    untouched (``prefill_kernel`` is not called)."""
    from dsv4lab.quant.modes import RoundTrip

    ex = _nvfp4_experts()
    if before:
        ex.round_trips = frozenset({RoundTrip.WEIGHT_BEFORE_W2})
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, ex[0].w1.in_features, generator=g)
    ids = torch.stack([torch.randperm(len(ex), generator=g)[:3] for _ in range(20)])
    w = torch.rand(20, 3, generator=g)
    want = ex(x, ids, w)
    kern = Counting(moe_prefill_ref)
    ex.prefill_kernel = kern
    got = ex(x, ids, w)
    assert kern.calls == 1 and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    seen = []
    h = ex.hook_expert_out.register_forward_hook(lambda mod, inp, out: seen.append(out))
    ex(x, ids, w)
    h.remove()
    assert kern.calls == 1 and seen, "hook_expert_out listening must run the reference loop"
    ex(x[:2], ids[:2], w[:2], graph_safe=True)
    assert kern.calls == 1


def test_install_sets_prefill_slot():
    """``install_kernels(experts_prefill=...)`` fills ``Experts.prefill_kernel``; disabling clears it."""
    from dsv4lab.kernels.install import install_kernels

    ex = _nvfp4_experts()
    assert install_kernels(ex, experts_prefill=moe_prefill_ref) == 1 and ex.prefill_kernel is moe_prefill_ref
    assert ex.kernel is None
    assert install_kernels(ex, enable=False) == 1 and ex.prefill_kernel is None


# ----------------------------------------------------------------------------- GPU (V4-Pro shapes)
V4_PRO = {"q_a": (7168, 1536), "q_b": (1536, 65536), "o_b": (16384, 7168), "wkv": (7168, 512),
          "w1": (7168, 3072), "w2": (3072, 7168)}


def _rand_weight(fmt: str, N: int, K: int, seed: int):
    from dsv4lab.quant.weights import FP8BlockWeight, MXFP4Weight, NVFP4Weight

    gen = torch.Generator(device="cuda").manual_seed(seed)
    if fmt == "fp8_block":
        codes = torch.randint(0, 256, (N, K), generator=gen, dtype=torch.uint8, device="cuda")
        codes[(codes & 0x7F) == 0x7F] = 0x3C
        return FP8BlockWeight(codes.view(torch.float8_e4m3fn),
                              torch.rand((N + 127) // 128, K // 128, generator=gen, device="cuda") * 0.01 + 1e-5)
    packed = torch.randint(0, 256, (N, K // 2), generator=gen, dtype=torch.uint8, device="cuda")
    if fmt == "mxfp4":
        e = torch.randint(118, 124, (N, K // 32), generator=gen, dtype=torch.uint8, device="cuda")
        return MXFP4Weight(packed, e.view(torch.float8_e8m0fnu))
    sc = (torch.rand(N, K // 16, generator=gen, device="cuda") * 4 + 2 ** -9).to(torch.float8_e4m3fn)
    return NVFP4Weight(packed, sc, torch.tensor(0.021, device="cuda"))


def _row_close(y, r, rtol):
    y, r = y.float(), r.float()
    bad = (y - r).abs() > rtol * (r.abs() + r.abs().amax(dim=-1, keepdim=True))
    assert int(bad.sum()) == 0, f"{int(bad.sum())} bad, max abs {(y - r).abs().max().item()}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8_block"])
@pytest.mark.parametrize("name", list(V4_PRO))
@pytest.mark.parametrize("M", [128, 4096])
def test_gpu_gemm_v4_pro(fmt, name, M):
    """The dispatcher's kernel at V4-Pro shapes; twice (split-K counters reset), bitwise equal."""
    from dsv4lab.kernels.dispatch import quant_linear

    K, N = V4_PRO[name]
    w = _rand_weight(fmt, N, K, seed=M + N)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    x[1] *= 1e3
    y = quant_linear(x, w)
    _row_close(y, F.linear(x, w.dequantize(torch.bfloat16)), 1e-2)
    assert torch.equal(quant_linear(x, w), y)


def _moe_inputs(fmt, E, T=4096, k=6, H=7168, I=3072):
    """Stacks of E V4-Pro-sized experts, bf16 tokens, top-k ids and weights (CUDA)."""
    from dsv4lab.quant.stacked import stack_experts

    w1 = stack_experts([_rand_weight(fmt, I, H, 10 + e) for e in range(E)])
    w3 = stack_experts([_rand_weight(fmt, I, H, 100 + e) for e in range(E)])
    w2 = stack_experts([_rand_weight(fmt, H, I, 200 + e) for e in range(E)])
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(T, H, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    ids = torch.rand(T, E, device="cuda", generator=gen).topk(k, dim=-1).indices
    return w1, w3, w2, x, ids, torch.rand(T, k, device="cuda", generator=gen)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_dense_moe(fmt):
    """4096 tokens, top-6 of 8 V4-Pro-sized experts (3072 rows each: ``moe_prefill_dense`` by
    default) against the reference and the grouped kernels; bitwise equal on a second call."""
    from dsv4lab.kernels.moe_prefill import moe_prefill_triton

    w1, w3, w2, x, ids, wt = _moe_inputs(fmt, 8)
    y = moe_prefill_triton(x, ids, wt, w1, w3, w2, 10.0)
    _row_close(y, moe_prefill_ref(x, ids, wt, w1, w3, w2, 10.0), 2e-2)
    _row_close(moe_prefill_triton(x, ids, wt, w1, w3, w2, 10.0, cfg={"DENSE": False}), y, 2e-2)
    assert torch.equal(moe_prefill_triton(x, ids, wt, w1, w3, w2, 10.0), y)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("before", [False, True])
def test_gpu_moe_prefill(fmt, before):
    """4096 tokens, top-6 of 32 V4-Pro-sized experts (7168 -> 3072 -> 7168), clamp 10: the grouped
    prefill vs the per-expert reference, and bitwise equal on a second call and under a CUDA graph."""
    from dsv4lab.kernels.moe_prefill import moe_prefill_triton

    w1, w3, w2, x, ids, wt = _moe_inputs(fmt, 32)
    grouped = {"DENSE": False}  # 768 rows an expert: the dense tier's by default (tests/test_dequant_gemm.py)
    y = moe_prefill_triton(x, ids, wt, w1, w3, w2, 10.0, before, cfg=grouped)
    _row_close(y, moe_prefill_ref(x, ids, wt, w1, w3, w2, 10.0, before), 2e-2)
    assert torch.equal(moe_prefill_triton(x, ids, wt, w1, w3, w2, 10.0, before, cfg=grouped), y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = moe_prefill_triton(x, ids, wt, w1, w3, w2, 10.0, before)  # capturing: the grouped kernels
    graph.replay()
    assert torch.equal(yg, y)
