"""The CuTeDSL compressor softmax-pool kernel (dsv4lab/kernels/compressor_pool_cute.py).

CPU (CI): the reference is Compressor.pool's softmax + weighted sum (captured through
hooks on a tiny Compressor), the dispatcher falls back to it on CPU and without cutlass, bad inputs
raise ValueError, the launch configs are well formed, and a PyTorch emulation of the kernel's
algorithm (slices, chunked online softmax from -FLT_MAX, exp2, slice merge) matches the reference
within the GPU tolerances below, and cute.compile builds the sm_90a cubin without a GPU (needs
nvidia-cutlass-dsl, which `make test` installs: a missing one fails, it is not skipped).

GPU (@pytest.mark.gpu, skipped without CUDA): kernel vs reference for (L, d) in
{(8,512), (128,512), (4,128), (16,1024)}, kv bf16 and fp32, rows 1 and 300, random inputs (never
zeros) with -inf slots, through two backends:
  * "jit": compressor_pool_cute (cute.compile on the device; needs nvidia-cutlass-dsl);
  * "aot": compressor_pool_aot with the cubins that `python -m dsv4lab.kernels.compressor_pool_cute
    export-aot DIR` compiled ahead of time; DIR from $DSV4LAB_CUTE_AOT_DIR (needs cuda-python).

Tolerances (y = kernel, ref = compressor_pool_ref, ref32 = the same math in fp32):
  * fp32 kv: |y - ref| <= 1e-5 * max|ref| + 1e-5 * |ref| (fp32 sums in another order, ex2.approx);
  * bf16 kv: |y - ref| <= 1e-2 * max|ref| (the reference rounds the weights and the products to
    bf16, the kernel only the result: about 1 bf16 ulp of max|ref|; the CPU emulation sees
    <= 6.4e-3), and |y - ref32| <= 2^-8 * |ref32| + 1e-4 * max|ref32| (y is ref32 rounded to bf16,
    up to fp32 summation order).
"""
import builtins
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dsv4lab.kernels import compressor_pool_cute as cp

ROOT = Path(__file__).resolve().parents[1]
HAVE_CUDA = torch.cuda.is_available()
HAVE_CUTLASS = importlib.util.find_spec("cutlass") is not None
AOT_DIR = os.environ.get("DSV4LAB_CUTE_AOT_DIR", "")
SHAPES = [(8, 512), (128, 512), (4, 128), (16, 1024)]
LOG2E = 1.4426950408889634


def make_inputs(B: int, nW: int, L: int, d: int, dtype: torch.dtype, seed: int = 0,
                device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random kv (never zero) and fp32 logits with ~25% -inf slots, row 0's first half empty
    (CSA window 0), and never a whole column of -inf."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(B, nW, L, d, generator=g)
    kv = torch.where(kv == 0, torch.full_like(kv, 0.5), kv).to(dtype)
    gate = torch.randn(B, nW, L, d, generator=g) * 2
    mask = torch.rand(B, nW, L, d, generator=g) < 0.25
    if L >= 2:
        mask[0, 0, : L // 2] = True
    mask[:, :, -1:, :] &= ~mask.all(dim=2, keepdim=True)
    gate[mask] = float("-inf")
    return kv.to(device), gate.to(device)


# ---------------------------------------------------------------------------------------- CPU
def _compressor(d: int, ratio: int, overlap: bool):
    from dsv4lab.checkpoint.fake import tiny_config
    from dsv4lab.model.compressor import Compressor

    return Compressor(tiny_config(), d, ratio, overlap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False), (2, True)])
def test_reference_is_compressor_pool_math(dtype, ratio, overlap):
    """compressor_pool_ref == what Compressor.pool feeds its kv_norm (captured with a pre-hook on
    .norm), weights == its hook_weights, on random inputs with -inf slots."""
    torch.manual_seed(0)
    d = 32
    comp = _compressor(d, ratio, overlap)
    L = 2 * ratio if overlap else ratio
    kv, gate = make_inputs(2, 3, L, d, dtype, seed=ratio)
    seen = {}
    h1 = comp.norm.register_forward_pre_hook(lambda m, args: seen.__setitem__("pooled", args[0]))
    h2 = comp.hook_weights.register_forward_hook(lambda m, args, out: seen.__setitem__("w", out))
    try:
        with torch.no_grad():
            comp.pool(kv, gate, torch.arange(3))
    finally:
        h1.remove()
        h2.remove()
    ref = cp.compressor_pool_ref(kv, gate)
    assert ref.dtype == kv.dtype and ref.shape == (2, 3, d)
    assert torch.equal(ref, seen["pooled"])
    assert torch.equal(torch.softmax(gate, dim=2, dtype=torch.float32), seen["w"])
    assert torch.isfinite(ref).all()


def test_dispatcher_uses_reference_on_cpu():
    kv, gate = make_inputs(2, 5, 8, 64, torch.float32)
    assert torch.equal(cp.compressor_pool(kv, gate), cp.compressor_pool_ref(kv, gate))
    assert not cp.supported(kv, gate)


def test_dispatcher_without_cutlass(monkeypatch):
    """cutlass not importable (even with a CUDA device claimed): have_cute() is False and the
    dispatcher takes the reference."""
    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "cutlass" or name.startswith("cutlass."):
            raise ImportError("no cutlass here")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cp._cutlass_importable.cache_clear()
    try:
        assert not cp.have_cute()
        kv, gate = make_inputs(1, 2, 4, 16, torch.bfloat16)
        assert torch.equal(cp.compressor_pool(kv, gate), cp.compressor_pool_ref(kv, gate))
    finally:
        cp._cutlass_importable.cache_clear()


def test_no_kernels_env(monkeypatch):
    monkeypatch.setenv("DSV4LAB_NO_KERNELS", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not cp.have_cute()


def test_import_is_lazy():
    """Importing the module imports neither cutlass nor cuda-python and initialises no CUDA."""
    code = textwrap.dedent("""
        import sys, torch
        before = set(sys.modules)  # torch itself may import cuda.bindings
        import dsv4lab.kernels.compressor_pool_cute as m
        kv = torch.randn(1, 2, 4, 8); g = torch.randn(1, 2, 4, 8)
        m.compressor_pool(kv, g)
        new = set(sys.modules) - before
        print(any(k.split(".")[0] == "cutlass" for k in new), any(k.startswith("cuda.") for k in new),
              torch.cuda.is_initialized())
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "DSV4LAB_NO_KERNELS": "1"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False", "False"]


@pytest.mark.parametrize("fn", [cp.compressor_pool_ref, cp.compressor_pool, cp.compressor_pool_cute])
def test_bad_inputs(fn):
    kv, gate = make_inputs(1, 2, 4, 8, torch.float32)
    with pytest.raises(ValueError, match=r"\[B, nW, L, d\]"):
        fn(kv[0], gate[0])
    with pytest.raises(ValueError, match="shape"):
        fn(kv, gate[:, :, :3])
    with pytest.raises(ValueError, match="float32"):
        fn(kv, gate.to(torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        fn(kv.to(torch.int32), gate)
    with pytest.raises(ValueError, match="L >= 1"):
        fn(kv[:, :, :0], gate[:, :, :0])
    with pytest.raises(ValueError, match="on"):
        fn(kv, gate.to("meta"))
    with pytest.raises(ValueError):
        fn(kv.numpy(), gate)


def test_kernel_entry_needs_cuda():
    kv, gate = make_inputs(1, 2, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="CUDA"):
        cp.compressor_pool_cute(kv, gate)
    with pytest.raises(ValueError, match="CUDA"):
        cp.compressor_pool_aot(kv, gate, "/nonexistent")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("L", [1, 4, 5, 8, 12, 16, 128, 256])
@pytest.mark.parametrize("d", [8, 128, 136, 200, 512, 1024])
def test_configs_are_well_formed(dtype, L, d):
    cfg = cp.make_config(dtype, L, d)
    esize = torch.empty((), dtype=dtype).element_size()
    assert cfg.vec * cfg.tpr == d and cfg.vec * esize <= 16 and cfg.vec & (cfg.vec - 1) == 0
    assert L % cfg.slices == 0 and (L // cfg.slices) % cfg.chunk == 0
    assert cfg.tpr * cfg.slices <= cfg.max_threads and cfg.threads <= 1024
    assert cfg.smem_bytes <= 48 * 1024
    if d == 512 and dtype == torch.bfloat16:
        assert cfg.vec == 8  # 128-bit kv loads at the V4 shapes


def test_config_rejects_wide_rows():
    with pytest.raises(ValueError):
        cp.make_config(torch.float32, 8, 4096)  # 1024 threads per row > 256
    kv, gate = make_inputs(1, 1, 4, 1, torch.float32)
    assert not cp.supported(kv, gate)


def emulate(kv: torch.Tensor, gate: torch.Tensor, cfg: "cp.PoolConfig") -> torch.Tensor:
    """The kernel's algorithm in PyTorch fp32: per slice an online softmax over chunks of K slots
    starting from -FLT_MAX (exp2 with log2 e), then the slice merge; one rounding at the end."""
    B, nW, L, d = kv.shape
    x, g = kv.reshape(-1, L, d).float(), gate.reshape(-1, L, d)
    n = L // cfg.slices
    parts = []
    for s in range(cfg.slices):
        m = torch.full(x.shape[::2], -3.4028234663852886e38)
        tot, acc = torch.zeros_like(m), torch.zeros_like(m)
        for c0 in range(s * n, (s + 1) * n, cfg.chunk):
            gc, xc = g[:, c0:c0 + cfg.chunk], x[:, c0:c0 + cfg.chunk]
            m_new = torch.maximum(m, gc.amax(1))
            alpha = torch.exp2((m - m_new) * LOG2E)
            p = torch.exp2((gc - m_new[:, None]) * LOG2E)
            tot, acc, m = tot * alpha + p.sum(1), acc * alpha + (p * xc).sum(1), m_new
        parts.append((m, tot, acc))
    mt = torch.stack([p[0] for p in parts]).amax(0)
    f = [torch.exp2((p[0] - mt) * LOG2E) for p in parts]
    tot = sum(p[1] * fi for p, fi in zip(parts, f))
    acc = sum(p[2] * fi for p, fi in zip(parts, f))
    return (acc / tot).to(kv.dtype).reshape(B, nW, d)


def check_close(y: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor) -> None:
    """The tolerances of the module docstring."""
    ref = cp.compressor_pool_ref(kv, gate).float()
    y = y.float()
    assert y.shape == ref.shape and torch.isfinite(y).all()
    if kv.dtype == torch.float32:
        bound = 1e-5 * ref.abs().max() + 1e-5 * ref.abs()
        assert ((y - ref).abs() <= bound).all(), f"max err {(y - ref).abs().max():.3e}"
    else:
        mx = ref.abs().max()
        assert (y - ref).abs().max() <= 1e-2 * mx, f"max err {(y - ref).abs().max() / mx:.3e} of max"
        ref32 = (kv.float() * torch.softmax(gate, dim=2, dtype=torch.float32)).sum(dim=2)
        bound = 2**-8 * ref32.abs() + 1e-4 * ref32.abs().max()
        assert ((y - ref32).abs() <= bound).all(), f"max err vs fp32 math {(y - ref32).abs().max():.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("L,d", SHAPES + [(12, 136), (5, 200)])
def test_emulated_algorithm_within_tolerance(dtype, L, d, one_thread):
    """The kernel's math (CPU emulation, same configs) meets the GPU tolerances."""
    kv, gate = make_inputs(3, 20, L, d, dtype, seed=L + d)
    check_close(emulate(kv, gate, cp.make_config(dtype, L, d)), kv, gate)


def test_export_aot_compiles_for_sm90(tmp_path):
    """cute.compile runs without a device: the cubin is ELF for sm_90 with the (u64 x3, u32) ABI.
    The one CPU check that the kernel still compiles, so the `cute` extra is part of `make test`."""
    assert HAVE_CUTLASS, "nvidia-cutlass-dsl is part of the test set-up (pip install -e '.[cute]'): it compiles for sm_90a without a GPU"
    [e] = cp.export_aot(tmp_path, [(torch.bfloat16, 8, 512)])
    cubin = (tmp_path / f"{e['key']}.cubin").read_bytes()
    flags = int.from_bytes(cubin[48:52], "little")  # e_flags: SM in bits 8-15 (CUDA 13 ELF) or 0-7 (CUDA 12)
    assert cubin[:4] == b"\x7fELF" and 90 in ((flags >> 8) & 0xFF, flags & 0xFF), hex(flags)
    assert e["params"] == ["u64", "u64", "u64", "u32"] and e["threads"] == 128 and e["arch"] == "sm_90a"
    assert cp.aot_has(tmp_path, torch.bfloat16, 8, 512) and not cp.aot_has(tmp_path, torch.float32, 8, 512)


# ---------------------------------------------------------------------------------------- GPU
_AOT_BUILT: dict = {}


def _aot_dir(dtype: torch.dtype, L: int, d: int) -> str:
    """$DSV4LAB_CUTE_AOT_DIR when it holds this shape (a machine without the DSL), else cubins
    exported here with cute.compile (the `cute` extra is part of the project's install)."""
    if AOT_DIR and cp.aot_has(AOT_DIR, dtype, L, d):
        return AOT_DIR
    key = (dtype, L, d)
    if key not in _AOT_BUILT:
        assert HAVE_CUTLASS, "no AOT cubin for this shape and nvidia-cutlass-dsl is not installed (pip install -e '.[cute]')"
        import tempfile

        out = tempfile.mkdtemp(prefix="cute_aot_")
        cp.export_aot(out, [key])
        _AOT_BUILT[key] = out
    return _AOT_BUILT[key]


def _run(backend: str, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    if backend == "jit":
        assert cp.have_cute(), "nvidia-cutlass-dsl must be importable on a GPU machine (pip install -e '.[cute]')"
        return cp.compressor_pool_cute(kv, gate)
    return cp.compressor_pool_aot(kv, gate, _aot_dir(kv.dtype, kv.shape[2], kv.shape[3]))


@pytest.mark.parametrize("backend", ["jit", "aot"])
@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("L,d", SHAPES)
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs CUDA")
def test_kernel_parity(backend, L, d, dtype, rows):
    B, nW = (1, 1) if rows == 1 else (3, 100)
    kv, gate = make_inputs(B, nW, L, d, dtype, seed=rows * 7 + L, device="cuda")
    y = _run(backend, kv, gate)
    torch.cuda.synchronize()
    assert y.dtype == kv.dtype and y.device == kv.device
    check_close(y.cpu(), kv.cpu(), gate.cpu())


@pytest.mark.parametrize("backend", ["jit", "aot"])
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs CUDA")
def test_kernel_noncontiguous_and_offset_inputs(backend):
    """Views (a slot slice, an offset start) are made contiguous/aligned before the launch, and the
    output of one call is not clobbered by the next."""
    big_kv, big_gate = make_inputs(2, 9, 128, 512, torch.bfloat16, seed=3, device="cuda")
    kv, gate = big_kv[:, 1:, :8], big_gate[:, 1:, :8]  # [2, 8, 8, 512], non-contiguous
    gate[:, :, -1] = gate[:, :, -1].nan_to_num(neginf=0.0)  # no all -inf column in this view
    y = _run(backend, kv, gate)
    y2 = _run(backend, *make_inputs(1, 1, 8, 512, torch.bfloat16, seed=4, device="cuda"))
    torch.cuda.synchronize()
    check_close(y.cpu(), kv.cpu(), gate.cpu())
    assert y2.shape == (1, 1, 512)
    kv1 = big_kv.flatten()[8:8 + 4 * 8 * 512].view(1, 4, 8, 512)  # 16-byte aligned, offset start
    g1 = big_gate.flatten()[1:1 + 4 * 8 * 512].view(1, 4, 8, 512)  # 4-byte offset: cloned
    g1[:, :, -1] = g1[:, :, -1].nan_to_num(neginf=0.0)
    check_close(_run(backend, kv1, g1).cpu(), kv1.cpu(), g1.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs CUDA")
def test_dispatcher_uses_kernel_on_cuda():
    kv, gate = make_inputs(2, 16, 8, 512, torch.bfloat16, seed=5, device="cuda")
    y = cp.compressor_pool(kv, gate)
    check_close(y.cpu(), kv.cpu(), gate.cpu())
    assert cp.have_cute()
    assert torch.equal(y, cp.compressor_pool_cute(kv, gate))
